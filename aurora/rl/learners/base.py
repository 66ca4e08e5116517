"""The learner interface: what the trainer's publisher drives.

`Learner.step(batch)` trains on ``batch_size`` accepted results (each a
prompt with its group of samples) and returns the next version's weights;
``stats`` then describes that step (logged with it). The learners are
`aurora.rl.learners.grpo.GrpoLearner` (RL) and
`aurora.rl.learners.synthetic.SyntheticLearner` (a load generator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from aurora.codec import Weights
from aurora.rl.types import Prompt


class Learner(Protocol):
    batch_size: int
    """Accepted results per step; 0: step every ``interval_s`` without samples (load generators)."""
    interval_s: float
    group_size: int
    """Samples per prompt that the workers make."""
    seed: int
    stats: dict[str, Any]
    """The last step's figures (reward, accuracy, loss, ...; empty for load generators)."""

    def initial(self) -> Weights:
        """Version 0."""
        ...

    def step(self, batch: Sequence[Any]) -> Weights:
        """Train on ``batch`` ((prompt, completion) pairs); return the next version's weights (a new object)."""
        ...

    def evaluate(self, version: int) -> dict[str, Any] | None:
        """Held-out figures (``eval_accuracy``, ...) of the weights of ``version`` (the last returned)
        when an evaluation is due at it; None otherwise (and always, for load generators)."""
        ...

    def restore(self, weights: Weights, version: int) -> None:
        """Continue from ``version`` (read back from the store after a restart)."""
        ...

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids: what workers generate from and what the learner trains on."""
        ...

    @property
    def vocab_size(self) -> int:
        """A result's token ids lie in [0, vocab_size)."""
        ...
