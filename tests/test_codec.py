"""Layer 1: the delta codec, pure and property-based."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aurora.codec import DeltaReceiver, Transform, Weights, apply, apply_in_place, compose, encode, invert, receive
from aurora.codec.decoder import blank_weights
from aurora.codec.dtypes import BY_NAME
from aurora.codec.encoder import Coding
from aurora.codec.format import pack_chunk, unpack_chunk
from aurora.errors import DeltaFormatError
from tests.helpers import perturb, tensor_from_raw

DTYPES = [
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
]
SPECIAL16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x7F7F]


@st.composite
def weight_pairs(draw: st.DrawFn) -> tuple[Weights, Weights]:
    n_tensors = draw(st.integers(1, 4))
    base: dict[str, torch.Tensor] = {}
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    for i in range(n_tensors):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
        numel = int(np.prod(shape)) if shape else 1
        width = BY_NAME[dtype].width
        raw = rng.integers(0, 2 ** min(width, 63), size=numel, dtype=np.uint64)
        if dtype == "bool":
            raw = raw & 1
        if width == 16 and numel and draw(st.booleans()):
            raw[: min(numel, len(SPECIAL16))] = SPECIAL16[: min(numel, len(SPECIAL16))]
        base[f"t{i}.{dtype}"] = tensor_from_raw(dtype, raw, shape)
    b = Weights.from_tensors(base)
    density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
    t = perturb(b, density, seed + 1)
    if any(tb.dtype.name == "bool" for tb in t.values()):
        for tb in t.values():  # keep bools valid (0/1)
            if tb.dtype.name == "bool":
                tb.bits &= 1
        t.forget_digests()
    return b, t


@given(weight_pairs())
def test_round_trip_is_bit_exact(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=3, target_version=4)
    out = apply(b, d.manifest, d.chunks)
    for name in t:
        assert np.array_equal(out[name].bits, t[name].bits), name
    assert out.digest() == t.digest()


@given(weight_pairs(), st.sampled_from(["sparse", "mixed"]), st.sampled_from([Transform.SUB, Transform.XOR]))
def test_sparse_coding_round_trips_bit_exact(pair: tuple[Weights, Weights], how: str, tr: Transform) -> None:
    b, t = pair
    coding = Coding.SPARSE if how == "sparse" else {n: Coding.SPARSE for n in list(b)[::2]}
    d = encode(b, t, base_version=3, target_version=4, transform=tr, coding=coding)
    assert apply(b, d.manifest, d.chunks).digest() == t.digest()
    work = b.copy()
    apply_in_place(work, d.manifest, d.chunks)
    assert work.digest() == t.digest()


def test_sparse_chunks_cost_bytes_and_save_the_receiver_its_scan() -> None:
    x = torch.from_numpy(np.random.default_rng(4).standard_normal(1 << 20, dtype=np.float32) * 0.02)
    b = Weights.from_tensors({"w": x.to(torch.bfloat16)})
    t = b.copy()
    t["w"].bits[::100] += np.uint16(1)  # a 1-ULP step on 1 % of the elements
    cond = encode(b, t, base_version=0, target_version=1)
    sparse = encode(b, t, base_version=0, target_version=1, coding=Coding.SPARSE)
    assert sparse.stats.sparse_chunks == sparse.stats.chunks
    assert cond.stats.changed == sparse.stats.changed
    assert 2 * cond.nbytes < sparse.nbytes < 5 * cond.nbytes  # ~3.3 B per change against ~1
    staged = DeltaReceiver(sparse.manifest)
    staged.add_all(sparse.chunks)
    patch = staged.stage(b, base_checked=True).patches[0]
    assert patch.idx is not None
    assert np.array_equal(patch.new, t["w"].bits[patch.idx])


@given(weight_pairs(), st.randoms(use_true_random=False))
def test_chunks_apply_in_any_order(pair: tuple[Weights, Weights], rnd: object) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    chunks = list(d.chunks)
    rnd.shuffle(chunks)  # type: ignore[attr-defined]
    assert apply(b, d.manifest, chunks).digest() == t.digest()


@given(weight_pairs())
def test_inverse_gives_base_back(pair: tuple[Weights, Weights]) -> None:
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1)
    inv = invert(b, d)
    assert (inv.manifest.base_version, inv.manifest.target_version) == (1, 0)
    assert apply(t, inv.manifest, inv.chunks).digest() == b.digest()


@given(weight_pairs(), st.integers(0, 2**31))
def test_compose_equals_sequential_apply(pair: tuple[Weights, Weights], seed: int) -> None:
    v0, v1 = pair
    v2 = perturb(v1, 0.05, seed)
    d1 = encode(v0, v1, base_version=0, target_version=1)
    d2 = encode(v1, v2, base_version=1, target_version=2)
    c = compose(v0, [d1, d2])
    assert (c.manifest.base_version, c.manifest.target_version) == (0, 2)
    seq = apply(apply(v0, d1.manifest, d1.chunks), d2.manifest, d2.chunks)
    assert apply(v0, c.manifest, c.chunks).digest() == seq.digest() == v2.digest()


def test_compose_refuses_deltas_that_do_not_chain() -> None:
    v0 = Weights.from_tensors({"w": torch.randn(100).to(torch.bfloat16)})
    v1, v2 = perturb(v0, 0.1, 1), perturb(v0, 0.1, 2)
    d1 = encode(v0, v1, base_version=0, target_version=1)
    d_bad = encode(v0, v2, base_version=0, target_version=2)
    with pytest.raises(DeltaFormatError, match="do not chain"):
        compose(v0, [d1, d_bad])


def test_zero_signs_and_nan_payloads_count_as_changes() -> None:
    # +0.0 -> -0.0 and one NaN payload -> another are equal or unordered as values, different as bits.
    raw = np.array([0x0000, 0x7FC0, 0x3F80], np.uint16)
    new = np.array([0x8000, 0x7FC1, 0x3F80], np.uint16)
    b = Weights.from_tensors({"w": tensor_from_raw("bfloat16", raw, (3,))})
    t = Weights.from_tensors({"w": tensor_from_raw("bfloat16", new, (3,))})
    d = encode(b, t, base_version=0, target_version=1)
    assert d.stats.changed == 2
    assert np.array_equal(apply(b, d.manifest, d.chunks)["w"].bits, new)


def test_small_updates_are_far_smaller_than_dense() -> None:
    # The identity "codec" (ship the target) fails this: 1% of +-1 ulp steps must cost < 1.2 B each.
    torch.manual_seed(0)
    w = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    b = Weights.from_tensors({"w": w})
    t = b.copy()
    rng = np.random.default_rng(0)
    pos = rng.choice(w.numel(), size=w.numel() // 100, replace=False)
    t["w"].bits[pos] += 1
    t.forget_digests()
    d = encode(b, t, base_version=0, target_version=1)
    assert d.nbytes / d.stats.changed < 1.2
    assert d.nbytes < b.nbytes / 50
    assert not d.prefer_snapshot


def test_dense_change_says_snapshot_is_cheaper() -> None:
    rng = np.random.default_rng(0)
    b = Weights.from_tensors({"w": tensor_from_raw("bfloat16", rng.integers(0, 2**16, 50_000), (50_000,))})
    t = Weights.from_tensors({"w": tensor_from_raw("bfloat16", rng.integers(0, 2**16, 50_000), (50_000,))})
    d = encode(b, t, base_version=0, target_version=1)
    assert d.prefer_snapshot
    assert apply(b, d.manifest, d.chunks).digest() == t.digest()


def test_large_tensor_spans_several_chunks_each_bounded() -> None:
    from aurora.codec import MAX_CHUNK_BYTES

    b = Weights.from_tensors({"big": torch.randn(5_000_000).to(torch.bfloat16), "small": torch.randn(3)})
    t = perturb(b, 1.0, 7)  # worst case: every element changes
    d = encode(b, t, base_version=0, target_version=1)
    assert d.manifest.tensors[0].n_chunks == 3
    assert all(len(c) <= MAX_CHUNK_BYTES for c in d.chunks)
    assert apply(b, d.manifest, d.chunks[::-1]).digest() == t.digest()


def test_snapshot_needs_no_base() -> None:
    t = Weights.from_tensors({"a": torch.randn(10, 10).to(torch.bfloat16), "b": torch.arange(5)})
    d = encode(None, t, base_version=None, target_version=9)
    assert d.manifest.is_snapshot
    assert apply(None, d.manifest, d.chunks).digest() == t.digest()


def test_xor_transform_round_trips() -> None:
    from aurora.codec import Transform

    b = Weights.from_tensors({"w": torch.randn(10_000).to(torch.bfloat16)})
    t = perturb(b, 0.05, 3)
    d = encode(b, t, base_version=0, target_version=1, transform=Transform.XOR)
    assert d.manifest.transform is Transform.XOR
    assert apply(b, d.manifest, d.chunks).digest() == t.digest()


def test_apply_in_place_and_receiver_staging() -> None:
    b = Weights.from_tensors({"w": torch.randn(1000).to(torch.bfloat16), "v": torch.randn(10)})
    t = perturb(b, 0.1, 5)
    d = encode(b, t, base_version=0, target_version=1)
    rx = DeltaReceiver(d.manifest)
    assert not rx.complete
    assert rx.missing()
    for c in d.chunks:
        rx.add(c)
    assert rx.complete
    work = b.copy()
    staged = rx.stage(work)
    assert work.digest() == b.digest()  # staging changes nothing
    touched = staged.commit(work)
    assert touched
    assert work.digest() == t.digest()
    work2 = b.copy()
    apply_in_place(work2, d.manifest, d.chunks)
    assert work2.digest() == t.digest()


@given(weight_pairs(), st.sampled_from(["sparse", "conditioned"]), st.randoms(use_true_random=False))
def test_decoding_as_chunks_arrive_changes_nothing_but_when(
    pair: tuple[Weights, Weights], how: str, rnd: object
) -> None:
    """`decode_arrived` between arrivals (at random points, chunks in any order) leaves `stage` with less to do
    and the commit exactly what it would be without it; a base other than the one decoded against is
    decoded anew."""
    import random

    assert isinstance(rnd, random.Random)
    b, t = pair
    d = encode(b, t, base_version=0, target_version=1, coding=Coding(how))
    rx = DeltaReceiver(d.manifest)
    work = b.copy()
    chunks = list(d.chunks)
    rnd.shuffle(chunks)
    decoded = 0
    for c in chunks:
        rx.add(c)
        if rnd.random() < 0.5:
            decoded += rx.decode_arrived(work, threads=rnd.choice([1, 2]))
    assert decoded <= len(chunks)
    rx.stage(work).commit(work)
    assert work.digest() == t.digest()
    other = b.copy()  # decoded against `work` before it changed: not reused for another base
    rx2 = DeltaReceiver(d.manifest)
    rx2.add_all(d.chunks)
    rx2.decode_arrived(work)
    rx2.stage(other).commit(other)
    assert other.digest() == t.digest()


def test_decoding_ahead_reports_nothing_and_stage_still_refuses_a_wrong_base_or_a_bad_body() -> None:
    b = Weights.from_tensors({"w": torch.randn(20_000).to(torch.bfloat16)})
    t = perturb(b, 0.05, 6)
    d = encode(b, t, base_version=0, target_version=1)
    wrong = perturb(b, 0.05, 7)  # same layout, other bits: decoding against it may work or fail
    rx = DeltaReceiver(d.manifest)
    rx.add_all(d.chunks)
    rx.decode_arrived(wrong)  # never raises
    with pytest.raises(DeltaFormatError, match="wrong base"):
        rx.stage(wrong)
    other_layout = Weights.from_tensors({"x": torch.zeros(3)})
    assert rx.decode_arrived(other_layout) == 0  # another layout: nothing to do
    assert rx.undecoded(other_layout) == []  # and it is not tried again
    # a body that fails is tried once ahead, then left for stage to report
    h = unpack_chunk(d.chunks[0]).header
    rx2 = DeltaReceiver(d.manifest)
    rx2.add(pack_chunk(h, b"\xff" * h.body_len))
    rx2.add_all(d.chunks[1:])
    assert rx2.decode_arrived(b) == len(d.chunks) - 1
    assert rx2.undecoded(b) == []
    with pytest.raises(DeltaFormatError, match=r"chunk \(tensor 0, chunk 0\)"):
        rx2.stage(b)
    rx.stage(b).commit(w := b.copy())
    assert w.digest() == t.digest()


def test_a_commit_into_scratch_keeps_no_old_bits_and_a_snapshot_stages_its_bodies_in_place() -> None:
    """``restore=False`` (a snapshot's fresh weights) writes without keeping the old bits, so a failing
    check leaves them written (the caller drops them); RAW patches are the staged bodies, not copies."""
    b = Weights.from_tensors({"w": torch.randn(3000).to(torch.bfloat16)})
    snap = encode(None, b, base_version=None, target_version=0)
    rx = receive(snap.manifest, snap.chunks)
    staged = rx.stage(None)
    assert all(not p.new.flags.owndata and not p.new.flags.writeable for p in staged.patches)

    def refuse(_: Weights) -> None:
        raise ValueError("no")

    kept = blank_weights(snap.manifest)
    with pytest.raises(ValueError, match="no"):
        staged.commit(kept, check=refuse)
    assert not kept["w"].bits.any()  # restored to the zeros it held
    scratch = blank_weights(snap.manifest)
    with pytest.raises(ValueError, match="no"):
        staged.commit(scratch, check=refuse, restore=False)
    assert scratch["w"].bits.tolist() == b["w"].bits.tolist()  # written, not restored: the caller drops it
    assert apply(None, snap.manifest, snap.chunks).digest() == b.digest()


def test_threads_give_identical_bytes_and_results() -> None:
    b = Weights.from_tensors({"w": torch.randn(5_000_000).to(torch.bfloat16), "v": torch.randn(100)})
    t = perturb(b, 0.01, 4)
    d1 = encode(b, t, base_version=0, target_version=1)
    d2 = encode(b, t, base_version=0, target_version=1, threads=2)
    assert d1.chunks == d2.chunks
    assert apply(b, d2.manifest, d2.chunks, threads=2).digest() == t.digest()


def test_a_version_that_changes_nothing_costs_a_manifest_and_reads_no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import aurora.codec.weights as cw
    from aurora.codec import apply, encode

    rng = np.random.default_rng(0)
    w = Weights.from_tensors({f"t{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(20)})
    w.tensor_digests()  # the base's digests are known (a published version's always are)
    new = Weights({n: w[n] for n in w})  # the next version: a step that left every tensor alone
    hashed: list[int] = []
    real = cw.tensor_digest
    monkeypatch.setattr(cw, "tensor_digest", lambda bits: hashed.append(bits.size) or real(bits))
    d = encode(w, new, base_version=1, target_version=2)
    assert hashed == []  # every tensor proved unchanged by identity: not a byte read
    assert d.chunks == ()
    assert d.nbytes < 120 * len(w)  # a manifest row per tensor, nothing per 4 MiB of weights
    assert apply(w, d.manifest, []).digest() == w.digest()
    # equal bits in other arrays: hashed once each, still no chunks
    hashed.clear()
    d2 = encode(w, w.copy(), base_version=1, target_version=2)
    assert d2.chunks == ()
    assert len(hashed) == len(w)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.2, 1.0])
def test_find_changes_grows_its_arrays_and_ranks_within_base_buckets(density: float) -> None:
    """The change arrays start small and grow for dense spans; each change's rank counts the base
    elements of its exponent bucket before it (the reference: a plain loop)."""
    from aurora.codec import kernels

    rng = np.random.default_rng(7)
    base = rng.integers(0, 1 << 16, 5000, dtype=np.uint16)
    target = base.copy()
    pos = rng.choice(base.size, round(base.size * density), replace=False)
    target[pos] ^= np.uint16(1)
    idx, rank, buck, step = kernels.find_changes(base, target, 7, 0xFF, 16, 1)
    seen: dict[int, int] = {}
    want = []
    for i, b in enumerate(base.tolist()):
        e = (b >> 7) & 0xFF
        if b != int(target[i]):
            want.append((i, seen.get(e, 0), e, 1))
        seen[e] = seen.get(e, 0) + 1
    assert list(zip(idx.tolist(), rank.tolist(), buck.tolist(), step.tolist(), strict=True)) == want


@given(
    st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
    st.integers(0, 300),
    st.integers(0, 7),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31),
)
def test_changed_positions_by_words_equal_a_plain_compare(
    dt: type, n: int, offset: int, density: float, seed: int
) -> None:
    """The word-at-a-time scan finds exactly the differing elements, ascending, for every width, at any
    length and start (unaligned spans and partial words included), dense or sparse."""
    from aurora.codec import kernels

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1 << 16, n + offset).astype(dt)[offset:]
    target = base.copy()
    flip = rng.random(n) < density
    target[flip] ^= dt(1 << int(rng.integers(0, 8)))
    got = kernels.changed_positions(base, target, kernels.words(base), kernels.words(target))
    assert got.tolist() == np.flatnonzero(base != target).tolist()


@given(
    st.integers(0, 3000),
    st.integers(0, 3000),
    st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    st.sampled_from([1, 2]),
    st.sampled_from(["bfloat16", "float8_e4m3fn", "float32", "float64", "int16"]),
    st.integers(0, 2**31),
)
def test_two_spans_side_by_side_give_what_each_gives_alone(
    na: int, nb: int, density: float, tr: int, dtype: str, seed: int
) -> None:
    """`find_changes_pair` and `locate_pair` (two count chains at once) return exactly the two results of
    `find_changes` and `locate`, for spans of any two lengths (one longer, one empty) and densities."""
    from aurora.codec import kernels

    d = BY_NAME[dtype]  # 256 buckets, 16, 256 of 32 bits, 2048, one (an integer dtype)
    shift, mask, width = d.exp_shift, d.exp_mask, d.width
    rng = np.random.default_rng(seed)
    spans = []
    for n in (na, nb):
        base = rng.integers(0, 1 << min(width, 63), n, dtype=np.uint64).astype(d.uint)
        target = base.copy()
        target[rng.random(n) < density] += d.uint(1)
        spans.append((base, target))
    (ba, ta), (bb, tb) = spans
    alone = [kernels.find_changes(b, t, shift, mask, width, tr) for b, t in spans]
    paired = kernels.find_changes_pair(ba, ta, bb, tb, shift, mask, width, tr)
    for one, two in zip(alone, paired, strict=True):
        assert [a.tolist() for a in one] == [a.tolist() for a in two]
    decoded = []
    for (b, _t), (idx, rank, buck, step) in zip(spans, alone, strict=True):
        out = np.empty(max(64, 4 * b.nbytes), np.uint8)
        size = kernels.encode_body(rank, buck, step, d.n_buckets, width, tr, out)
        status, first, ranks, vals = kernels.decode_body(out[:size].copy(), idx.size, b.size, d.n_buckets, width, tr)
        assert status == 0
        decoded.append((first, ranks, vals, idx.size))
    got = kernels.locate_pair(ba, *decoded[0], bb, *decoded[1], shift, mask, width, tr)
    for (b, _t), dec, (status, idx, new) in zip(spans, decoded, (got[:3], got[3:]), strict=True):
        want = kernels.locate(b, shift, mask, *dec, width, tr)
        assert status == want[0] == 0
        assert idx.tolist() == want[1].tolist()
        assert new.tolist() == want[2].tolist()


def test_bench_codec_scale_measures_both_sides_both_steps_both_codings_and_every_kernel() -> None:
    from aurora.bench.codec_scale import WORKLOADS, format_scale, run_scale

    out: list[str] = []
    rows = run_scale([1 << 20], threads=2, progress=out.append)
    assert [(r.workload, r.coding) for r in rows] == [(w, c.value) for w in WORKLOADS for c in Coding]
    for row in rows:
        assert row.elements == 1 << 20
        assert 0 < row.delta_bytes < row.elements * 2 // 5
        assert min(row.memcpy_gbps, row.encode_gbps, row.apply_gbps, row.encode_gbps_all, row.apply_gbps_all) > 0
        assert row.codec_over_wire(1e9, True) > 0
    uniform, adam = rows[0], rows[2]
    assert uniform.density == pytest.approx(0.01, rel=0.01)
    assert 0.002 < adam.density < 0.1  # an Adam step at lr 1e-6 moves about 3 % of these bf16 weights
    assert rows[1].delta_bytes > 2 * uniform.delta_bytes  # sparse: more bytes for the same step
    assert "1M uniform 1%" in format_scale(rows)
    assert any("locate (scan, ranks)" in m for m in out)  # the kernel profile follows the table
