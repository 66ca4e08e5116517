"""Layer 1: the codec's device path (torch passes) writes and applies the CPU path's bytes.

Run here on CPU tensors; the same code runs on CUDA tensors (`aurora bench codec --scale --device cuda`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.codec import Transform, Weights, encode, kernels
from aurora.codec.device import apply_on_device, encode_on_device, find_changes
from aurora.codec.dtypes import dtype_named
from aurora.codec.encoder import Coding
from aurora.codec.format import chunk_range, span_elements
from aurora.errors import DeltaFormatError
from tests.helpers import perturb
from tests.test_codec import weight_pairs


def _tensors(w: Weights) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in w.to_tensors().items()}


def _same_bits(a: dict[str, torch.Tensor], w: Weights) -> bool:
    return Weights.from_tensors(a).digest() == w.digest()


@settings(max_examples=60, deadline=None)
@given(weight_pairs(), st.sampled_from([Transform.SUB, Transform.XOR]), st.sampled_from(list(Coding)))
def test_device_path_writes_the_cpu_bytes_and_applies_them(
    pair: tuple[Weights, Weights], tr: Transform, coding: Coding
) -> None:
    b, t = pair
    cpu = encode(b, t, base_version=3, target_version=4, transform=tr, coding=coding)
    dev = encode_on_device(_tensors(b), _tensors(t), base_version=3, target_version=4, transform=tr, coding=coding)
    assert dev.manifest == cpu.manifest
    assert dev.chunks == cpu.chunks
    params = _tensors(b)
    apply_on_device(params, cpu.manifest, cpu.chunks)
    assert _same_bits(params, t)


def _big_pair(spans: float, density: float) -> tuple[Weights, Weights]:
    d = dtype_named("bfloat16")
    n = int(span_elements(d) * spans)
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 0.02).to(torch.bfloat16)
    b = Weights.from_tensors({"w": x, "small": torch.ones(7, dtype=torch.bfloat16)})
    return b, perturb(b, density, 6)


@pytest.mark.parametrize("window_spans", [1, 2, 64])
def test_spans_ranked_in_windows_match_the_numba_scan(window_spans: int) -> None:
    b, t = _big_pair(2.3, 0.01)
    d = b["w"].dtype
    window = window_spans * span_elements(d)
    got = list(
        find_changes(torch.from_numpy(b["w"].bits), torch.from_numpy(t["w"].bits), d, Transform.SUB, window=window)
    )
    assert [ci for ci, _ in got] == [0, 1, 2]
    for ci, found in got:
        lo, hi = chunk_range(b["w"].bits.size, d, ci)
        want = kernels.find_changes(b["w"].bits[lo:hi], t["w"].bits[lo:hi], d.exp_shift, d.exp_mask, d.width, 2)
        for x, y in zip(found, want, strict=True):
            assert np.array_equal(x, y)
    cpu = encode(b, t, base_version=1, target_version=2)
    dev = encode_on_device(_tensors(b), _tensors(t), base_version=1, target_version=2, window=window, threads=2)
    assert dev.chunks == cpu.chunks
    params = _tensors(b)
    apply_on_device(params, cpu.manifest, cpu.chunks, window=window, threads=2)
    assert _same_bits(params, t)


def test_a_snapshot_lands_on_the_device() -> None:
    _, t = _big_pair(0.01, 0.05)
    snap = encode(None, t, base_version=None, target_version=9)
    params = {n: torch.zeros_like(x) for n, x in t.to_tensors().items()}
    apply_on_device(params, snap.manifest, snap.chunks)
    assert _same_bits(params, t)


def test_a_delta_for_another_base_changes_nothing_on_the_device() -> None:
    b, t = _big_pair(0.3, 0.01)
    other = perturb(b, 0.2, 11)
    d = encode(b, t, base_version=1, target_version=2)
    params = _tensors(other)
    with pytest.raises(DeltaFormatError, match="wrong base"):
        apply_on_device(params, d.manifest, d.chunks)
    with pytest.raises(DeltaFormatError, match=r"do not fit this base|differ from the target digests"):
        apply_on_device(params, d.manifest, d.chunks, base_checked=True)  # found by the ranks or the digests
    assert _same_bits(params, other)
    wrong_shape = _tensors(b) | {"small": torch.ones(8, dtype=torch.bfloat16)}
    with pytest.raises(DeltaFormatError, match="'small'"):
        apply_on_device(wrong_shape, d.manifest, d.chunks)


@settings(max_examples=40, deadline=None)
@given(weight_pairs(), st.sampled_from(list(Coding)), st.integers(1, 4))
def test_tiny_spans_cross_every_window_boundary(pair: tuple[Weights, Weights], coding: Coding, spans: int) -> None:
    # 96-byte spans: a 40x40 tensor has dozens of spans and windows of 1-4 of them, for every dtype.
    from aurora.codec import format as fmt

    b, t = pair
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fmt, "CHUNK_SPAN_BYTES", 96)
        cpu = encode(b, t, base_version=1, target_version=2, coding=coding)
        dev = encode_on_device(
            _tensors(b), _tensors(t), base_version=1, target_version=2, coding=coding, window=spans * 12, threads=2
        )
        assert dev.chunks == cpu.chunks
        params = _tensors(b)
        apply_on_device(params, cpu.manifest, cpu.chunks, window=spans * 12)
        assert _same_bits(params, t)


def test_a_tensor_that_is_not_contiguous_is_refused_before_any_write() -> None:
    b, t = _big_pair(0.01, 0.05)
    d = encode(b, t, base_version=1, target_version=2)
    params = _tensors(b)
    wide = torch.zeros(params["w"].shape[0], 2, dtype=torch.bfloat16)
    wide[:, 0] = params["w"]
    params["w"] = wide[:, 0]  # the right bits and shape, every other element of a buffer
    with pytest.raises(DeltaFormatError, match="not contiguous"):
        apply_on_device(params, d.manifest, d.chunks)
    assert torch.equal(wide[:, 0].view(torch.int16), torch.from_numpy(b["w"].bits.view(np.int16)))
