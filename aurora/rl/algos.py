"""GRPO's arithmetic as pure functions on tensors (no models, no state): hand-checkable.

* `group_advantages` — rewards normalised within a prompt's group,
  ``A = (r - mean) / (std + eps)`` (sample standard deviation; a flat group gets 0);
* `clipped_surrogate` — the PPO/GRPO objective per response token,
  ``-min(ρA, clip(ρ, 1-ε, 1+ε)A)`` with ``ρ = exp(logp - old)``, averaged over the masked tokens;
  for a negative advantage the objective is also bounded below by ``c·A`` (dual clip, c =
  ``dual_clip``): a sample whose ratio is huge — a behaviour log-probability far below the
  learner's, an error or a lie — contributes a constant, not a gradient that swamps the step;
* `k3_kl` — the k3 estimator of KL(π_θ ‖ π_ref), ``exp(d) - d - 1`` with ``d = ref - logp``,
  averaged over the masked tokens.

Masks are 1.0 on the response tokens a loss counts and 0.0 elsewhere; every mean is over them.
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-4
"""Added to a group's standard deviation (a group that barely varies does not blow up)."""


def group_advantages(rewards: torch.Tensor, eps: float = ADV_EPS) -> tuple[torch.Tensor, float]:
    """A group's advantages and its reward standard deviation (0 for a single sample)."""
    std = float(rewards.std()) if rewards.numel() > 1 else 0.0
    return (rewards - rewards.mean()) / (std + eps), std


DUAL_CLIP = 3.0
"""c of dual-clip PPO (Ye et al. 2020, the value they use)."""


def clipped_surrogate(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    dual_clip: float = DUAL_CLIP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to minimise, the importance ratios ρ). ``logp``/``old``/``mask``: [batch, T];
    ``adv``: [batch, 1]. Masked-out positions have ρ = 1 and count for nothing."""
    ratio = torch.exp((logp - old) * mask)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    return -(surrogate * mask).sum() / mask.sum(), ratio


def k3_kl(ref_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(π_θ ‖ π_ref) per masked token, averaged."""
    d = (ref_logp - logp) * mask
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


def clip_fraction(ratio: torch.Tensor, mask: torch.Tensor, clip_eps: float) -> float:
    """The fraction of masked tokens whose ratio lies outside [1-ε, 1+ε]."""
    return float((((ratio.detach() - 1).abs() > clip_eps).float() * mask).sum() / mask.sum())
