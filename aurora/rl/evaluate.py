"""Held-out evaluation of a version, on the trainer: greedy replies to the task's held-out prompts,
scored for correctness only.

Why on the trainer and not leased to rollouts: the trainer holds the exact weights of every version
it publishes (their bf16 cast), needs no second kind of work, lease or result in the protocol, and
keeps the held-out answers where the training answers already are. The cost is the trainer's time:
``eval_s`` is logged with each evaluation (`aurora.events.EVALUATED`), and an evaluation runs only
every ``learner.eval.every`` versions.

The model evaluated is the version: its published bf16 weights, loaded into Aurora's torch engine
(`aurora.rl.engines.torch_engine`, what rollouts run without vLLM: float32 compute, which CPUs run
fastest) at temperature 0. Prompts are the first ``prompts`` held-out ones, the same each time,
tokenized as the learner tokenizes training prompts (chat template and system prompt included),
generated in batches of ``batch`` up to ``max_new_tokens``.

Invariant: evaluation changes neither the master weights nor the optimiser; its engine is a model of
its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from aurora.codec import Weights
from aurora.config.rl import EngineSpec, EvalSpec, ModelSpec
from aurora.rl.tasks import Task
from aurora.rl.types import Prompt


class Evaluator:
    """See the module docstring."""

    def __init__(
        self,
        spec: EvalSpec,
        task: Task,
        model: ModelSpec,
        tokenize: Callable[[Prompt], Sequence[int]],
        max_new_tokens: int,
    ) -> None:
        self.spec = spec
        self.task = task
        self.model = model
        held = task.heldout()[: spec.prompts] if spec.every else []  # none asked for: none made
        self.prompts = [replace(p, tokens=tuple(tokenize(p))) for p in held]
        self.max_new_tokens = spec.max_new_tokens or max_new_tokens
        self._engine: Any = None

    def due(self, version: int) -> bool:
        return bool(self.spec.every) and bool(self.prompts) and version % self.spec.every == 0

    def run(self, weights: Weights, version: int) -> dict[str, Any]:
        """Evaluate version ``version`` (``weights``): ``eval_accuracy``, ``eval_prompts``, ``eval_s``."""
        from aurora.rl.engines import WeightUpdate
        from aurora.rl.engines.torch_engine import TorchEngine

        t0 = time.monotonic()
        if self._engine is None:
            self._engine = TorchEngine(
                EngineSpec(model=self.model, max_new_tokens=self.max_new_tokens, temperature=0.0)
            )
        self._engine.apply(WeightUpdate(version, weights.digest(), weights, None))
        correct = 0
        for at in range(0, len(self.prompts), self.spec.batch):
            batch = self.prompts[at : at + self.spec.batch]
            for prompt, comp in zip(batch, self._engine.generate(batch, version), strict=True):
                text = self._engine.tok.decode(comp.samples[0].tokens)
                correct += self.task.score(prompt, text).correct
        return {
            "eval_accuracy": round(correct / len(self.prompts), 4),
            "eval_prompts": len(self.prompts),
            "eval_s": round(time.monotonic() - t0, 3),
        }
