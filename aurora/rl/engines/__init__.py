"""Rollout engines: `make_engine` builds the one an ``engine:`` section describes.

`aurora.rl.engines.base` is the contract every engine keeps (the verified
`apply`); `torch_engine`, `vllm_engine` and `synthetic` are the engines, and `vllm_async` the
continuous one (vLLM's async engine: its own contract, asynchronous, `aurora.actors.work.ContinuousWorker`),
in the rollout's process or on a ``vllm serve`` of its host (`vllm_served`).
"""

from __future__ import annotations

from typing import Any

from aurora.config.rl import EngineSpec
from aurora.rl.engines.base import Engine, VerifiedApply, WeightUpdate, sample_seed


def make_engine(spec: EngineSpec) -> Any:
    """The engine ``spec`` describes (its model already resolved: `aurora.config.rl.resolve_paths`): an
    `Engine`, or for a continuous vLLM rollout an `AsyncVllmEngine` (to be started on the event loop)."""
    if spec.kind == "vllm" and spec.continuous:
        from aurora.rl.engines.vllm_async import AsyncVllmEngine

        if spec.serve is not None:
            from aurora.rl.engines.vllm_served import ServedVllm

            return AsyncVllmEngine(spec, ServedVllm)
        return AsyncVllmEngine(spec)
    if spec.kind == "vllm":
        from aurora.rl.engines.vllm_engine import VllmEngine

        return VllmEngine(spec)
    if spec.kind == "torch":
        from aurora.rl.engines.torch_engine import TorchEngine

        return TorchEngine(spec)
    from aurora.rl.engines.synthetic import SyntheticEngine

    return SyntheticEngine(spec)


__all__ = ["Engine", "EngineSpec", "VerifiedApply", "WeightUpdate", "make_engine", "sample_seed"]
