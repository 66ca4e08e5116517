"""`warm_up()`: run every codec kernel once on a tiny input, so that the first real version does not pay
the kernels' JIT compile or cache load (seconds on a loaded machine, long enough to miss heartbeats)."""

from __future__ import annotations

import numpy as np
import torch

from aurora.codec.decoder import blank_weights, receive
from aurora.codec.encoder import encode
from aurora.codec.weights import Weights


def warm_up() -> None:
    rng = np.random.default_rng(0)
    bits = (rng.standard_normal(4096, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    a = bits.astype(np.uint16)
    b = a.copy()
    b[::37] += 1

    def weights(x: np.ndarray) -> Weights:
        return Weights.from_tensors({"w": torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)})

    base, target = weights(a), weights(b)
    snap = encode(None, base, base_version=None, target_version=0)
    receive(snap.manifest, snap.chunks).stage(None).commit(blank_weights(snap.manifest))
    delta = encode(base, target, base_version=0, target_version=1)
    receive(delta.manifest, delta.chunks).stage(base).commit(base)
