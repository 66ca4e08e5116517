"""The RL data contract: a prompt, a sample, a prompt's group of samples (plain values, no torch).

`Prompt` is what the trainer's coordinator leases: its text, the trainer's own
tokenization of it (``tokens``: what workers generate from, and what the learner
trains on), and the reference ``answer``, which never leaves the trainer.
`Completion` is a prompt's group of `Sample`s (generated token ids and their
behaviour log-probabilities) and the weight version that made them. Texts are
decoded from token ids by whoever needs them; a worker's own text is never
trusted. The wire form, with its validation, is `aurora.protocol.messages`.

Every layer may import this module: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Prompt:
    id: int
    text: str
    answer: str = ""
    """The reference answer: kept by the trainer, never sent to workers."""
    tokens: tuple[int, ...] = ()
    """The prompt as the trainer tokenized it (chat template included)."""


@dataclass(frozen=True, slots=True)
class Sample:
    tokens: list[int]
    logprobs: list[float]
    """Per token: its log-probability under the behaviour (serving) weights at the sampling temperature."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Which versions made the tokens: ``(version, first token index)`` in order, the first at index 0
    (a version switch landed while this sample was generated); empty: its completion's version made
    every token."""

    def versions(self, default: int) -> list[int]:
        """The versions that made this sample's tokens, oldest first (``default``: the completion's)."""
        return [v for v, _ in self.spans] or [default]


@dataclass(frozen=True, slots=True)
class Completion:
    """A prompt's group of samples; ``version`` is the oldest weight version that made any of their
    tokens (the one the staleness rule judges); a sample's `Sample.spans` tell the rest."""

    prompt_id: int
    prompt_tokens: list[int]
    samples: list[Sample]
    version: int
