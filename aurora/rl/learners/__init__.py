"""Learners: `make_learner` builds the one a ``learner:`` section describes, through its factory.

Every learner is made the same way: a factory ``(LearnerContext) -> Learner`` (`aurora.rl.learners.base`)
— the built-in `grpo.make` and `synthetic.make`, or the ``module:function`` a ``kind: python`` section
names — and is held to the `Learner` interface when it is made.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from aurora.config.rl import GrpoSpec, LearnerSpec, LoopSpec, ModelSpec, PythonSpec, SyntheticSpec
from aurora.errors import ConfigError
from aurora.rl.imports import import_beside
from aurora.rl.learners.base import Learner, LearnerContext, LearnerFactory, check_learner
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
    options = dict(spec.options) if isinstance(spec, PythonSpec) else {}
    context = LearnerContext(spec, model, task, temperature, max_new_tokens, chat, checkpoint_dir, options)
    if isinstance(spec, LoopSpec):
        raise ConfigError(
            "learner kind 'loop': the trainer runs inside your own training loop (aurora.loop.TrainerLoop), "
            "not under aurora node or aurora run",
            path="learner.kind",
        )
    factory: LearnerFactory
    if isinstance(spec, GrpoSpec):
        from aurora.rl.learners.grpo import make as factory
    elif isinstance(spec, SyntheticSpec):
        from aurora.rl.learners.synthetic import make as factory
    else:
        factory = load_factory(spec)
    return check_learner(factory(context), getattr(spec, "factory", f"learner kind {spec.kind!r}"))


def load_factory(spec: PythonSpec) -> LearnerFactory:
    """The function ``spec.factory`` names; raises `ConfigError` naming it."""
    mod_name, _, fn_name = spec.factory.partition(":")
    try:
        mod = import_beside(mod_name, spec.module_dir, "aurora_learner")
    except BaseException as e:  # a user's module may raise anything while it loads, exit() included
        if isinstance(e, KeyboardInterrupt):
            raise
        where = f" (looked in {spec.module_dir} first)" if spec.module_dir else ""
        raise ConfigError(
            f"learner factory {spec.factory!r}: module {mod_name!r} does not load: {e!r}{where}",
            path="learner.factory",
        ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(
            f"learner factory {spec.factory!r}: {mod_name} has no function {fn_name!r}", path="learner.factory"
        )
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise ConfigError(
            f"learner factory {spec.factory!r}: must take one LearnerContext, not {inspect.signature(fn)}",
            path="learner.factory",
        ) from None
    except ValueError:
        pass
    return fn  # type: ignore[no-any-return]


__all__ = ["Learner", "LearnerContext", "load_factory", "make_learner"]
