"""The loss both of this example's learners train with: REINFORCE with each group's mean reward as its
baseline, plus a small supervised term on the task's reference answers. Plain PyTorch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def logprobs(model: torch.nn.Module, prompt: list[int], sample: list[int]) -> torch.Tensor:
    """Each token of ``sample``'s log-probability under ``model`` after ``prompt``."""
    ids = torch.tensor([prompt + sample])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sample)[:, None]).squeeze(1)


def loss(
    model: torch.nn.Module,
    tok: Any,
    groups: Sequence[tuple[list[int], list[list[int]], list[float], str]],
    sft: float,
) -> torch.Tensor:
    """``groups``: (prompt token ids, each sample's token ids, each sample's reward, the reference answer)."""
    terms = []
    for prompt, samples, rewards, answer in groups:
        r = torch.tensor(rewards)
        for sample, advantage in zip(samples, r - r.mean(), strict=True):
            if advantage != 0:
                terms.append(-advantage * logprobs(model, prompt, sample).sum())
        target = tok(answer, add_special_tokens=False)["input_ids"]
        terms.append(-sft * logprobs(model, prompt, target).sum())
    return torch.stack(terms).mean()
