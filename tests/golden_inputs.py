"""The fixed inputs behind the golden fixtures (tests/golden/v*.audelta).

The v1 files are kept as v1 wrote them (this build must still read them); the v2 ones are what
this build writes for a delta without SPARSE chunks (byte for byte what v2 wrote), from the same
pair plus a tensor the delta leaves unchanged (v2 gives it no chunks); ``v3-sparse`` is the same
delta with SPARSE chunks (format v3). Regenerate only on a deliberate format change (and bump FORMAT_VERSION):
``python -m tests.golden_inputs`` (it writes the current version's files only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aurora.codec import Transform, Weights, encode
from aurora.codec.container import write_delta
from aurora.codec.encoder import Coding
from aurora.codec.format import FORMAT_VERSION, PLAIN_VERSION
from tests.helpers import tensor_from_raw

GOLDEN = Path(__file__).parent / "golden"


def golden_pair(*, unchanged: bool = False) -> tuple[Weights, Weights]:
    """The pair; ``unchanged``: with a tensor ``frozen`` the same in both (the v2 fixtures)."""
    base, target = _pair()
    if unchanged:
        frozen = tensor_from_raw("bfloat16", np.arange(40, dtype=np.uint64) + 0x3F00, (40,))
        base, target = {**base, "frozen": frozen}, {**target, "frozen": frozen.clone()}
    return Weights.from_tensors(base), Weights.from_tensors(target)


def _pair() -> tuple[dict[str, Any], dict[str, Any]]:
    n = 600
    i = np.arange(n, dtype=np.uint64)
    # bf16 bit patterns across several exponents, deterministic without any RNG.
    base_bf16 = (0x3C00 + (i * 2654435761) % 0x0600).astype(np.uint64)
    tgt_bf16 = base_bf16.copy()
    tgt_bf16[i % 7 == 0] += 1
    tgt_bf16[i % 31 == 3] -= 2
    tgt_bf16[5] = 0x8000
    base_i32 = (i * 40503) % 100_000
    tgt_i32 = base_i32.copy()
    tgt_i32[::50] += 3
    base = {
        "layer.weight": tensor_from_raw("bfloat16", base_bf16, (20, 30)),
        "step": tensor_from_raw("int32", base_i32[:10], (10,)),
        "scalar": tensor_from_raw("float32", np.array([0x3F800000], np.uint64), ()),
    }
    target = {
        "layer.weight": tensor_from_raw("bfloat16", tgt_bf16, (20, 30)),
        "step": tensor_from_raw("int32", tgt_i32[:10], (10,)),
        "scalar": tensor_from_raw("float32", np.array([0x3F800001], np.uint64), ()),
    }
    return base, target


def golden_bytes(transform: Transform, coding: Coding = Coding.CONDITIONED) -> bytes:
    import io

    b, t = golden_pair(unchanged=True)
    d = encode(b, t, base_version=7, target_version=8, transform=transform, coding=coding)
    buf = io.BytesIO()
    write_delta(buf, d.manifest, d.chunks)
    return buf.getvalue()


if __name__ == "__main__":
    GOLDEN.mkdir(exist_ok=True)
    for tr in (Transform.SUB, Transform.XOR):
        (GOLDEN / f"v{PLAIN_VERSION}-{tr.name.lower()}.audelta").write_bytes(golden_bytes(tr))
    (GOLDEN / f"v{FORMAT_VERSION}-sparse.audelta").write_bytes(golden_bytes(Transform.SUB, Coding.SPARSE))
    print("wrote", sorted(p.name for p in GOLDEN.iterdir()))
