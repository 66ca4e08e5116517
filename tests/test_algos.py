"""GRPO's arithmetic against values worked out by hand (`aurora.rl.algos`)."""

from __future__ import annotations

import math

import pytest
import torch

from aurora.rl.algos import ADV_EPS, clip_fraction, clipped_surrogate, group_advantages, k3_kl


def test_group_advantages_normalise_by_the_sample_std() -> None:
    adv, std = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5; sample std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    assert std == pytest.approx(math.sqrt(1 / 3))
    assert adv.tolist() == pytest.approx(
        [0.5 / (math.sqrt(1 / 3) + ADV_EPS)] * 1
        + [-0.5 / (math.sqrt(1 / 3) + ADV_EPS)] * 2
        + [0.5 / (math.sqrt(1 / 3) + ADV_EPS)]
    )
    flat, std = group_advantages(torch.tensor([0.3, 0.3, 0.3]))
    assert std == 0.0
    assert flat.tolist() == [0.0, 0.0, 0.0]


def test_the_clipped_surrogate_takes_the_pessimistic_side() -> None:
    # one response token per row: ratio 0.6/0.5 = 1.2, clipped to 1.1 with eps 0.1
    logp = torch.log(torch.tensor([[0.6], [0.6], [0.4]]))
    old = torch.log(torch.tensor([[0.5], [0.5], [0.5]]))
    mask = torch.ones(3, 1)
    adv = torch.tensor([[1.0], [-1.0], [1.0]])
    loss, ratio = clipped_surrogate(logp, old, adv, mask, 0.1)
    assert ratio[:, 0].tolist() == pytest.approx([1.2, 1.2, 0.8])
    # A=+1, ρ=1.2: min(1.2, 1.1) = 1.1; A=-1, ρ=1.2: min(-1.2, -1.1) = -1.2; A=+1, ρ=0.8: min(0.8, 0.9) = 0.8
    assert float(loss) == pytest.approx(-(1.1 - 1.2 + 0.8) / 3)
    assert clip_fraction(ratio, mask, 0.1) == pytest.approx(1.0)  # every ratio is off by 0.2


def test_masked_positions_count_for_nothing() -> None:
    logp = torch.log(torch.tensor([[0.6, 0.9]]))
    old = torch.log(torch.tensor([[0.5, 0.1]]))
    mask = torch.tensor([[1.0, 0.0]])
    loss, ratio = clipped_surrogate(logp, old, torch.tensor([[1.0]]), mask, 0.3)
    assert float(ratio[0, 1]) == 1.0
    assert float(loss) == pytest.approx(-1.2)


def test_k3_kl_by_hand() -> None:
    # ref 0.5, policy 0.25: d = log 2, k3 = 2 - log 2 - 1
    got = k3_kl(torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5]])), torch.ones(1, 2))
    assert float(got) == pytest.approx((2 - math.log(2) - 1 + 0.0) / 2)


def test_dual_clip_bounds_a_negative_advantage_samples_pull() -> None:
    # ratio e^10 with A = -1: the plain clipped objective would be -e^10; dual clip bounds it at 3 * A
    logp, old = torch.tensor([[0.0]]), torch.tensor([[-10.0]])
    loss, _ = clipped_surrogate(logp.requires_grad_(), old, torch.tensor([[-1.0]]), torch.ones(1, 1), 0.2)
    assert float(loss.detach()) == pytest.approx(3.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert float(logp.grad) == 0.0  # a constant: no gradient from it
