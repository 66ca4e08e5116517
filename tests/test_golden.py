"""Golden fixtures: the encoder's bytes (v2 without SPARSE chunks, v3 with) and the decoder's reading (v1, v2, v3)
must not drift."""

from __future__ import annotations

import io

import pytest

from aurora.codec import ChunkKind, Transform, apply, unpack_chunk
from aurora.codec.container import read_delta
from aurora.codec.encoder import Coding
from aurora.codec.format import FORMAT_VERSION, PLAIN_VERSION
from tests.golden_inputs import GOLDEN, golden_bytes, golden_pair


@pytest.mark.parametrize("transform", [Transform.SUB, Transform.XOR])
def test_encoder_reproduces_golden_bytes(transform: Transform) -> None:
    want = (GOLDEN / f"v{PLAIN_VERSION}-{transform.name.lower()}.audelta").read_bytes()  # v2, as v2 wrote it
    assert golden_bytes(transform) == want


def test_encoder_reproduces_golden_sparse_bytes() -> None:
    assert golden_bytes(Transform.SUB, Coding.SPARSE) == (GOLDEN / f"v{FORMAT_VERSION}-sparse.audelta").read_bytes()


def test_golden_sparse_file_decodes_to_target() -> None:
    base, target = golden_pair(unchanged=True)
    m, chunks = read_delta(io.BytesIO((GOLDEN / "v3-sparse.audelta").read_bytes()))
    assert m.format == 3
    chunks = list(chunks)
    kinds = [unpack_chunk(c).header.kind for c in chunks]
    assert kinds == [ChunkKind.SPARSE, ChunkKind.RAW, ChunkKind.SPARSE]  # one element: raw is smaller
    assert apply(base, m, chunks).digest() == target.digest() == m.target_digest


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("transform", [Transform.SUB, Transform.XOR])
def test_golden_file_decodes_to_target(transform: Transform, version: int) -> None:
    base, target = golden_pair(unchanged=version >= 2)
    m, chunks = read_delta(io.BytesIO((GOLDEN / f"v{version}-{transform.name.lower()}.audelta").read_bytes()))
    assert (m.base_version, m.target_version, m.transform, m.format) == (7, 8, transform, version)
    names = ["layer.weight", "scalar", "step"] if version == 1 else ["frozen", "layer.weight", "scalar", "step"]
    assert [t.name for t in m.tensors] == names
    chunks = list(chunks)
    assert len(chunks) == m.n_chunks == 3  # v2: the unchanged tensor has none
    out = apply(base, m, chunks)
    assert out.digest() == target.digest() == m.target_digest
