"""Encoding one weight version into the next as a streamed delta.

`encode_stream` returns the manifest first (all digests are known before any
chunk is coded) and then yields chunks tensor by tensor, span by span, so a
sender can start before encoding ends. Each chunk is independently checkable
(its own digest) and independently applicable (its span of one tensor).

Invariants: a coded body is never larger than the span's raw bytes (the
encoder falls back to a RAW chunk), so every chunk is <= MAX_CHUNK_BYTES; a
snapshot (no base) is a delta made only of RAW chunks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from aurora.codec import kernels
from aurora.codec.format import (
    FORMAT_VERSION,
    PLAIN_VERSION,
    ChunkHeader,
    ChunkKind,
    Manifest,
    TensorEntry,
    Transform,
    chunk_range,
    delta_id_for,
    pack_chunk,
    pack_manifest,
    varint_bytes,
)
from aurora.codec.parallel import ordered_map, pairs_pay
from aurora.codec.weights import TensorBits, Weights
from aurora.errors import DeltaFormatError

SNAPSHOT_THRESHOLD = 0.9
"""A delta at or above this fraction of the snapshot's bytes is not worth it."""


class Coding(enum.Enum):
    """How a tensor's changed positions are coded (`aurora.codec.choice` says when to use which)."""

    CONDITIONED = "conditioned"
    """DELTA chunks: ranks in base-exponent buckets, range-coded — the fewest bytes; both sides scan the span."""
    SPARSE = "sparse"
    """SPARSE chunks: positions as gaps, values overwritten — ~4x the bytes, O(changes) to apply."""


Changes = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""One span's changed elements as `kernels.find_changes` returns them: (idx, rank, bucket, step)."""

ChangeFinder = Callable[[int, int], Changes]
"""(tensor index, chunk index) -> that span's `Changes`, found elsewhere (`aurora.codec.device`)."""


def check_compatible(base: Weights, target: Weights) -> None:
    """Same names, dtypes and shapes; raise `DeltaFormatError` naming the first mismatch."""
    if list(base) != list(target):
        extra = sorted(set(target) - set(base))
        missing = sorted(set(base) - set(target))
        raise DeltaFormatError(f"tensor names differ: only in target {extra[:5]}, only in base {missing[:5]}")
    for name in base:
        b, t = base[name], target[name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise DeltaFormatError(
                f"tensor {name!r}: base is {b.dtype.name}{list(b.shape)}, target is {t.dtype.name}{list(t.shape)}"
            )


def make_manifest(
    base: Weights | None,
    target: Weights,
    base_version: int | None,
    target_version: int,
    transform: Transform = Transform.SUB,
    *,
    format: int = PLAIN_VERSION,
) -> Manifest:
    if base is not None:
        check_compatible(base, target)
    bd = base.tensor_digests() if base is not None else None
    if base is not None:
        target.share_digests(base)  # tensors that are the base's own arrays: unchanged, no hashing
    td = target.tensor_digests()
    base_digest = base.digest() if base is not None else None
    target_digest = target.digest()
    if base is not None and base_version is None:
        raise DeltaFormatError("a delta with a base needs a base version")
    entries = tuple(
        TensorEntry(name, tb.dtype, tb.shape, bd[name] if bd is not None else None, td[name])
        for name, tb in target.items()
    )
    return Manifest(
        delta_id=delta_id_for(base_version if base is not None else None, target_version, base_digest, target_digest),
        base_version=base_version if base is not None else None,
        target_version=target_version,
        base_digest=base_digest,
        target_digest=target_digest,
        transform=transform,
        tensors=entries,
        format=format,
    )


def encode_span(
    base: TensorBits | None,
    target: TensorBits,
    start: int,
    stop: int,
    transform: Transform,
    changes: Changes | None = None,
    coding: Coding = Coding.CONDITIONED,
) -> tuple[ChunkKind, int, bytes | memoryview]:
    """Code one span; returns (kind, n_changed, body). ``changes``: the span's changes when they
    were found elsewhere (on a device), else the span is scanned here."""
    t = target.bits[start:stop]
    raw_bytes = t.nbytes
    if base is None:
        return ChunkKind.RAW, stop - start, t.view(np.uint8).data
    d = target.dtype
    if coding is Coding.SPARSE:
        return _sparse_span(base.bits[start:stop], t, changes[0] if changes is not None else None)
    if changes is None:
        changes = kernels.find_changes(base.bits[start:stop], t, d.exp_shift, d.exp_mask, d.width, int(transform))
    idx, rank, buck, step = changes
    n = int(idx.size)
    if n == 0:
        return ChunkKind.DELTA, 0, b""
    out = np.empty(raw_bytes, np.uint8)
    written = int(kernels.encode_body(rank, buck, step, d.n_buckets, d.width, int(transform), out))
    if written < 0 or written >= raw_bytes:
        return ChunkKind.RAW, n, t.view(np.uint8).data
    return ChunkKind.DELTA, n, out[:written].tobytes()  # a copy of what was written: the span-sized buffer goes


def _sparse_span(b: np.ndarray, t: np.ndarray, idx: np.ndarray | None) -> tuple[ChunkKind, int, bytes | memoryview]:
    if idx is None:
        idx = kernels.changed_positions(b, t, kernels.words(b), kernels.words(t))
    n = int(idx.size)
    if n == 0:
        return ChunkKind.DELTA, 0, b""
    gaps = np.empty(n * varint_bytes(t.size), np.uint8)
    written = int(kernels.encode_positions(idx, gaps))
    if written < 0 or written + n * t.itemsize >= t.nbytes:
        return ChunkKind.RAW, n, t.view(np.uint8).data
    return ChunkKind.SPARSE, n, gaps[:written].tobytes() + t[idx].tobytes()


@dataclass(slots=True)
class EncodeStats:
    """What one encoding produced (filled in as chunks are yielded)."""

    chunks: int = 0
    changed: int = 0
    elements: int = 0
    bytes: int = 0
    raw_chunks: int = 0
    sparse_chunks: int = 0
    weight_bytes: int = 0
    per_chunk: list[tuple[int, int, ChunkKind, int, int]] = field(default_factory=list)
    """(tensor_index, chunk_index, kind, n_changed, chunk bytes)."""

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def bytes_per_changed(self) -> float:
        return self.bytes / self.changed if self.changed else 0.0


def iter_chunks(
    manifest: Manifest,
    base: Weights | None,
    target: Weights,
    stats: EncodeStats | None = None,
    *,
    threads: int = 1,
    find: ChangeFinder | None = None,
    coding: Coding | Mapping[str, Coding] = Coding.CONDITIONED,
) -> Iterator[bytes]:
    """Yield the packed chunks of ``manifest`` in tensor order (each <= MAX_CHUNK_BYTES).

    ``threads > 1`` codes chunks concurrently (the kernels release the GIL); the
    order and the bytes are the same as with one thread. ``find`` gives each span's
    changes (called from the coding threads) instead of a scan of ``base`` here.
    ``coding``: for every tensor, or per tensor name (a name not in it: CONDITIONED); SPARSE
    only in a manifest of format 3 (`format_for`).
    """

    def coding_here(name: str) -> Coding:
        return coding_of(coding, name) if manifest.format >= FORMAT_VERSION else Coding.CONDITIONED

    def ranked(ti: int) -> bool:
        """The tensor's spans are found by the rank scan here (conditioned, against a base)."""
        return base is not None and find is None and coding_here(manifest.tensors[ti].name) is Coding.CONDITIONED

    ranked_chunks = sum(e.n_chunks for ti, e in enumerate(manifest.tensors) if manifest.carries(e) and ranked(ti))
    pair = pairs_pay(ranked_chunks, threads)

    def jobs() -> Iterator[tuple[tuple[int, int], ...]]:
        """The chunks in order, two at a time where both are ranked spans of one dtype (`code`)."""
        held: tuple[int, int] | None = None
        for ti, entry in enumerate(manifest.tensors):
            if not manifest.carries(entry):  # unchanged: no chunks, no scan
                if stats is not None:
                    stats.elements += entry.numel
                    stats.weight_bytes += entry.numel * entry.dtype.itemsize
                continue
            for ci in range(entry.n_chunks):
                if held is not None and (not ranked(ti) or manifest.tensors[held[0]].dtype != entry.dtype):
                    yield (held,)
                    held = None
                if not pair or not ranked(ti):
                    yield ((ti, ci),)
                elif held is None:
                    held = (ti, ci)
                else:
                    yield held, (ti, ci)
                    held = None
        if held is not None:
            yield (held,)

    def span(job: tuple[int, int]) -> tuple[TensorBits | None, TensorBits, int, int]:
        entry = manifest.tensors[job[0]]
        start, stop = chunk_range(entry.numel, entry.dtype, job[1])
        return (base[entry.name] if base is not None else None), target[entry.name], start, stop

    def code(group: tuple[tuple[int, int], ...]) -> list[tuple[int, int, ChunkKind, int, bytes]]:
        """Code one chunk, or two ranked ones whose scans run side by side (`kernels.find_changes_pair`)."""
        found: list[Changes | None] = [None] * len(group)
        if len(group) == 2:
            (ba, ta, a0, a1), (bb, tb, b0, b1) = span(group[0]), span(group[1])
            assert ba is not None
            assert bb is not None
            d = ta.dtype
            found[0], found[1] = kernels.find_changes_pair(
                ba.bits[a0:a1],
                ta.bits[a0:a1],
                bb.bits[b0:b1],
                tb.bits[b0:b1],
                d.exp_shift,
                d.exp_mask,
                d.width,
                int(manifest.transform),
            )
        elif find is not None and base is not None:
            found[0] = find(*group[0])
        out = []
        for (ti, ci), changes in zip(group, found, strict=True):
            src, tgt, start, stop = span((ti, ci))
            entry = manifest.tensors[ti]
            kind, n, body = encode_span(src, tgt, start, stop, manifest.transform, changes, coding_here(entry.name))
            tr = manifest.transform if kind is ChunkKind.DELTA else Transform.NONE
            h = ChunkHeader(kind, tr, entry.dtype, ti, ci, start, stop, n, len(body), manifest.delta_id)
            out.append((ti, ci, kind, n, pack_chunk(h, body)))
        return out

    for ti, ci, kind, n, packed in (r for rs in ordered_map(code, jobs(), threads) for r in rs):
        entry = manifest.tensors[ti]
        start, stop = chunk_range(entry.numel, entry.dtype, ci)
        if stats is not None:
            stats.chunks += 1
            stats.changed += n if base is not None else 0
            stats.elements += stop - start
            stats.bytes += len(packed)
            stats.raw_chunks += kind is ChunkKind.RAW
            stats.sparse_chunks += kind is ChunkKind.SPARSE
            stats.weight_bytes += (stop - start) * entry.dtype.itemsize
            stats.per_chunk.append((ti, ci, kind, n, len(packed)))
        yield packed


def encode_stream(
    base: Weights | None,
    target: Weights,
    *,
    base_version: int | None,
    target_version: int,
    transform: Transform = Transform.SUB,
    stats: EncodeStats | None = None,
    threads: int = 1,
    coding: Coding | Mapping[str, Coding] = Coding.CONDITIONED,
) -> tuple[Manifest, Iterator[bytes]]:
    """Manifest now, chunks lazily. ``base=None`` makes a snapshot."""
    m = make_manifest(base, target, base_version, target_version, transform, format=format_for(coding))
    return m, iter_chunks(m, base, target, stats, threads=threads, coding=coding)


def coding_of(coding: Coding | Mapping[str, Coding], name: str) -> Coding:
    """Tensor ``name``'s coding: ``coding`` itself, or its entry for the name (CONDITIONED when absent)."""
    return coding if isinstance(coding, Coding) else coding.get(name, Coding.CONDITIONED)


def format_for(coding: Coding | Mapping[str, Coding]) -> int:
    """The version a delta coded so is written in: v3 only where it may hold SPARSE chunks."""
    sparse = coding is Coding.SPARSE if isinstance(coding, Coding) else Coding.SPARSE in coding.values()
    return FORMAT_VERSION if sparse else PLAIN_VERSION


@dataclass(frozen=True, slots=True)
class Delta:
    """A whole delta in memory: manifest plus its packed chunks."""

    manifest: Manifest
    chunks: tuple[bytes, ...]
    stats: EncodeStats

    @property
    def nbytes(self) -> int:
        return len(pack_manifest(self.manifest)) + sum(len(c) for c in self.chunks)

    @property
    def snapshot_bytes(self) -> int:
        return self.stats.weight_bytes

    @property
    def prefer_snapshot(self) -> bool:
        """True when a full snapshot would cost about as much as this delta (density threshold)."""
        return not self.manifest.is_snapshot and self.nbytes >= SNAPSHOT_THRESHOLD * self.snapshot_bytes


def encode(
    base: Weights | None,
    target: Weights,
    *,
    base_version: int | None,
    target_version: int,
    transform: Transform = Transform.SUB,
    threads: int = 1,
    coding: Coding | Mapping[str, Coding] = Coding.CONDITIONED,
) -> Delta:
    stats = EncodeStats()
    m, it = encode_stream(
        base,
        target,
        base_version=base_version,
        target_version=target_version,
        transform=transform,
        stats=stats,
        threads=threads,
        coding=coding,
    )
    return Delta(m, tuple(it), stats)
