"""`SyntheticLearner`, a load generator that stands in for RL.

It produces versions with the statistics that matter for weight sync: bf16
weights ~N(0, 0.02) in a few tensors, of which a configurable ``density``
fraction moves by ±1–2 ULP per step (bit-pattern steps, as lr ~1e-6 AdamW
updates that survive the bf16 cast do), never to a non-finite or subnormal value. It is clearly a benchmark/test load,
not training: it ignores its samples. With ``model:`` it starts from a locally
built model's weights instead, so that rollout engines on that model serve
(and really change with) every version.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aurora.codec import Weights
from aurora.config.rl import ModelSpec, SyntheticSpec
from aurora.errors import ConfigError
from aurora.rl.learners.base import LearnerContext
from aurora.rl.model import VOCAB_SIZE, Tokenizer, build_model, parameters
from aurora.rl.types import Prompt


class SyntheticLearner:
    """A load generator (see the module docstring)."""

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.batch_size, self.interval_s, self.group_size, self.seed = (
            spec.samples_per_step,
            spec.interval_s,
            1,
            spec.seed,
        )
        self.stats: dict[str, Any] = {}
        self.rng = np.random.default_rng(spec.seed)
        self.tok = Tokenizer.for_model(spec.model or ModelSpec())
        self._vocab = VOCAB_SIZE
        if spec.model is not None:
            model = build_model(spec.model)
            self._vocab = int(model.get_input_embeddings().num_embeddings)
            params = parameters(model)
            self._bits = {n: t.reshape(-1).view(torch.int16).numpy().view(np.uint16).copy() for n, t in params.items()}
            self._shapes = {n: tuple(t.shape) for n, t in params.items()}
            return
        per = spec.params // spec.tensors
        self._bits = {  # bf16 bit patterns: the top half of each fp32
            f"layers.{i}.weight": (
                (self.rng.standard_normal(per, dtype=np.float32) * 0.02).view(np.uint32) >> 16
            ).astype(np.uint16)
            for i in range(spec.tensors)
        }
        self._shapes = {n: (b.size,) for n, b in self._bits.items()}

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return tuple(self.tok.encode(prompt.text))

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def _weights(self) -> Weights:
        return Weights.from_tensors({k: _as_bf16(v).reshape(self._shapes[k]) for k, v in self._bits.items()})

    def initial(self) -> Weights:
        return self._weights()

    def evaluate(self, version: int) -> dict[str, Any] | None:
        return None  # nothing to evaluate: a load generator

    def restore(self, weights: Weights, version: int) -> None:
        for n, tb in weights.items():
            if n not in self._bits or tb.bits.size != self._bits[n].size:
                raise ConfigError(f"the stored weights do not fit this learner (tensor {n!r})", path="learner")
            self._bits[n] = tb.bits.copy().astype(np.uint16)
        self.rng = np.random.default_rng((self.spec.seed, version))

    def step(self, batch: Sequence[Any] = ()) -> Weights:
        """The next version: each tensor a new array (the arrays of a version returned are never written
        again, so a version shares them with the learner and costs one copy of the weights, not two)."""
        if self.spec.step_s:
            time.sleep(self.spec.step_s)
        for name, old in self._bits.items():
            bits = self._bits[name] = old.copy()
            k = max(1, round(bits.size * self.spec.density))
            pos = self.rng.choice(bits.size, size=k, replace=False)
            steps = self.rng.choice(np.array([-2, -1, 1, 2], dtype=np.int32), size=k, p=[0.1, 0.4, 0.4, 0.1])
            moved = (bits[pos].astype(np.int32) + steps).astype(np.uint16)
            exp = moved & 0x7F80
            # a step never makes an inf or a NaN, nor a subnormal (below 1.2e-38: no real update lands
            # there, and CPU kernels flush them to zero, so no engine computes with one)
            normal = (exp != 0x7F80) & ((exp != 0) | ((moved & 0x7F) == 0))
            bits[pos[normal]] = moved[normal]
        return self._weights()


def _as_bf16(bits: np.ndarray) -> Any:
    """A bf16 tensor over ``bits`` (no copy: `SyntheticLearner.step` never writes a returned array)."""
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def make(context: LearnerContext) -> SyntheticLearner:
    """The load generator of a ``learner: {kind: synthetic}`` section (the factory `make_learner` calls)."""
    return SyntheticLearner(context.spec)
