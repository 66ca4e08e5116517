"""`SyntheticEngine`: a load generator with the engine contract (no model is run)."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from aurora.codec import Weights
from aurora.config.rl import EngineSpec, ModelSpec
from aurora.errors import ProtocolError
from aurora.rl.engines.base import VerifiedApply, prompt_ids
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt, Sample


class SyntheticEngine(VerifiedApply):
    """A load generator with the `Engine` contract, for tests and benchmarks of the system around it.

    It keeps its own copy of the weights (applied and verified exactly as `TorchEngine`
    does: touched tensors copied, digest checked, full reload on a mismatch) but does not
    run a model: every sample is the prompt's tokens reversed, ``max_new_tokens``
    long at most, each token with log-probability 0, after ``token_s`` seconds per token."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.tok = Tokenizer.for_model(ModelSpec(preset=spec.the_model.preset))
        self._weights: Weights | None = None
        self.version: int | None = None

    def weights(self) -> Weights:
        if self._weights is None:
            raise ProtocolError("the engine holds no weights yet", remote=False)
        return self._weights

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        mine = self._weights
        if names is None or mine is None or set(mine) != set(host):
            self._weights = host.copy()
            return
        for name in names:
            mine[name].bits[:] = host[name].bits
        mine.forget_digests()

    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        self._serving(version)
        k = self.spec.max_new_tokens
        if prompts and self.spec.token_s:
            time.sleep(self.spec.token_s * k)
        out = []
        for p in prompts:
            ids = prompt_ids(p, self.tok)
            toks = [t for t in reversed(ids) if t != self.tok.bos_id][:k] or [self.tok.eos_id]
            sample = Sample(toks, [0.0] * len(toks))
            out.append(Completion(p.id, ids, [sample] * n, version))
        return out
