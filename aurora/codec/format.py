"""Wire layout of delta format v3: the manifest and the chunk (docs/delta-format.md).

Pure packing and unpacking with full validation: anything read from the wire is
checked here (magic, version, lengths, digests, field ranges) and a violation
raises `DeltaFormatError` naming what is wrong. Nothing here touches tensors.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from aurora.codec.digest import DIGEST_BYTES, digest_bytes
from aurora.codec.dtypes import BY_CODE, BY_NAME, DType
from aurora.errors import DeltaFormatError

FORMAT_VERSION = 3
"""The newest version this build writes. v3: a chunk may be SPARSE (positions as gaps, values
overwritten: O(changes) to apply, no scan of the base); only a delta that may hold SPARSE chunks is
written as v3 (its manifest and those chunks), so a delta coded as before reads on a v2 build. v2: a
tensor that a delta leaves unchanged (its target digest is its base digest) carries no chunks, so a
version that changes nothing costs a manifest row per tensor. v1 (every tensor chunked) is read too."""
PLAIN_VERSION = 2
"""The version of a delta without SPARSE chunks (manifest and chunks), byte for byte what v2 wrote."""
READABLE_VERSIONS = (1, 2, 3)
CHUNK_MAGIC = b"AUDC"
MANIFEST_MAGIC = b"AUDM"
MAX_CHUNK_BYTES = 4 * 1024 * 1024
"""Upper bound of one encoded chunk, header included (the issue's 4 MiB)."""
CHUNK_SPAN_BYTES = MAX_CHUNK_BYTES - 4096
"""Raw bytes of tensor data one chunk covers; a coded body never exceeds the raw
bytes (the encoder falls back to RAW), so header + body <= MAX_CHUNK_BYTES."""
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_DIMS = 16
MAX_TENSOR_ELEMENTS = 1 << 40
"""Elements one tensor may have (2 TiB of bf16): a manifest claiming more is malformed."""
MAX_CHUNKS = 1 << 20
"""Chunks one delta may have (4 TiB of weights): so nothing that walks a manifest's chunks is unbounded."""

# <magic 4s><version H><kind B><transform B><dtype B><flags B><reserved H>
# <tensor_index I><chunk_index I><start Q><stop Q><n_changed Q><body_len I>
# <delta_id 16s>  ... then <digest 16s> over everything before it plus the body.
_HEAD = struct.Struct("<4sHBBBBHIIQQQI16s")
HEADER_BYTES = _HEAD.size + DIGEST_BYTES  # 80


class ChunkKind(enum.IntEnum):
    DELTA = 0  # coded changes against the base
    RAW = 1  # the target's bits for the span, verbatim
    SPARSE = 2  # positions as LEB128 gaps, then the target's bits there (format v3)


class Transform(enum.IntEnum):
    NONE = 0  # RAW chunks
    XOR = 1  # value = target ^ base
    SUB = 2  # value = (target - base) mod 2**width, as sign + magnitude


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    kind: ChunkKind
    transform: Transform
    dtype: DType
    tensor_index: int
    chunk_index: int
    start: int
    stop: int
    n_changed: int
    body_len: int
    delta_id: bytes


@dataclass(frozen=True, slots=True)
class Chunk:
    header: ChunkHeader
    body: memoryview

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.header.body_len


def pack_chunk(h: ChunkHeader, body: bytes | memoryview) -> bytes:
    head = _HEAD.pack(
        CHUNK_MAGIC,
        FORMAT_VERSION if h.kind is ChunkKind.SPARSE else PLAIN_VERSION,
        h.kind,
        h.transform,
        h.dtype.code,
        0,
        0,
        h.tensor_index,
        h.chunk_index,
        h.start,
        h.stop,
        h.n_changed,
        len(body),
        h.delta_id,
    )
    return b"".join((head, digest_bytes(head, body), body))


def unpack_chunk(data: bytes | bytearray | memoryview) -> Chunk:
    """Parse and verify one chunk (magic, version, lengths, digest, field ranges)."""
    mv = memoryview(data).cast("B")
    if len(mv) < HEADER_BYTES:
        raise DeltaFormatError(f"chunk truncated: {len(mv)} bytes, header alone is {HEADER_BYTES}")
    if len(mv) > MAX_CHUNK_BYTES:
        raise DeltaFormatError(f"chunk of {len(mv)} bytes exceeds the {MAX_CHUNK_BYTES}-byte limit")
    (magic, version, kind, transform, dcode, _flags, _res, ti, ci, start, stop, n_changed, blen, did) = (
        _HEAD.unpack_from(mv, 0)
    )
    if magic != CHUNK_MAGIC:
        raise DeltaFormatError(f"not a delta chunk (magic {bytes(magic)!r})")
    if version not in READABLE_VERSIONS:
        raise DeltaFormatError(
            f"chunk format version {version} is not supported (this build reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    if len(mv) != HEADER_BYTES + blen:
        raise DeltaFormatError(f"chunk length {len(mv)} does not match its header (body {blen} bytes)")
    if digest_bytes(mv[: _HEAD.size], mv[HEADER_BYTES:]) != bytes(mv[_HEAD.size : HEADER_BYTES]):
        raise DeltaFormatError(f"chunk (tensor {ti}, chunk {ci}) is corrupt: digest mismatch")
    try:
        k, tr, dt = ChunkKind(kind), Transform(transform), BY_CODE[dcode]
    except (ValueError, KeyError):
        raise DeltaFormatError(f"chunk (tensor {ti}, chunk {ci}) has an unknown kind/transform/dtype") from None
    if stop < start or n_changed > stop - start:
        raise DeltaFormatError(f"chunk (tensor {ti}, chunk {ci}) has an impossible range")
    if k is ChunkKind.RAW and (tr is not Transform.NONE or blen != (stop - start) * dt.itemsize):
        raise DeltaFormatError(f"raw chunk (tensor {ti}, chunk {ci}) has a wrong body length")
    if k is ChunkKind.DELTA and (tr is Transform.NONE or (n_changed == 0) != (blen == 0)):
        raise DeltaFormatError(f"delta chunk (tensor {ti}, chunk {ci}) has an inconsistent header")
    if k is ChunkKind.SPARSE and (
        version < 3
        or tr is not Transform.NONE
        or n_changed == 0
        or not n_changed * (1 + dt.itemsize) <= blen <= n_changed * (varint_bytes(stop - start) + dt.itemsize)
    ):
        raise DeltaFormatError(f"sparse chunk (tensor {ti}, chunk {ci}) has an inconsistent header")
    h = ChunkHeader(k, tr, dt, ti, ci, start, stop, n_changed, blen, bytes(did))
    return Chunk(h, mv[HEADER_BYTES:])


def varint_bytes(v: int) -> int:
    """Bytes of the LEB128 varint of ``v`` (the longest a gap inside a span of ``v`` elements needs)."""
    return max(1, (v.bit_length() + 6) // 7)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    base_digest: bytes | None
    target_digest: bytes

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def n_chunks(self) -> int:
        return chunk_count(self.numel, self.dtype)


def span_elements(dtype: DType) -> int:
    return CHUNK_SPAN_BYTES // dtype.itemsize


def chunk_count(numel: int, dtype: DType) -> int:
    span = span_elements(dtype)
    return (numel + span - 1) // span


def chunk_range(numel: int, dtype: DType, index: int) -> tuple[int, int]:
    span = span_elements(dtype)
    return index * span, min(numel, (index + 1) * span)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a delta is: from which version to which, and every target tensor's digest."""

    delta_id: bytes
    base_version: int | None
    target_version: int
    base_digest: bytes | None
    target_digest: bytes
    transform: Transform
    tensors: tuple[TensorEntry, ...]
    format: int = PLAIN_VERSION
    """The format this manifest is written in (it is re-packed in it, byte for byte)."""

    @property
    def is_snapshot(self) -> bool:
        return self.base_version is None and self.base_digest is None

    def carries(self, t: TensorEntry) -> bool:
        """Does tensor ``t`` have chunks in this delta? (From v2 on, not when the delta leaves it unchanged.)"""
        return self.format < 2 or self.is_snapshot or t.base_digest != t.target_digest

    @property
    def n_chunks(self) -> int:
        return sum(t.n_chunks for t in self.tensors if self.carries(t))

    def index_of(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(name)


def delta_id_for(
    base_version: int | None, target_version: int, base_digest: bytes | None, target_digest: bytes
) -> bytes:
    return digest_bytes(
        b"aurora-delta/1",
        struct.pack("<qq", -1 if base_version is None else base_version, target_version),
        base_digest or bytes(DIGEST_BYTES),
        target_digest,
    )


def pack_manifest(m: Manifest) -> bytes:
    body = msgpack.packb(
        {
            "delta_id": m.delta_id,
            "base_version": m.base_version,
            "target_version": m.target_version,
            "base_digest": m.base_digest,
            "target_digest": m.target_digest,
            "transform": m.transform.name.lower(),
            "chunk_span_bytes": CHUNK_SPAN_BYTES,
            "tensors": [[t.name, t.dtype.name, list(t.shape), t.base_digest, t.target_digest] for t in m.tensors],
        },
        use_bin_type=True,
    )
    head = MANIFEST_MAGIC + struct.pack("<HI", m.format, len(body))
    return b"".join((head, body, digest_bytes(head, body)))


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise DeltaFormatError(f"manifest is malformed: {what}")


def _digest_field(v: object, what: str, *, optional: bool = False) -> bytes | None:
    if v is None and optional:
        return None
    _need(isinstance(v, bytes) and len(v) == DIGEST_BYTES, f"{what} must be {DIGEST_BYTES} bytes")
    assert isinstance(v, bytes)
    return v


_MANIFEST_FIELDS = frozenset(
    {"delta_id", "base_version", "target_version", "base_digest", "target_digest", "transform", "chunk_span_bytes"}
)
"""The manifest body's fields besides ``tensors``."""


def _tensor_row(i: int, row: object) -> TensorEntry:
    """Row ``i`` of a manifest's tensor list, checked (messages are built only for a row that fails)."""
    if not (isinstance(row, list) and len(row) == 5):
        raise DeltaFormatError(f"manifest is malformed: tensors[{i}] must have 5 fields")
    name, dname, shape, bd, td = row
    if not (isinstance(name, str) and name):
        _need(False, f"tensors[{i}].name must be a non-empty string")
    dtype = BY_NAME.get(dname) if isinstance(dname, str) else None
    if dtype is None:
        _need(False, f"tensors[{i}].dtype {dname!r} is unknown")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(s) is int and s >= 0 for s in shape)):
        _need(False, f"tensors[{i}].shape")
    numel = 1
    for s in shape:
        numel = min(numel * s, MAX_TENSOR_ELEMENTS + 1)
    if numel > MAX_TENSOR_ELEMENTS:
        _need(False, f"tensors[{i}] claims {numel} elements or more (at most {MAX_TENSOR_ELEMENTS})")
    if not (bd is None or (isinstance(bd, bytes) and len(bd) == DIGEST_BYTES)):
        _need(False, f"tensors[{i}].base_digest must be {DIGEST_BYTES} bytes")
    if not (isinstance(td, bytes) and len(td) == DIGEST_BYTES):
        _need(False, f"tensors[{i}].target_digest must be {DIGEST_BYTES} bytes")
    assert dtype is not None
    return TensorEntry(name, dtype, tuple(shape), bd, td)


def unpack_manifest(data: bytes | bytearray | memoryview, *, tensors: int | None = None) -> Manifest:
    """Parse and check a manifest. ``tensors``: how many tensors the reader's weights have, when it holds
    some; a manifest listing another number is refused before any of its rows is parsed.

    Cost: the body is read as a stream, one tensor row at a time, so parsing holds the rows' entries and
    no more (a few times the manifest's own bytes), and a row is checked without building a message
    unless it fails."""
    mv = memoryview(data).cast("B")
    if len(mv) < 10 + DIGEST_BYTES or bytes(mv[:4]) != MANIFEST_MAGIC:
        raise DeltaFormatError("not a delta manifest (bad magic or too short)")
    version, blen = struct.unpack_from("<HI", mv, 4)
    if version not in READABLE_VERSIONS:
        raise DeltaFormatError(
            f"manifest format version {version} is not supported (this build reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    if blen > MAX_MANIFEST_BYTES or len(mv) != 10 + blen + DIGEST_BYTES:
        raise DeltaFormatError(f"manifest length {len(mv)} does not match its header ({blen}-byte body)")
    if digest_bytes(mv[:10], mv[10 : 10 + blen]) != bytes(mv[10 + blen :]):
        raise DeltaFormatError("manifest is corrupt: digest mismatch")
    d: dict[str, Any] = {}
    entries: list[TensorEntry] | None = None
    try:
        up = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(1, blen))
        up.feed(mv[10 : 10 + blen])
        n_fields = up.read_map_header()
        _need(n_fields == len(_MANIFEST_FIELDS) + 1, f"{n_fields} fields, not {len(_MANIFEST_FIELDS) + 1}")
        for _ in range(n_fields):
            key = up.unpack()
            _need(isinstance(key, str) and (key in _MANIFEST_FIELDS or key == "tensors"), f"field {key!r}")
            _need(key not in d and not (key == "tensors" and entries is not None), f"field {key!r} twice")
            if key != "tensors":
                d[key] = up.unpack()
                continue
            count = up.read_array_header()
            _need(count <= MAX_TENSORS, f"{count} tensors (at most {MAX_TENSORS})")
            if tensors is not None and count != tensors:
                raise DeltaFormatError(f"the manifest lists {count} tensors, the weights held have {tensors}")
            entries = []
            chunks, previous = 0, ""
            for i in range(count):
                t = _tensor_row(i, up.unpack())
                if t.name <= previous:
                    _need(False, "tensor names must be unique and sorted")
                previous = t.name
                chunks += t.n_chunks
                if chunks > MAX_CHUNKS:
                    _need(False, f"more than {MAX_CHUNKS} chunks")
                entries.append(t)
        _need(up.tell() == blen, "bytes after the body")
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, msgpack.OutOfData) as e:
        raise DeltaFormatError(f"manifest body is not valid msgpack: {e}") from None
    _need(entries is not None, "fields ['tensors'] missing")
    assert entries is not None
    _need(d["chunk_span_bytes"] == CHUNK_SPAN_BYTES, f"chunk span {d['chunk_span_bytes']} != {CHUNK_SPAN_BYTES}")
    bv, tv = d["base_version"], d["target_version"]
    _need(bv is None or (isinstance(bv, int) and bv >= 0), "base_version must be a non-negative int or nil")
    _need(isinstance(tv, int) and tv >= 0, "target_version must be a non-negative int")
    _need(d["transform"] in ("xor", "sub"), "transform must be 'xor' or 'sub'")
    tensors_ = entries
    m = Manifest(
        delta_id=_digest_field(d["delta_id"], "delta_id") or b"",
        base_version=bv,
        target_version=tv,
        base_digest=_digest_field(d["base_digest"], "base_digest", optional=True),
        target_digest=_digest_field(d["target_digest"], "target_digest") or b"",
        transform=Transform.XOR if d["transform"] == "xor" else Transform.SUB,
        tensors=tuple(tensors_),
        format=version,
    )
    _need(m.delta_id == delta_id_for(bv, tv, m.base_digest, m.target_digest), "delta_id does not match versions")
    _need((bv is None) == (m.base_digest is None), "base_version and base_digest must both be set or both nil")
    if m.base_digest is None:
        _need(all(t.base_digest is None for t in tensors_), "a snapshot has no base tensor digests")
    return m
