"""Learners: `make_learner` builds the one a ``learner:`` section describes."""

from __future__ import annotations

from pathlib import Path

from aurora.config.rl import GrpoSpec, LearnerSpec, LoopSpec, ModelSpec
from aurora.errors import ConfigError
from aurora.rl.learners.base import Learner
from aurora.rl.tasks import Task


def make_learner(
    spec: LearnerSpec,
    *,
    model: ModelSpec | None,
    task: Task,
    temperature: float,
    checkpoint_dir: Path | None,
    chat: bool = False,
    max_new_tokens: int = 16,
) -> Learner:
    """The learner ``spec`` describes (``model``: the topology's, paths resolved)."""
    if isinstance(spec, GrpoSpec):
        from aurora.rl.learners.grpo import GrpoLearner

        return GrpoLearner(
            spec,
            model or ModelSpec(),
            task,
            temperature=temperature,
            checkpoint_dir=checkpoint_dir,
            chat=chat,
            max_new_tokens=max_new_tokens,
        )
    if isinstance(spec, LoopSpec):
        raise ConfigError(
            "learner kind 'loop': the trainer runs inside your own training loop (aurora.loop.TrainerLoop), "
            "not under aurora node or aurora run",
            path="learner.kind",
        )
    from aurora.rl.learners.synthetic import SyntheticLearner

    return SyntheticLearner(spec)


__all__ = ["Learner", "make_learner"]
