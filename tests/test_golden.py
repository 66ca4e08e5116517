"""Format v1 golden fixtures: the encoder's bytes and the decoder's reading must not drift."""

from __future__ import annotations

import io

import pytest

from aurora.codec import Transform, apply
from aurora.codec.container import read_delta
from tests.golden_inputs import GOLDEN, golden_bytes, golden_pair


@pytest.mark.parametrize("transform", [Transform.SUB, Transform.XOR])
def test_encoder_reproduces_golden_bytes(transform: Transform) -> None:
    want = (GOLDEN / f"v1-{transform.name.lower()}.audelta").read_bytes()
    assert golden_bytes(transform) == want


@pytest.mark.parametrize("transform", [Transform.SUB, Transform.XOR])
def test_golden_file_decodes_to_target(transform: Transform) -> None:
    base, target = golden_pair()
    m, chunks = read_delta(io.BytesIO((GOLDEN / f"v1-{transform.name.lower()}.audelta").read_bytes()))
    assert (m.base_version, m.target_version, m.transform) == (7, 8, transform)
    assert [t.name for t in m.tensors] == ["layer.weight", "scalar", "step"]
    out = apply(base, m, list(chunks))
    assert out.digest() == target.digest() == m.target_digest
