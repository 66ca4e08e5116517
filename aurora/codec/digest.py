"""Digests of tensors, versions and byte strings (xxh3-128).

xxh3 is a non-cryptographic 128-bit hash (~10+ GB/s here): it detects
corruption and mix-ups (wrong base, wrong chunk), not tampering; links are
authenticated by CurveZMQ or DTLS. Invariant: a version digest depends only on
the sorted (name, dtype, shape, tensor digest) list, so two bit-identical
weight sets always have the same digest.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

DIGEST_BYTES = 16


def digest_bytes(*parts: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p)
    return h.digest()


def tensor_digest(bits: np.ndarray) -> bytes:
    """Digest of a tensor's raw bits (its dtype and shape are hashed by `version_digest`)."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(bits).view(np.uint8).data)


def version_digest(entries: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> bytes:
    """Digest of a whole weight set from its (name, dtype, shape, tensor digest) entries."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, d in sorted(entries):
        h.update(name.encode())
        h.update(b"\0")
        h.update(dtype.encode())
        h.update(repr(tuple(shape)).encode())
        h.update(d)
    return h.digest()
