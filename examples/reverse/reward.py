"""The example's reward: how much of the reversed word the reply got right.

Aurora imports it on the trainer only (workers never see answers), as ``reward: reward:score`` in
topology.yaml; this file's directory is searched first. It must take (prompt, completion, answer)
and return a number in [0, 1]; 1 counts as correct in the held-out evaluation.
"""

from __future__ import annotations


def score(prompt: str, completion: str, answer: str) -> float:
    """1 for exactly the answer; else half a point spread over the letters in their place."""
    got = completion.strip()
    if got == answer:
        return 1.0
    hits = sum(a == b for a, b in zip(got, answer, strict=False))
    return 0.5 * hits / len(answer)
