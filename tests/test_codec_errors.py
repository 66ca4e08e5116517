"""Malformed input: every case raises DeltaFormatError and leaves the target unchanged."""

from __future__ import annotations

import itertools
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aurora.codec import DeltaReceiver, Weights, apply, apply_in_place, encode, unpack_manifest
from aurora.codec.digest import digest_bytes
from aurora.codec.encoder import Coding, Delta
from aurora.codec.format import (
    HEADER_BYTES,
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkKind,
    Transform,
    pack_chunk,
    pack_manifest,
    unpack_chunk,
)
from aurora.errors import DeltaFormatError
from tests.helpers import perturb


@pytest.fixture(scope="module")
def pair() -> tuple[Weights, Weights]:
    torch.manual_seed(1)
    b = Weights.from_tensors({"a": (torch.randn(20_000) * 0.02).to(torch.bfloat16), "b": torch.randn(64, 8)})
    return b, perturb(b, 0.05, 11)


def _unchanged_after(work: Weights, ref: Weights, f: object) -> None:
    with pytest.raises(DeltaFormatError):
        f()  # type: ignore[operator]
    for name in ref:
        assert np.array_equal(work[name].bits, ref[name].bits), f"{name} was modified"


@given(st.data())
def test_truncated_or_corrupted_chunk_is_rejected(pair: tuple[Weights, Weights], data: st.DataObject) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    i = data.draw(st.integers(0, len(d.chunks) - 1))
    c = bytearray(d.chunks[i])
    if data.draw(st.booleans()):
        c = c[: data.draw(st.integers(0, len(c) - 1))]
    else:
        pos = data.draw(st.integers(0, len(c) - 1))
        c[pos] ^= data.draw(st.integers(1, 255))
    chunks = list(d.chunks)
    chunks[i] = bytes(c)
    work = b.copy()
    _unchanged_after(work, b, lambda: apply_in_place(work, d.manifest, chunks))


def test_duplicated_chunk_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    rx = DeltaReceiver(d.manifest)
    rx.add(d.chunks[0])
    with pytest.raises(DeltaFormatError, match="twice"):
        rx.add(d.chunks[0])


def test_missing_chunk_is_reported(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    work = b.copy()
    _unchanged_after(work, b, lambda: apply_in_place(work, d.manifest, d.chunks[1:]))


def test_wrong_base_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    other = perturb(b, 0.01, 99)
    ref = other.copy()
    _unchanged_after(other, ref, lambda: apply_in_place(other, d.manifest, d.chunks))


def test_wrong_shape_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    bad = Weights.from_tensors({"a": torch.zeros(20_001, dtype=torch.bfloat16), "b": torch.randn(64, 8)})
    ref = bad.copy()
    _unchanged_after(bad, ref, lambda: apply_in_place(bad, d.manifest, d.chunks))
    with pytest.raises(DeltaFormatError, match="base is bfloat16"):
        encode(b, bad, base_version=0, target_version=1)


def test_chunk_of_another_delta_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d1 = encode(b, t, base_version=0, target_version=1)
    d2 = encode(b, perturb(b, 0.05, 12), base_version=0, target_version=2)
    rx = DeltaReceiver(d1.manifest)
    with pytest.raises(DeltaFormatError, match="another delta"):
        rx.add(d2.chunks[0])


def test_oversized_chunk_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    with pytest.raises(DeltaFormatError, match="exceeds"):
        DeltaReceiver(d.manifest).add(d.chunks[0] + bytes(MAX_CHUNK_BYTES))


def test_body_tampered_with_valid_digest_cannot_escape_bounds(pair: tuple[Weights, Weights]) -> None:
    # Re-sign a garbled body: the kernels must still stay in bounds and report an error or a digest mismatch.
    from aurora.codec.format import pack_chunk, unpack_chunk

    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    c = unpack_chunk(d.chunks[0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        body = bytearray(c.body)
        for p in rng.integers(0, len(body), size=4):
            body[p] = int(rng.integers(0, 256))
        forged = pack_chunk(c.header, bytes(body))
        work = b.copy()
        _unchanged_after(
            work, b, lambda forged=forged, work=work: apply_in_place(work, d.manifest, [forged, *d.chunks[1:]])
        )


def test_corrupt_manifest_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    raw = bytearray(pack_manifest(encode(b, t, base_version=0, target_version=1).manifest))
    raw[20] ^= 1
    with pytest.raises(DeltaFormatError, match="corrupt"):
        unpack_manifest(bytes(raw))
    with pytest.raises(DeltaFormatError):
        unpack_manifest(bytes(raw[:12]))
    with pytest.raises(DeltaFormatError, match="magic"):
        unpack_manifest(b"XXXX" + bytes(raw[4:]))


def test_future_format_version_is_rejected(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    c = bytearray(d.chunks[0])
    struct.pack_into("<H", c, 4, 4)
    with pytest.raises(DeltaFormatError, match="version 4"):
        DeltaReceiver(d.manifest).add(bytes(c))
    assert HEADER_BYTES == 80


def test_delta_needs_its_base(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    with pytest.raises(DeltaFormatError, match="needs a base"):
        apply(None, d.manifest, d.chunks)


def _sparse(pair: tuple[Weights, Weights]) -> tuple[Delta, Chunk]:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1, coding=Coding.SPARSE)
    c = unpack_chunk(d.chunks[0])
    assert c.header.kind is ChunkKind.SPARSE
    return d, c


@given(st.data())
def test_forged_sparse_chunk_changes_nothing(pair: tuple[Weights, Weights], data: st.DataObject) -> None:
    # Re-signed SPARSE chunks with any count and any body: an error, never a write or a claimed allocation.
    b, _ = pair
    d, c = _sparse(pair)
    h = c.header
    n = data.draw(st.integers(0, h.stop - h.start))
    body = bytearray(c.body) if data.draw(st.booleans()) else bytearray(data.draw(st.binary(max_size=4096)))
    for _ in range(data.draw(st.integers(0, 4))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    forged = pack_chunk(replace(h, n_changed=n), bytes(body))
    work = b.copy()
    _unchanged_after(work, b, lambda: apply_in_place(work, d.manifest, [forged, *d.chunks[1:]]))


@pytest.mark.parametrize(
    ("gaps", "why"),
    [
        (b"\xa0\x9c\x01", "out of range"),  # position 20000 in a span of 20000 elements
        (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "inconsistent header"),  # longer than any gap in the span
        (b"\x80", "truncated"),  # a varint that never ends
        (b"\x00\x00", "between its positions and its values"),  # one position, one byte left over
    ],
)
def test_sparse_positions_are_checked(pair: tuple[Weights, Weights], gaps: bytes, why: str) -> None:
    b, _ = pair
    d, c = _sparse(pair)
    h = c.header
    body = gaps + bytes(h.dtype.itemsize)  # one change: its gap(s), then one value
    forged = pack_chunk(replace(h, n_changed=1), body)
    work = b.copy()
    with pytest.raises(DeltaFormatError, match=why):
        apply_in_place(work, d.manifest, [forged, *d.chunks[1:]])
    assert work.digest() == b.digest()


def test_sparse_chunk_needs_format_3_and_no_transform(pair: tuple[Weights, Weights]) -> None:
    d, c = _sparse(pair)
    old = bytearray(d.chunks[0])
    struct.pack_into("<H", old, 4, 2)  # a v2 chunk cannot be SPARSE
    head = bytes(old[:64])  # re-signed by hand (pack_chunk writes v3)
    forged = head + digest_bytes(head, c.body) + bytes(c.body)
    with pytest.raises(DeltaFormatError, match=r"sparse chunk .* inconsistent header"):
        unpack_chunk(forged)
    with pytest.raises(DeltaFormatError, match="inconsistent header"):
        unpack_chunk(pack_chunk(replace(c.header, transform=Transform.SUB), bytes(c.body)))


def test_a_sparse_chunk_in_a_v2_delta_is_refused(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    plain = encode(b, t, base_version=0, target_version=1)  # conditioned: a v2 manifest
    sparse, _ = _sparse(pair)
    assert (plain.manifest.format, sparse.manifest.format) == (2, 3)
    assert unpack_chunk(plain.chunks[0]).header.kind is ChunkKind.DELTA
    rx = DeltaReceiver(plain.manifest)
    with pytest.raises(DeltaFormatError, match="SPARSE, which a format-2 delta cannot hold"):
        rx.add(sparse.chunks[0])  # same delta id: the manifests differ only in their format


@pytest.mark.parametrize("gap", [b"\x80\x00", b"\x80" * 9 + b"\x02"])
def test_overlong_varints_are_not_read(pair: tuple[Weights, Weights], gap: bytes) -> None:
    from aurora.codec import kernels

    status, _, _ = kernels.decode_positions(np.frombuffer(gap, np.uint8), 1, 1 << 20)
    assert status == -kernels.ERR_TRUNCATED


def _coded_gaps(k: int, gaps: list[tuple[int, int]]) -> np.ndarray:
    """A DELTA body for one bucket (id 0, not ALL, Rice parameter ``k``) whose range-coded stream holds the
    given raw (quotient, remainder) gaps, each with an xor value of 1 — whatever an encoder would never
    write (a quotient past any span, a remainder of all ones), coded with the kernels' own bit coder."""
    from aurora.codec import kernels as kn

    U = np.uint64
    out = np.zeros(4096, np.uint8)
    head = bytes([1, 0, len(gaps), k])
    out[: len(head)] = np.frombuffer(head, np.uint8)
    low, rng, cache, csize, pos = U(0), U(0xFFFFFFFF), U(0), U(1), len(head)
    probs = np.full(kn.N_CTX, 1024, np.int64)

    def renorm() -> None:  # numba hands uint64 back as int: each value goes in as uint64 again
        nonlocal low, rng, cache, csize, pos
        low, rng = U(low), U(rng)
        if rng < kn._TOP:
            low, rng, cache, csize, pos = (U(x) for x in kn._shift_low(low, rng, cache, csize, pos, out))
            pos = int(pos)

    def bit(ctx: int, b: int) -> None:
        nonlocal low, rng
        low, rng, probs[ctx] = kn._ebit(low, rng, probs[ctx], b)
        renorm()

    for q, rem in gaps:
        for t in range(q + 1):
            bit(kn.CTX_Q + min(t, kn.N_QCTX - 1), int(t < q))
        if k >= 1:
            bit(kn.CTX_R + 1, b1 := (rem >> (k - 1)) & 1)
        if k >= 2:
            bit(kn.CTX_R + 2 + b1, (rem >> (k - 2)) & 1)
            left = k - 2
            while left > 0:
                take = min(left, 8)
                left -= take
                low, rng = kn._edirect(low, rng, U((rem >> left) & ((1 << take) - 1)), take)
                renorm()
        bit(kn.CTX_L, 0)  # xor value 1: length 0
    for _ in range(5):
        low, rng, cache, csize, pos = (U(x) for x in kn._shift_low(low, rng, cache, csize, pos, out))
        pos = int(pos)
    return out[:pos].copy()


@given(
    st.sampled_from([0, 1, 2, 9, 62]),
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2**62 - 1)), min_size=1, max_size=4),
)
def test_a_decoded_run_of_ranks_is_strictly_increasing_inside_its_span_or_refused(
    k: int, raw: list[tuple[int, int]]
) -> None:
    """Whatever gaps a hostile body codes (quotients past any span, remainders of all ones: their ranks would
    overflow), decode_body refuses it or returns ranks that rise strictly and stay inside the span."""
    from aurora.codec import kernels as kn

    n_elems = 1000
    gaps = [(q, rem & ((1 << k) - 1)) for q, rem in raw]
    status, first, ranks, _ = kn.decode_body(_coded_gaps(k, gaps), len(gaps), n_elems, 256, 16, 1)
    if status == 0:
        run = ranks[first[0] : first[0] + len(gaps)].tolist()
        assert all(0 <= r < n_elems for r in run)
        assert all(a < b for a, b in itertools.pairwise(run))
    # the one an overflow let through before: a second gap of 3 << 62 | (2**62 - 1) after rank 5
    status, *_ = kn.decode_body(_coded_gaps(62, [(0, 5), (3, 2**62 - 1)]), 2, n_elems, 256, 16, 1)
    assert status == -kn.ERR_RANGE
