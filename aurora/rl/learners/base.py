"""The learner interface: what the trainer's publisher drives — public, and the same for every learner.

`Learner.step(batch)` trains on ``batch_size`` accepted results (each a
prompt with its group of samples) and returns the next version's weights;
``stats`` then describes that step (logged with it). A learner is made by a *factory*,
``factory(context: LearnerContext) -> Learner``: the built-in ones are
`aurora.rl.learners.grpo.make` (RL) and `aurora.rl.learners.synthetic.make` (a load generator),
and ``learner: {kind: python, factory: module:function}`` in a topology names one of your own,
made and driven the same way (`check_learner` holds it to this interface when it is made). A loop
of your own that wants to call rather than be called uses `aurora.loop.TrainerLoop`, itself a
`Learner` underneath.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from aurora.codec import Weights
from aurora.config.rl import ModelSpec
from aurora.errors import ConfigError, LearnerError
from aurora.rl.tasks import Task
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


@dataclass(frozen=True, slots=True)
class LearnerContext:
    """What a learner factory is given: the topology's sections a learner needs, resolved."""

    spec: Any
    """The topology's ``learner`` section (`aurora.config.rl.GrpoSpec`, `PythonSpec`, ...)."""
    model: ModelSpec | None
    """The topology's model (its path absolute)."""
    task: Task
    """The task: its prompts, held-out prompts and reward (``task.score(prompt, text)``)."""
    temperature: float
    """The rollouts' sampling temperature (behaviour log-probabilities are at it)."""
    max_new_tokens: int
    chat: bool
    """Prompts go through the model's chat template."""
    checkpoint_dir: Path | None
    """Where the learner may keep checkpoints (in the trainer's store); None: no store."""
    options: dict[str, Any] = field(default_factory=dict)
    """``learner.options`` of a ``kind: python`` learner."""


LearnerFactory = Callable[[LearnerContext], Learner]

_ATTRIBUTES = (*Learner.__annotations__, *(n for n, v in vars(Learner).items() if isinstance(v, property)))
_METHODS = tuple(n for n, v in vars(Learner).items() if not n.startswith("_") and callable(v))
"""The interface, read from `Learner` itself (one definition)."""


def check_learner(obj: object, made_by: str) -> Learner:
    """``obj`` as a `Learner`, or a `ConfigError` naming what it lacks."""
    missing = [a for a in _ATTRIBUTES if not hasattr(obj, a)]
    missing += [m for m in _METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"{made_by} made a {type(obj).__name__}, which lacks {', '.join(missing)} of the Learner "
            "interface (aurora.rl.learners.base.Learner)",
            path="learner.factory",
        )
    return obj  # type: ignore[return-value]


def bf16_weights(tensors: Mapping[str, torch.Tensor], whose: str) -> Weights:
    """A version: the bf16 cast of ``tensors``, on the CPU, in memory of its own (a version never moves
    with the tensors it was cast from). Raises `LearnerError` naming the first tensor with a non-finite
    value (``whose`` says whose weights they are) rather than return such a version."""
    with torch.no_grad():
        cast = {n: t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True) for n, t in tensors.items()}
        bad = [n for n, t in cast.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise LearnerError(f"{whose} would hold non-finite values (first in {bad[0]!r}); not published")
    return Weights.from_tensors(cast)
