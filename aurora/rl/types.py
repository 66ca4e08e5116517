"""The RL data contract: a prompt, a sample, a prompt's group of samples (no torch here).

`Prompt` is what the trainer's coordinator leases (its ``answer`` never leaves
the trainer); `Completion` is what a rollout worker sends back: the prompt's
token ids, its group of `Sample`s (token ids and their behaviour
log-probabilities) and the weight version that made them. The wire form of a
completion, and its validation, is `aurora.protocol.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack


@dataclass(frozen=True, slots=True)
class Prompt:
    id: int
    text: str
    answer: str = ""
    """The reference answer: kept by the trainer, never sent to workers."""


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    tokens: list[int]
    logprobs: list[float]
    """Per token: its log-probability under the behaviour (serving) weights at the sampling temperature."""


@dataclass(frozen=True, slots=True)
class Completion:
    """A prompt's group of samples, all made with weight ``version``."""

    prompt_id: int
    prompt_tokens: list[int]
    samples: list[Sample]
    version: int

    def to_wire(self) -> bytes:
        return bytes(msgpack.packb([self.prompt_id, self.prompt_tokens, self.version,
                                    [[s.text, s.tokens, s.logprobs] for s in self.samples]]))  # fmt: skip

    @classmethod
    def from_wire(cls, data: bytes | memoryview) -> Completion:
        """Raises ValueError for anything but a well-formed completion (a worker's message is untrusted)."""
        try:
            pid, ptoks, version, samples = msgpack.unpackb(data)
            out = cls(int(pid), [int(t) for t in ptoks],
                      [Sample(str(t), [int(x) for x in toks], [float(x) for x in lps]) for t, toks, lps in samples],
                      int(version))  # fmt: skip
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed completion: {e!r}") from None
        if not out.samples or any(len(s.tokens) != len(s.logprobs) or not s.tokens for s in out.samples):
            raise ValueError("malformed completion: a sample without tokens, or tokens and log-probs differ in length")
        return out
