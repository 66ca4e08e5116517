"""The delta file: a manifest record followed by chunk records, in any order.

Layout: ``b"AUDF" <version u16>`` then records ``<length u32><bytes>``; the
first record is the manifest. Reading checks lengths as it goes, so a
truncated file is reported as such rather than misparsed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from aurora.codec.format import (
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    READABLE_VERSIONS,
    Manifest,
    pack_manifest,
    unpack_manifest,
)
from aurora.errors import DeltaFormatError

FILE_MAGIC = b"AUDF"
_REC = struct.Struct("<I")


def write_delta(f: BinaryIO, manifest: Manifest, chunks: Iterable[bytes]) -> int:
    """Write a delta file; returns bytes written."""
    n = f.write(FILE_MAGIC + struct.pack("<H", manifest.format))
    for rec in _chain(manifest, iter(chunks)):
        n += f.write(_REC.pack(len(rec)))
        n += f.write(rec)
    return n


def _chain(manifest: Manifest, chunks: Iterator[bytes]) -> Iterator[bytes]:
    yield pack_manifest(manifest)
    yield from chunks


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DeltaFormatError(f"delta file is truncated in {what} (wanted {n} bytes, got {len(data)})")
    return data


def read_delta(f: BinaryIO, *, tensors: int | None = None) -> tuple[Manifest, Iterator[bytes]]:
    """Manifest now, chunk records lazily (each still to be verified by a receiver). ``tensors``: the
    base's tensor count, when known (a manifest of another count is refused before it is parsed)."""
    head = f.read(6)
    if len(head) < 6 or head[:4] != FILE_MAGIC:
        raise DeltaFormatError("not an Aurora delta file (bad magic)")
    (version,) = struct.unpack("<H", head[4:])
    if version not in READABLE_VERSIONS:
        raise DeltaFormatError(
            f"delta file version {version} is not supported (this build reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    (mlen,) = _REC.unpack(_read_exact(f, 4, "the manifest length"))
    if mlen > MAX_MANIFEST_BYTES:
        raise DeltaFormatError(f"manifest record of {mlen} bytes is too large")
    manifest = unpack_manifest(_read_exact(f, mlen, "the manifest"), tensors=tensors)

    def chunks() -> Iterator[bytes]:
        i = 0
        while True:
            lb = f.read(4)
            if not lb:
                return
            if len(lb) < 4:
                raise DeltaFormatError(f"delta file is truncated after chunk record {i}")
            (clen,) = _REC.unpack(lb)
            if clen > MAX_CHUNK_BYTES:
                raise DeltaFormatError(f"chunk record {i} claims {clen} bytes, above the {MAX_CHUNK_BYTES}-byte limit")
            yield _read_exact(f, clen, f"chunk record {i}")
            i += 1

    return manifest, chunks()


def load_delta_file(path: str | Path, *, tensors: int | None = None) -> tuple[Manifest, list[bytes]]:
    p = Path(path)
    try:
        with p.open("rb") as f:
            m, it = read_delta(f, tensors=tensors)
            return m, list(it)
    except OSError as e:
        raise DeltaFormatError(f"{p}: cannot read delta file: {e.strerror}") from None
    except DeltaFormatError as e:
        raise DeltaFormatError(f"{p}: {e}") from None
