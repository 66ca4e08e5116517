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

import inspect
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgpack
import structlog
import torch

from aurora.codec import Weights
from aurora.config.strict import convert
from aurora.errors import ConfigError, DeltaFormatError, ProtocolError
from aurora.model import ModelSpec, Tokenizer, build_model

log = structlog.get_logger("aurora.engine")


@dataclass(frozen=True, slots=True)
class Prompt:
    id: int
    text: str
    answer: str = ""
    """The reference answer: kept by the trainer, never sent to workers."""


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    tokens: list[int]
    logprobs: list[float]
    """Per token: its log-probability under the behaviour (serving) weights at the sampling temperature."""


@dataclass(frozen=True, slots=True)
class Completion:
    """A prompt's group of samples, all made with weight ``version``."""

    prompt_id: int
    prompt_tokens: list[int]
    samples: list[Sample]
    version: int

    def to_wire(self) -> bytes:
        return bytes(msgpack.packb([self.prompt_id, self.prompt_tokens, self.version,
                                    [[s.text, s.tokens, s.logprobs] for s in self.samples]]))  # fmt: skip

    @classmethod
    def from_wire(cls, data: bytes | memoryview) -> Completion:
        """Raises ValueError for anything but a well-formed completion (a worker's message is untrusted)."""
        try:
            pid, ptoks, version, samples = msgpack.unpackb(data)
            out = cls(int(pid), [int(t) for t in ptoks],
                      [Sample(str(t), [int(x) for x in toks], [float(x) for x in lps]) for t, toks, lps in samples],
                      int(version))  # fmt: skip
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed completion: {e!r}") from None
        if not out.samples or any(len(s.tokens) != len(s.logprobs) or not s.tokens for s in out.samples):
            raise ValueError("malformed completion: a sample without tokens, or tokens and log-probs differ in length")
        return out


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

    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        """``n`` samples for each prompt, made with weight ``version`` (which the engine must serve)."""
        ...

    def weights(self) -> Weights:
        """The effective weights, read back from the engine."""
        ...


KINDS = ("torch", "vllm", "synthetic")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    kind: str = "torch"
    """``torch`` (`TorchEngine`), ``vllm`` (`aurora.vllm_engine.VllmEngine`) or ``synthetic`` (a load generator)."""
    model: ModelSpec | None = None
    """None: the topology's ``model``."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0 samples greedily."""
    seed: int = 0
    fixed_length: bool = False
    """Always generate ``max_new_tokens`` (ignore end-of-sequence): for benchmarks whose work must not depend on the weights."""
    token_s: float = 0.0
    """synthetic only: seconds per generated token position of a batch (a stand-in for compute)."""
    kv_cache_mb: int = 64
    """vllm only: KV cache size (the CPU build's default memory check does not fit small machines)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown engine kind {self.kind!r} (this build has: {', '.join(KINDS)})", path="kind")
        if self.max_new_tokens < 1:
            raise ConfigError("must be >= 1", path="max_new_tokens")
        if self.temperature < 0:
            raise ConfigError("must be >= 0", path="temperature")
        if self.kv_cache_mb < 1:
            raise ConfigError("must be >= 1", path="kv_cache_mb")

    @classmethod
    def from_section(cls, section: Mapping[str, Any], file: str | None = None,
                     model: ModelSpec | None = None) -> EngineSpec:  # fmt: skip
        """The topology's ``engine:`` section; its ``model`` defaults to ``model`` (the topology's),
        with a relative path resolved against ``file``."""
        spec: EngineSpec = convert(cls, dict(section), file=file, path="engine")
        m = spec.model or model or ModelSpec()
        return replace(spec, model=m.resolved(file))

    @property
    def the_model(self) -> ModelSpec:
        return self.model or ModelSpec()


def sample_seed(seed: int, version: int, ids: Sequence[int]) -> int:
    """The sampling seed of a batch: a function of the engine seed, the version and the prompts."""
    return hash((seed, version, tuple(ids))) & 0x7FFF_FFFF


class _VerifiedApply:
    """The engines' shared half of the contract: the atomic, verified `apply`, and the
    refusal to generate with any version but the one served. Subclasses copy tensors
    from the host copy in `_copy` and read their weights back in `weights`."""

    version: int | None
    full_reloads = 0
    """Times the copied weights did not hash to the version's digest and every tensor was copied again."""

    def weights(self) -> Weights:
        raise NotImplementedError

    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        """Copy the named tensors (None: every one) from ``host`` into the engine."""
        raise NotImplementedError

    def apply(self, update: WeightUpdate) -> None:
        self.version = None  # serving nothing until the check passes
        self._copy(update.weights, update.touched)
        if self.weights().digest() != update.digest:
            log.warning("engine_full_reload", version=update.version,
                        touched="all" if update.touched is None else len(update.touched),
                        why="the engine's weights did not hash to the version's digest")  # fmt: skip
            self.full_reloads += 1
            self._copy(update.weights, None)
            if self.weights().digest() != update.digest:
                raise DeltaFormatError(f"engine weights do not hash to version {update.version}'s digest")
        self.version = update.version

    def _serving(self, version: int) -> None:
        if self.version != version:
            raise ProtocolError(f"engine serves version {self.version}, asked to generate with {version}",
                                remote=False)  # fmt: skip


class TorchEngine(_VerifiedApply):
    """`Engine` on a Hugging Face causal LM: fp32 compute over bf16-valued weights, KV-cached sampling.

    The parameters hold bf16 values in fp32 (a lossless widening), so reading
    them back as bf16 gives exactly the published bits."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.tok = Tokenizer.for_model(spec.the_model)
        self.model = build_model(spec.the_model).float()
        self._params = dict(self.model.named_parameters())
        # transformers 5.24 renamed the KV cache argument from past_key_values to cache
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
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
    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        self._serving(version)
        if not prompts:
            return []
        gen = torch.Generator().manual_seed(sample_seed(self.spec.seed, version, [p.id for p in prompts]))
        encoded = [self.tok.encode(p.text) for p in prompts]
        toks, lps = self._sample([ids for ids in encoded for _ in range(n)], gen)
        samples = [Sample(self.tok.decode(t), t, lp) for t, lp in zip(toks, lps, strict=True)]
        return [Completion(p.id, ids, samples[i * n : i * n + n], version)
                for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True))]  # fmt: skip

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], gen: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        pad, eos = self.tok.pad_id, self.tok.eos_id
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
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
            if not self.spec.fixed_length:
                done |= nxt == eos
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            cache = {self._cache_arg: getattr(out, self._cache_arg)}
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **cache)  # fmt: skip
        return toks, lps


class SyntheticEngine(_VerifiedApply):
    """A load generator with the `Engine` contract, for tests and benchmarks of the system around it.

    It keeps its own copy of the weights (applied and verified exactly as `TorchEngine`
    does: touched tensors copied, digest checked, full reload on a mismatch) but does not
    run a model: every sample is the prompt's characters reversed, ``max_new_tokens``
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
            toks = self.tok.encode(p.text[::-1])[1 : k + 1] or [self.tok.eos_id]
            sample = Sample(self.tok.decode(toks), toks, [0.0] * len(toks))
            out.append(Completion(p.id, self.tok.encode(p.text), [sample] * n, version))
        return out


def make_engine(section: Mapping[str, Any], file: str | None = None, model: ModelSpec | None = None) -> Engine:
    """The engine an ``engine:`` section names (``model``: the topology's, when the section names none)."""
    spec = EngineSpec.from_section(section, file, model)
    if spec.kind == "vllm":
        from aurora.vllm_engine import VllmEngine

        return VllmEngine(spec)
    return TorchEngine(spec) if spec.kind == "torch" else SyntheticEngine(spec)
