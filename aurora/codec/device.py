"""The codec's O(N) passes in torch, on the device that holds the tensors; the entropy stage stays on the CPU.

Where the weights live on a GPU (a trainer's masters, an engine's parameters),
the passes over every element — finding the changes, bucketing by the base
exponent, ranking inside a bucket, and scattering the decoded values — run
there, and only per-change data crosses to the host, where the numba range
coder (`kernels.encode_body` / `decode_body`, O(changes)) works as on the CPU
path. The model is the one of `aurora.codec.kernels` (docs/delta-format.md §4);
what differs is how a rank is found: the numba scan keeps a running counter per
bucket (one element after another), here a stable sort of ``(span, bucket)``
keys ranks a whole window of spans at once — an element's rank in its bucket is
its place in the sorted order less where its key's run begins. Sorts, gathers
and scatters are passes a GPU makes at its memory speed.

Invariants:

* `find_changes` yields, for every span of a tensor, the arrays
  `kernels.find_changes` returns for it, so `encode_on_device` writes the same
  bytes as `encode` (tests/test_codec_device.py holds both under hypothesis,
  on CPU tensors);
* `apply_on_device` is all-or-nothing like `StagedDelta.commit`: every decoded
  position is checked against the base before anything is written, and a
  tensor that does not hash to its target digest is restored and raises
  `DeltaFormatError`;
* digests are xxh3 of the bits on the host (torch has no xxh3 kernel): each
  side reads the tensors it hashes back once (an O(N) device-to-host copy),
  and a CPU tensor is hashed where it lies (no copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import groupby
from threading import Lock

import numpy as np
import torch

from aurora.codec import kernels
from aurora.codec.decoder import _ERRORS, DeltaReceiver, check_base, check_target, decode_ranks, sparse_patch
from aurora.codec.dtypes import DType, dtype_of
from aurora.codec.encoder import (
    Changes,
    Coding,
    Delta,
    EncodeStats,
    coding_of,
    format_for,
    iter_chunks,
    make_manifest,
)
from aurora.codec.format import Chunk, ChunkKind, Manifest, Transform, chunk_count, span_elements
from aurora.codec.parallel import ordered_map
from aurora.codec.weights import Weights
from aurora.errors import DeltaFormatError

WINDOW_ELEMENTS = 32 << 20
"""Elements ranked by one sort (whole spans): bounds the device memory a pass needs to ~40 B each."""

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def signed_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat signed integer tensor of the same width, on its device (no copy
    when contiguous). Buckets are exact on signed bits: ``(v >> shift) & mask`` never reaches the
    sign bit of a float."""
    flat = t.detach().reshape(-1)
    return flat.view(_SIGNED[flat.element_size()])


def _np_signed(d: DType) -> np.dtype[np.signedinteger]:  # type: ignore[type-arg]
    """The numpy dtype of `signed_view`'s elements for ``d``."""
    return np.dtype(f"i{d.itemsize}")


def _host_uint(t: torch.Tensor, d: DType) -> np.ndarray:
    return t.cpu().numpy().view(d.uint)


def _windows(numel: int, d: DType, window: int) -> Iterator[tuple[int, int, int]]:
    """(first chunk, start, stop) of each run of whole spans of about ``window`` elements."""
    span = span_elements(d)
    per = max(1, window // span)
    n_chunks = chunk_count(numel, d)
    for c0 in range(0, n_chunks, per):
        yield c0, c0 * span, min(numel, (c0 + per) * span)


def _rank_window(b: torch.Tensor, d: DType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key, order, starts, counts)`` of one window: ``key`` is span-in-window * n_buckets + bucket,
    ``order`` the stable sort of the window by key, ``starts``/``counts`` each key's run in it."""
    n = b.shape[0]
    span = span_elements(d)
    n_keys = ((n + span - 1) // span) * d.n_buckets
    pos = torch.arange(n, device=b.device, dtype=torch.int32)
    bucket = ((b >> d.exp_shift) & d.exp_mask).to(torch.int32) if d.exp_mask else torch.zeros_like(pos)
    key = ((pos // span) * d.n_buckets + bucket).to(torch.int16 if n_keys < 1 << 15 else torch.int32)
    order = torch.sort(key, stable=True).indices  # the narrowest key sorts fastest (fewer radix passes)
    counts = torch.bincount(key, minlength=n_keys)
    starts = torch.cumsum(counts, 0) - counts
    return key, order, starts, counts


def find_changes(
    base: torch.Tensor,
    target: torch.Tensor,
    d: DType,
    transform: Transform,
    *,
    window: int = WINDOW_ELEMENTS,
    ranks: bool = True,
) -> Iterator[tuple[int, Changes]]:
    """``(chunk index, changes)`` for every span of one tensor, in order; ``changes`` equal what
    `kernels.find_changes` returns for the span (indices local to it). ``ranks=False``: positions and
    steps only, rank and bucket left empty (what a SPARSE chunk needs: no sort)."""
    b_all, t_all = signed_view(base), signed_view(target)
    span = span_elements(d)
    wmask = np.uint64((1 << d.width) - 1)
    for c0, lo, hi in _windows(b_all.shape[0], d, window):
        b, t = b_all[lo:hi], t_all[lo:hi]
        changed = torch.nonzero(b != t).reshape(-1)  # ascending
        n_spans = (hi - lo + span - 1) // span
        if changed.numel() == 0:
            empty = np.empty(0, np.int64)
            for j in range(n_spans):
                yield c0 + j, (empty, empty, empty, np.empty(0, np.uint64))
            continue
        rank = buck = np.empty(0, np.int64)
        if ranks:
            key, order, starts, _ = _rank_window(b, d)
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.shape[0], device=order.device)
            kc = key[changed].to(torch.int64)
            rank = (inv[changed] - starts[kc]).cpu().numpy()
            buck = (kc % d.n_buckets).cpu().numpy()
        idx = changed.cpu().numpy()
        bb = _host_uint(b[changed], d).astype(np.uint64)
        tb = _host_uint(t[changed], d).astype(np.uint64)
        step = ((tb - bb) & wmask) if transform is Transform.SUB else (tb ^ bb)
        cuts = np.searchsorted(idx, np.arange(n_spans + 1, dtype=np.int64) * span)
        for j in range(n_spans):
            s, e = cuts[j], cuts[j + 1]
            yield c0 + j, (idx[s:e] - j * span, rank[s:e] if ranks else rank, buck[s:e] if ranks else buck, step[s:e])


class _DeviceFinder:
    """`encoder.ChangeFinder` over device tensors: a tensor's spans are found together, on the first ask
    for one of them, and each is handed out once (so what is held is the changes not yet coded). One
    tensor's pass holds only that tensor's lock: threads coding spans already found go on."""

    def __init__(
        self,
        manifest: Manifest,
        base: Mapping[str, torch.Tensor],
        target: Mapping[str, torch.Tensor],
        window: int,
        sparse: Callable[[str], bool],
    ) -> None:
        self._m, self._base, self._target, self._window, self._sparse = manifest, base, target, window, sparse
        self._lock = Lock()
        self._tensor_locks: dict[int, Lock] = {}
        self._found: dict[tuple[int, int], Changes] = {}

    def __call__(self, ti: int, ci: int) -> Changes:
        with self._lock:
            tensor_lock = self._tensor_locks.setdefault(ti, Lock())
        with tensor_lock:
            with self._lock:
                if (ti, ci) in self._found:
                    return self._found.pop((ti, ci))
            e = self._m.tensors[ti]
            found = list(
                find_changes(
                    self._base[e.name],
                    self._target[e.name],
                    e.dtype,
                    self._m.transform,
                    window=self._window,
                    ranks=not self._sparse(e.name),
                )
            )
            with self._lock:
                self._found.update(((ti, c), ch) for c, ch in found)
                return self._found.pop((ti, ci))


def host_weights(tensors: Mapping[str, torch.Tensor]) -> Weights:
    """The bits of ``tensors`` on the host, to hash and to send raw: a CPU tensor as it lies, a device
    tensor read back once."""
    return Weights.from_tensors({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})


def encode_on_device(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    base_version: int,
    target_version: int,
    transform: Transform = Transform.SUB,
    threads: int = 1,
    window: int = WINDOW_ELEMENTS,
    coding: Coding | Mapping[str, Coding] = Coding.CONDITIONED,
) -> Delta:
    """`encoder.encode` of two state dicts that live on a device: the same manifest and chunks, byte
    for byte, with the scans on the device and the range coder on ``threads`` CPU threads."""
    host_b, host_t = host_weights(base), host_weights(target)
    m = make_manifest(host_b, host_t, base_version, target_version, transform, format=format_for(coding))
    stats = EncodeStats()
    find = _DeviceFinder(m, base, target, window, lambda name: coding_of(coding, name) is Coding.SPARSE)
    return Delta(m, tuple(iter_chunks(m, host_b, host_t, stats, threads=threads, find=find, coding=coding)), stats)


def _entries(first: np.ndarray, ranks: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`kernels.decode_body`'s runs as flat (bucket, rank, value) arrays, bucket by bucket."""
    present = np.flatnonzero(first >= 0)  # buckets in the order their runs were written
    ends = np.append(first[present][1:], ranks.shape[0] - 1)  # each run ends with its sentinel
    real = ranks >= 0
    return np.repeat(present, ends - first[present] - 1), ranks[real], vals[real]


def locate(
    base: torch.Tensor, d: DType, transform: Transform, chunks: Sequence[tuple[int, Chunk, tuple[np.ndarray, ...]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, new)`` on the base's device: the tensor positions that the decoded ``chunks`` change
    (ascending) and their new bits (signed view). ``chunks``: (chunk index, chunk, decode_body's
    ``(first, ranks, vals)``), all of one window of this tensor. Raises `DeltaFormatError` when a
    rank lies beyond its bucket in this base (wrong base or corrupt body), having changed nothing."""
    b_all = signed_view(base)
    span = span_elements(d)
    c0 = min(ci for ci, _, _ in chunks)
    lo, hi = c0 * span, min(b_all.shape[0], (max(ci for ci, _, _ in chunks) + 1) * span)
    b = b_all[lo:hi]
    _, order, starts, counts = _rank_window(b, d)
    keys, ranks, vals = [], [], []
    for ci, c, (first, rk, vl) in chunks:
        e, r, v = _entries(first, rk, vl)
        if e.size != c.header.n_changed:
            raise DeltaFormatError(f"chunk (tensor {c.header.tensor_index}, chunk {ci}): {_ERRORS[kernels.ERR_RANGE]}")
        keys.append((ci - c0) * d.n_buckets + e)
        ranks.append(r)
        vals.append(v)
    dev = b.device
    key = torch.from_numpy(np.concatenate(keys)).to(dev)
    rank = torch.from_numpy(np.concatenate(ranks)).to(dev)
    if bool((rank >= counts[key]).any()):
        where = chunks[0][1].header
        raise DeltaFormatError(
            f"chunk (tensor {where.tensor_index}, chunks {c0}..{chunks[-1][0]}): {_ERRORS[kernels.ERR_LEFTOVER]}"
        )
    idx, perm = torch.sort(order[starts[key] + rank])
    old = _host_uint(b[idx], d).astype(np.uint64)
    v = np.concatenate(vals)[perm.cpu().numpy()]
    wmask = np.uint64((1 << d.width) - 1)
    new = ((old + v) & wmask) if transform is Transform.SUB else (old ^ v)
    new_t = torch.from_numpy(new.astype(d.uint).view(_np_signed(d))).to(dev)
    return idx + lo, new_t


def check_tensors(m: Manifest, params: Mapping[str, torch.Tensor]) -> None:
    """``params`` has the manifest's tensors, dtypes and shapes (read from the tensors, not their bits)."""
    if sorted(params) != [t.name for t in m.tensors]:
        raise DeltaFormatError(f"the tensors do not match delta v{m.base_version}->v{m.target_version}: names differ")
    for t in m.tensors:
        p = params[t.name]
        if dtype_of(p) != t.dtype or tuple(p.shape) != t.shape:
            raise DeltaFormatError(
                f"tensor {t.name!r}: delta expects {t.dtype.name}{list(t.shape)}, "
                f"the device has {p.dtype}{list(p.shape)}"
            )
        if not p.is_contiguous():  # a flat view of it would be a copy, and the writes would land there
            raise DeltaFormatError(f"tensor {t.name!r} is not contiguous: apply into a contiguous tensor")


Staged = tuple[str, int, torch.Tensor | None, torch.Tensor]
"""(tensor name, start, idx, new bits): ``idx`` the positions of ``new`` (both on the device), or None
for a raw span from ``start`` (its bits kept on the host until written: a snapshot would else hold a
second copy of the weights on the device)."""


def _staged(
    m: Manifest, rx: DeltaReceiver, params: Mapping[str, torch.Tensor], threads: int, window: int
) -> Iterator[Staged]:
    for ti, entry in enumerate(m.tensors):
        if not m.carries(entry):
            continue
        d, dev = entry.dtype, params[entry.name].device
        got = [rx.chunk(ti, ci) for ci in range(entry.n_chunks)]
        signed = _np_signed(d)
        for c in got:
            if c.header.kind is ChunkKind.RAW:
                raw = np.frombuffer(c.body, dtype=d.uint).view(signed).copy()
                yield entry.name, c.header.start, None, torch.from_numpy(raw)
            elif c.header.kind is ChunkKind.SPARSE:  # positions and values as they came: O(changes)
                at, new = sparse_patch(c)
                yield (
                    entry.name,
                    0,
                    torch.from_numpy(at + c.header.start).to(dev),
                    torch.from_numpy(new.view(signed)).to(dev),
                )
        coded = [c for c in got if c.header.kind is ChunkKind.DELTA and c.header.n_changed]
        per = max(1, window // span_elements(d))
        decoded = zip(coded, ordered_map(decode_ranks, coded, threads), strict=True)
        for _, group in groupby(decoded, key=lambda cd: cd[0].header.chunk_index // per):
            idx, new_t = locate(
                params[entry.name], d, m.transform, [(c.header.chunk_index, c, dec) for c, dec in group]
            )
            yield entry.name, 0, idx, new_t


def apply_on_device(
    params: Mapping[str, torch.Tensor],
    manifest: Manifest,
    chunks: Iterable[bytes | bytearray | memoryview],
    *,
    base_checked: bool = False,
    threads: int = 1,
    window: int = WINDOW_ELEMENTS,
) -> set[str]:
    """`decoder.apply_in_place` into tensors on a device: decode on ``threads`` CPU threads, locate and
    scatter on the device; all-or-nothing (see the module docstring). Returns the names of the tensors
    the delta carries. ``base_checked``: the caller knows ``params`` hold the delta's base version."""
    m = manifest
    rx = DeltaReceiver(m)
    rx.add_all(chunks)
    check_tensors(m, params)
    if not rx.complete:
        raise DeltaFormatError(f"delta is incomplete: {len(rx.missing())} of {rx.expected} chunks missing")
    if not base_checked and not m.is_snapshot:
        check_base(m, host_weights(params))
    staged = list(_staged(m, rx, params, threads, window))  # every check that reads the base, before a write
    flat = {n: signed_view(t) for n, t in params.items()}
    carried = {t.name for t in m.tensors if m.carries(t)}
    undo: list[Staged] = []  # the old bits, on the host
    try:
        for name, start, idx, new in staged:
            dst = flat[name]
            where = idx if idx is not None else slice(start, start + new.shape[0])
            undo.append((name, start, idx, dst[where].to("cpu", copy=True)))
            dst[where] = new.to(dst.device)
        check_target(m, host_weights({n: params[n] for n in carried}).tensor_digests())
    except BaseException:
        for name, start, idx, old in reversed(undo):
            dst = flat[name]
            dst[idx if idx is not None else slice(start, start + old.shape[0])] = old.to(dst.device)
        raise
    return carried
