"""The rollout engine contract: `Engine`, `WeightUpdate`, and `VerifiedApply`, the verified switch.

An engine serves one weight version at a time. The node keeps the host copy
of the weights (its `VersionFlow` commits each verified delta there, while
the engine goes on generating); at a batch boundary it hands the engine a
`WeightUpdate` — the host weights, the names of the tensors that changed
since the engine's version, and the version's digest — and the engine
applies it.

Invariants (engine conformance tests in tests/test_engine.py):

* `apply` is atomic from the caller's view: the engine's version changes only
  after its effective weights, read back, hash to the update's digest; a
  mismatch reloads every tensor and checks again, and a second mismatch raises
  `DeltaFormatError` (the engine is then not serving any version).
* `generate(prompts, version)` refuses to run on any version but the one the
  engine serves, so a result is always labelled with the weights that made it.
* Log-probabilities are those of the sampled tokens under the served weights
  at the sampling temperature (what a policy-gradient learner needs).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from aurora.codec import Weights
from aurora.errors import DeltaFormatError, ProtocolError
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt

log = structlog.get_logger("aurora.rl.engines")


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    version: int
    digest: bytes
    weights: Weights
    """The host copy; read-only for the engine, and not changed while `apply` runs."""
    touched: Collection[str] | None
    """Tensors changed since the engine's version; None: all of them."""


class Engine(Protocol):
    version: int | None

    def apply(self, update: WeightUpdate) -> None: ...

    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        """``n`` samples for each prompt, made with weight ``version`` (which the engine must serve)."""
        ...

    def weights(self) -> Weights:
        """The effective weights, read back from the engine."""
        ...


def prompt_ids(p: Prompt, tok: Tokenizer) -> list[int]:
    """The token ids an engine generates from: the trainer's (``p.tokens``), or the engine's own
    encoding of the text where a prompt carries none (local use, tests)."""
    return list(p.tokens) if p.tokens else tok.encode(p.text)


def sample_seed(seed: int, version: int, ids: Sequence[int]) -> int:
    """The sampling seed of a batch: a function of the engine seed, the version and the prompts."""
    return hash((seed, version, tuple(ids))) & 0x7FFF_FFFF


class VerifiedApply:
    """The engines' shared half of the contract: the atomic, verified `apply`, and the
    refusal to generate with any version but the one served. Subclasses copy tensors
    from the host copy in `_copy` and read their weights back in `weights`."""

    version: int | None
    full_reloads = 0
    """Times the copied weights did not hash to the version's digest and every tensor was copied again."""

    def weights(self) -> Weights:
        raise NotImplementedError

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        """Copy the named tensors (None: every one) from ``host`` into the engine."""
        raise NotImplementedError

    def _effective_digest(self) -> bytes:
        """The digest of the weights the engine now computes with (after a `_copy`)."""
        return self.weights().digest()

    def _verified(self) -> None:
        """The weights just copied hashed to the version's digest (a hook for engines that remember it)."""

    def apply(self, update: WeightUpdate) -> None:
        self.version = None  # serving nothing until the check passes
        self._copy(update.weights, update.touched)
        if self._effective_digest() != update.digest:
            log.warning(
                "engine_full_reload",
                version=update.version,
                touched="all" if update.touched is None else len(update.touched),
                why="the engine's weights did not hash to the version's digest",
            )
            self.full_reloads += 1
            self._copy(update.weights, None)
            if self._effective_digest() != update.digest:
                raise DeltaFormatError(f"engine weights do not hash to version {update.version}'s digest")
        self._verified()
        self.version = update.version

    def _serving(self, version: int) -> None:
        if self.version != version:
            raise ProtocolError(f"engine serves version {self.version}, asked to generate with {version}", remote=False)
