"""Rollout engines: the `Engine` interface and `TorchEngine`, batched sampling on a local causal LM.

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

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from aurora.codec import Weights
from aurora.config.strict import convert
from aurora.errors import ConfigError, DeltaFormatError, ProtocolError
from aurora.model import CharTokenizer, ModelSpec, build_model


@dataclass(frozen=True, slots=True)
class Prompt:
    id: int
    text: str


@dataclass(frozen=True, slots=True)
class Completion:
    prompt_id: int
    text: str
    tokens: list[int]
    logprobs: list[float]
    version: int


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

    def generate(self, prompts: Sequence[Prompt], version: int) -> list[Completion]: ...

    def weights(self) -> Weights:
        """The effective weights, read back from the engine."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    kind: str = "torch"
    """``torch`` (`TorchEngine`) or ``synthetic`` (`SyntheticEngine`, a load generator)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0 samples greedily."""
    seed: int = 0
    token_s: float = 0.0
    """synthetic only: seconds per generated token position of a batch (a stand-in for compute)."""

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "synthetic"):
            raise ConfigError(f"unknown engine kind {self.kind!r} (this build has: torch, synthetic)", path="kind")
        if self.max_new_tokens < 1:
            raise ConfigError("must be >= 1", path="max_new_tokens")
        if self.temperature < 0:
            raise ConfigError("must be >= 0", path="temperature")

    @classmethod
    def from_section(cls, section: dict[str, Any], file: str | None = None) -> EngineSpec:
        return convert(cls, section, file=file, path="engine")


class _VerifiedApply:
    """The engines' shared half of the contract: the atomic, verified `apply`, and the
    refusal to generate with any version but the one served. Subclasses copy tensors
    from the host copy in `_copy` and read their weights back in `weights`."""

    version: int | None

    def weights(self) -> Weights:
        raise NotImplementedError

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        """Copy the named tensors (None: every one) from ``host`` into the engine."""
        raise NotImplementedError

    def apply(self, update: WeightUpdate) -> None:
        self.version = None  # serving nothing until the check passes
        self._copy(update.weights, update.touched)
        if self.weights().digest() != update.digest:
            self._copy(update.weights, None)
            if self.weights().digest() != update.digest:
                raise DeltaFormatError(f"engine weights do not hash to version {update.version}'s digest")
        self.version = update.version

    def _serving(self, version: int) -> None:
        if self.version != version:
            raise ProtocolError(f"engine serves version {self.version}, asked to generate with {version}",
                                remote=False)  # fmt: skip


class TorchEngine(_VerifiedApply):
    """`Engine` on a `Qwen3ForCausalLM`: fp32 compute over bf16-valued weights, KV-cached sampling.

    The parameters hold bf16 values in fp32 (a lossless widening), so reading
    them back as bf16 gives exactly the published bits."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.tok = CharTokenizer()
        self.model = build_model(spec.model).float()
        self._params = dict(self.model.named_parameters())
        self.version: int | None = None

    # -- weights
    def weights(self) -> Weights:
        with torch.no_grad():
            return Weights.from_tensors({n: p.detach().to(torch.bfloat16) for n, p in self._params.items()})

    def apply(self, update: WeightUpdate) -> None:
        names = set(update.weights)
        if names != set(self._params):
            missing, extra = sorted(set(self._params) - names), sorted(names - set(self._params))
            raise DeltaFormatError(f"weights do not fit the model: missing {missing[:3]}, unknown {extra[:3]}")
        super().apply(update)

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        tensors = host.to_tensors()
        with torch.no_grad():
            for n in tensors if names is None else names:
                self._params[n].copy_(tensors[n])

    # -- sampling
    def generate(self, prompts: Sequence[Prompt], version: int) -> list[Completion]:
        self._serving(version)
        if not prompts:
            return []
        gen = torch.Generator().manual_seed(hash((self.spec.seed, version, tuple(p.id for p in prompts))) & 0x7FFF_FFFF)
        toks, lps = self._sample([self.tok.encode(p.text) for p in prompts], gen)
        return [
            Completion(p.id, self.tok.decode(t), t, lp, version) for p, t, lp in zip(prompts, toks, lps, strict=True)
        ]

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], gen: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[CharTokenizer.PAD] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        b = len(prompts)
        done = torch.zeros(b, dtype=torch.bool)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        for _ in range(self.spec.max_new_tokens):
            logits = out.logits[:, -1, :].float()
            t = self.spec.temperature
            logp = torch.log_softmax(logits / t if t > 0 else logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0] if t > 0 else logits.argmax(-1)
            chosen = logp.gather(1, nxt[:, None])[:, 0]
            for i in range(b):
                if not done[i]:
                    toks[i].append(int(nxt[i]))
                    lps[i].append(float(chosen[i]))
            done |= nxt == CharTokenizer.EOS
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=out.cache,
                             use_cache=True, logits_to_keep=1)  # fmt: skip
        return toks, lps


class SyntheticEngine(_VerifiedApply):
    """A load generator with the `Engine` contract, for tests and benchmarks of the system around it.

    It keeps its own copy of the weights (applied and verified exactly as `TorchEngine`
    does: touched tensors copied, digest checked, full reload on a mismatch) but does not
    run a model: a completion is the prompt's characters reversed, ``max_new_tokens``
    long at most, each token with log-probability 0, after ``token_s`` seconds per token."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.tok = CharTokenizer()
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
        for n in names:
            mine[n].bits[:] = host[n].bits
        mine.forget_digests()

    def generate(self, prompts: Sequence[Prompt], version: int) -> list[Completion]:
        self._serving(version)
        n = self.spec.max_new_tokens
        if prompts and self.spec.token_s:
            time.sleep(self.spec.token_s * n)
        out = []
        for p in prompts:
            toks = self.tok.encode(p.text[::-1])[1 : n + 1]
            out.append(Completion(p.id, self.tok.decode(toks), toks, [0.0] * len(toks), version))
        return out


def make_engine(section: dict[str, Any], file: str | None = None) -> Engine:
    spec = EngineSpec.from_section(section, file)
    return TorchEngine(spec) if spec.kind == "torch" else SyntheticEngine(spec)
