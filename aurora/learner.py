"""The learner interface, `make_learner`, and `SyntheticLearner`, a load generator that stands in for RL.

`Learner.step(batch)` trains on ``batch_size`` accepted results (each a
prompt with its group of samples) and returns the next version's weights;
``stats`` then describes that step (logged with it). The RL learner is
`aurora.grpo.GrpoLearner`. `SyntheticLearner` produces versions with
the statistics that matter for weight sync: bf16 weights ~N(0, 0.02) in a few
tensors, of which a configurable ``density`` fraction moves by ±1–2 ULP per step
(bit-pattern steps, as lr ~1e-6 AdamW updates that survive the bf16 cast do).
It is clearly a benchmark/test load, not training: it ignores its samples.
With ``model:`` it starts from a locally built model's weights instead, so
that rollout engines on that model serve (and really change with) every version.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from aurora.codec import Weights
from aurora.config.strict import convert
from aurora.errors import ConfigError
from aurora.model import ModelSpec, build_model, parameters


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

    def restore(self, weights: Weights, version: int) -> None:
        """Continue from ``version`` (read back from the store after a restart)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSpec:
    kind: str = "synthetic"
    params: int = 1_000_000
    """Total bf16 parameters, split over ``tensors`` tensors."""
    tensors: int = 4
    density: float = 0.02
    """Fraction of elements changed per step."""
    interval_s: float = 1.0
    """Seconds between published versions (when ``samples_per_step`` is 0)."""
    samples_per_step: int = 0
    """Step after this many accepted rollout results instead of on a timer."""
    step_s: float = 0.0
    """Seconds each step takes (a stand-in for the training compute a real learner spends)."""
    seed: int = 0
    model: ModelSpec | None = None
    """Start from this locally built model's weights (``params``/``tensors`` are then unused), so
    that rollout engines on the same model serve every version."""

    def __post_init__(self) -> None:
        if self.kind != "synthetic":
            raise ConfigError(f"unknown learner kind {self.kind!r} (this build has: synthetic)", path="kind")
        if self.params < self.tensors or self.tensors < 1:
            raise ConfigError("need params >= tensors >= 1", path="params")
        if not 0 < self.density <= 1:
            raise ConfigError("must be in (0, 1]", path="density")
        if self.interval_s <= 0:
            raise ConfigError("must be > 0", path="interval_s")
        if self.step_s < 0:
            raise ConfigError("must be >= 0", path="step_s")
        if self.samples_per_step < 0:
            raise ConfigError("must be >= 0", path="samples_per_step")


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
        if spec.model is not None:
            params = parameters(build_model(spec.model))
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

    @classmethod
    def from_section(cls, section: dict[str, Any], file: str | None = None) -> SyntheticLearner:
        return cls(convert(SyntheticSpec, section, file=file, path="learner"))

    def _weights(self) -> Weights:
        return Weights.from_tensors({k: _as_bf16(v).reshape(self._shapes[k]) for k, v in self._bits.items()})

    def initial(self) -> Weights:
        return self._weights()

    def restore(self, weights: Weights, version: int) -> None:
        for n, tb in weights.items():
            if n not in self._bits or tb.bits.size != self._bits[n].size:
                raise ConfigError(f"the stored weights do not fit this learner (tensor {n!r})", path="learner")
            self._bits[n] = tb.bits.copy().astype(np.uint16)
        self.rng = np.random.default_rng((self.spec.seed, version))

    def step(self, batch: Sequence[Any] = ()) -> Weights:
        if self.spec.step_s:
            time.sleep(self.spec.step_s)
        for bits in self._bits.values():
            k = max(1, round(bits.size * self.spec.density))
            pos = self.rng.choice(bits.size, size=k, replace=False)
            steps = self.rng.choice(np.array([-2, -1, 1, 2], dtype=np.int32), size=k, p=[0.1, 0.4, 0.4, 0.1])
            moved = (bits[pos].astype(np.int32) + steps).astype(np.uint16)
            finite = (moved & 0x7F80) != 0x7F80  # a step never makes an inf or a NaN
            bits[pos[finite]] = moved[finite]
        return self._weights()


def _as_bf16(bits: np.ndarray) -> Any:
    return torch.from_numpy(bits.copy().view(np.int16)).view(torch.bfloat16)


def make_learner(section: dict[str, Any], file: str | None, *, model: ModelSpec | None, task: Any,
                 temperature: float, checkpoint_dir: Path | None) -> Learner:  # fmt: skip
    """The learner a topology's ``learner:`` section names (``kind``: grpo, or synthetic — the default)."""
    kind = section.get("kind", "synthetic")
    if kind == "grpo":
        from aurora.grpo import GrpoLearner, GrpoSpec

        spec = GrpoSpec.from_section(section, file)
        return GrpoLearner(spec, (model or ModelSpec()).resolved(file), task, temperature=temperature,
                           checkpoint_dir=checkpoint_dir)  # fmt: skip
    if kind == "synthetic":
        return SyntheticLearner.from_section(section, file)
    raise ConfigError(
        f"unknown learner kind {kind!r} (this build has: grpo, synthetic)", file=file, path="learner.kind"
    )
