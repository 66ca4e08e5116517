"""Reference coders and bounds the codec benchmark compares against.

* `leb128_bytes`: the published design: sorted positions as LEB128 varint gaps
  plus the changed elements' values (2 bytes for bf16), actually encoded.
* `int32_bytes`: int32 positions plus values.
* `entropy_bounds`: blind positions (n·H(p) per tensor), positions conditioned on
  the base's exponent, and the empirical value entropy given the exponent.
"""

from __future__ import annotations

import numpy as np

from aurora.codec import Weights


def _leb128(gaps: np.ndarray) -> bytes:
    g = gaps.astype(np.uint64)
    nbytes = np.maximum(1, (64 - _clz64(g) + 6) // 7)
    total = int(nbytes.sum())
    out = np.empty(total, np.uint8)
    offs = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    for b in range(int(nbytes.max(initial=0))):
        sel = nbytes > b
        chunk = (g[sel] >> np.uint64(7 * b)) & np.uint64(0x7F)
        more = (nbytes[sel] > b + 1).astype(np.uint64) << np.uint64(7)
        out[offs[sel] + b] = (chunk | more).astype(np.uint8)
    return out.tobytes()


def _clz64(g: np.ndarray) -> np.ndarray:
    bl = np.zeros(g.shape, np.int64)
    x = g.copy()
    for s in (32, 16, 8, 4, 2, 1):
        big = x >= (np.uint64(1) << np.uint64(s))
        bl += big * s
        x = np.where(big, x >> np.uint64(s), x)
    bl += (x > 0).astype(np.int64)
    return 64 - bl


def leb128_bytes(base: Weights, target: Weights) -> int:
    total = 0
    for name in target:
        b, t = base[name].bits, target[name].bits
        pos = np.flatnonzero(b != t)
        if pos.size == 0:
            continue
        gaps = np.diff(pos, prepend=-1) - 1
        total += len(_leb128(gaps)) + pos.size * t.itemsize
    return total


def int32_bytes(base: Weights, target: Weights) -> int:
    return sum(int((base[n].bits != target[n].bits).sum()) * (4 + target[n].bits.itemsize) for n in target)


def _h2(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return np.where((p <= 0) | (p >= 1), 0.0, -(p * np.log2(p) + q * np.log2(q)))


def entropy_bounds(base: Weights, target: Weights) -> dict[str, float]:
    """Bits totals: blind positions, positions | exponent, values | exponent (empirical)."""
    blind = cond = vals = 0.0
    for name in target:
        tb = target[name]
        b, t = base[name].bits, tb.bits
        ch = b != t
        c = int(ch.sum())
        n = b.size
        if c == 0:
            continue
        blind += float(n * _h2(np.array(c / n)))
        e = ((b.astype(np.uint64) >> np.uint64(tb.dtype.exp_shift)) & np.uint64(tb.dtype.exp_mask)).astype(np.int64)
        ne = np.bincount(e, minlength=tb.dtype.n_buckets)
        ce = np.bincount(e[ch], minlength=tb.dtype.n_buckets)
        ok = ne > 0
        cond += float((ne[ok] * _h2(ce[ok] / ne[ok])).sum())
        w = tb.dtype.width
        step = (t[ch].astype(np.uint64) - b[ch].astype(np.uint64)) & np.uint64(2**w - 1)
        pairs = np.stack([e[ch], step.view(np.int64)])
        _, counts = np.unique(pairs, axis=1, return_counts=True)
        _, idx = np.unique(e[ch], return_inverse=True)
        # H(step | e) = H(e, step) - H(e)
        pj = counts / c
        pe = np.bincount(idx) / c
        vals += float(c * (-(pj * np.log2(pj)).sum() + (pe * np.log2(pe)).sum()))
    return {"blind_positions": blind, "cond_positions": cond, "cond_values": vals}
