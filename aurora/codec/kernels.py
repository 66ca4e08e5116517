"""Compiled inner loops of the delta codec (numba, nopython, GIL released).

Everything here works on flat arrays of *raw bit patterns* (``uint8``/``uint16``/
``uint32``/``uint64``) and never on float values, so the codec is exact by
construction. The Python layer (`aurora.codec.encoder` / `decoder`) does all
validation of untrusted input before it reaches these functions; the kernels
still bound every loop and index so that a hostile body cannot make them read or
write out of range: they return an error code instead.

Model (see docs/delta-format.md §4):

* An element's *bucket* is the exponent field of its **base** bit pattern
  (``(bits >> shift) & mask``; one bucket for integer dtypes). Both sides know it,
  the receiver because it holds the base.
* Inside a bucket, the changed elements are identified by their *rank* (how many
  elements of the same bucket precede them in the chunk). Rank gaps are coded as
  adaptive Rice codes: the quotient in unary with adaptive binary contexts, the
  top two remainder bits with adaptive contexts, the rest as direct bits.
* A value is the signed integer step between the base and target bit patterns
  (``sub``, modulo 2**W) or their XOR (``xor``); it is coded as sign plus an
  Elias-gamma magnitude whose length and leading mantissa bit use adaptive
  contexts.
* The entropy coder is an LZMA-style binary range coder (11-bit probabilities,
  adaptation shift 5, carry propagation via cache/cache_size).

Invariants: ``decode_body`` inverts ``encode_body`` exactly for every input;
kernels never index outside the arrays they are given.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

U64 = np.uint64
_TOP = U64(1 << 24)
_M32 = U64(0xFFFFFFFF)
_M24 = U64(0x00FFFFFF)
_HI = U64(0xFF000000)
_FF = U64(0xFF)
_ALL64 = U64(0xFFFFFFFFFFFFFFFF)
_PROB_BITS = U64(11)
_PROB_ONE = 2048  # 1 << 11, as in LZMA
_PROB_INIT = 1024
_MOVE = 5  # adaptation shift, as in LZMA

# Context layout (one int32 array per chunk). Numbers are small and fixed so
# the decoder can rebuild the same layout with no side information.
N_QCTX = 12  # unary quotient contexts for rank gaps (last one shared)
N_RCTX = 4  # top-two-remainder-bit tree contexts (index 1..3)
N_LCTX = 24  # unary length contexts for value magnitudes (last one shared)
N_MCTX = 65  # first-mantissa-bit context per magnitude length (0..64)
CTX_Q = 0
CTX_R = CTX_Q + N_QCTX
CTX_SIGN = CTX_R + N_RCTX
CTX_L = CTX_SIGN + 1
CTX_M = CTX_L + N_LCTX
N_CTX = CTX_M + N_MCTX

# Error codes returned (negated) by the kernels.
ERR_OVERFLOW = 1  # output buffer too small
ERR_TRUNCATED = 2  # body ended early / malformed varint
ERR_RANGE = 3  # a decoded position or count is out of range
ERR_LEFTOVER = 4  # decoded positions that no base element matched

MAX_RICE_K = 62


# --------------------------------------------------------------------------- range coder
# The coder state travels as scalars through small helpers that take no arrays: numba's own
# inlining of a helper that takes an array adds reference counting at every call (measured 11x
# slower per bit in /tmp micro-benchmarks), and a helper LLVM declines to inline is a costly call.
# So a bit is coded by an array-free inlined helper, without a branch on the bit (masks and a
# select: a random sign bit cost a misprediction each); the caller stores the new probability and
# renormalises, which takes at most one byte shift per bit (probabilities stay in [31, 2017], so a
# coded bit leaves the range >= 2**17; up to 8 direct bits leave it >= 2**16).
# Encoder state: (low, rng, cache, csize, pos); decoder state: (code, rng, pos).


@njit(cache=True)
def _shift_low(low, rng, cache, csize, pos, out):  # type: ignore[no-untyped-def]
    """Renormalise by one byte: the top byte of ``low`` goes out (LZMA's ShiftLow, carries through
    cache/cache_size) and ``rng`` grows by 8 bits. Not inlined: it runs about once per output byte."""
    if (low & _M32) < _HI or (low >> U64(32)) != U64(0):
        carry = low >> U64(32)
        temp = cache
        cap = out.shape[0]
        while True:
            if pos < cap:
                out[pos] = np.uint8((temp + carry) & _FF)
            pos += 1
            temp = _FF
            csize -= U64(1)
            if csize == U64(0):
                break
        cache = (low >> U64(24)) & _FF
    csize += U64(1)
    low = (low & _M24) << U64(8)
    return low, rng << U64(8), cache, csize, pos


@njit(inline="always", cache=True)
def _ebit(low, rng, p, bit):  # type: ignore[no-untyped-def]
    """Code ``bit`` with probability ``p``/2048 of a zero: the new (low, rng, p), not yet renormalised."""
    bound = (rng >> _PROB_BITS) * U64(p)
    m = U64(0) - U64(bit)
    p0 = p + ((_PROB_ONE - p) >> _MOVE)
    p1 = p - (p >> _MOVE)
    return low + (bound & m), bound + ((rng - bound - bound) & m), p1 if bit else p0


@njit(inline="always", cache=True)
def _edirect(low, rng, value, take):  # type: ignore[no-untyped-def]
    """Code the low ``take`` (<= 8) bits of ``value`` as equiprobable bits: the new (low, rng)."""
    rng = rng >> U64(take)
    return low + rng * (value & U64((1 << take) - 1)), rng


@njit(inline="always", cache=True)
def _dbit(code, rng, p):  # type: ignore[no-untyped-def]
    """Decode one bit with probability ``p``/2048 of a zero: (code, rng, p, bit), not yet renormalised."""
    bound = (rng >> _PROB_BITS) * U64(p)
    bit = 0 if code < bound else 1
    m = U64(0) - U64(bit)
    p0 = p + ((_PROB_ONE - p) >> _MOVE)
    p1 = p - (p >> _MOVE)
    return code - (bound & m), bound + ((rng - bound - bound) & m), p1 if bit else p0, bit


@njit(inline="always", cache=True)
def _dnext(code, rng, pos, byte):  # type: ignore[no-untyped-def]
    """Shift the next body byte into ``code``."""
    return ((code << U64(8)) | U64(byte)) & _M32, rng << U64(8), pos + 1


@njit(inline="always", cache=True)
def _ddirect(code, rng, take):  # type: ignore[no-untyped-def]
    """Decode ``take`` (<= 8) equiprobable bits: (code, rng, value)."""
    rng = rng >> U64(take)
    d = code // rng
    top = U64((1 << take) - 1)
    if d > top:  # only a corrupt stream gets here
        d = top
    return code - d * rng, rng, d


# --------------------------------------------------------------------------- varints
@njit(inline="always", cache=True)
def _put_varint(out: np.ndarray, pos: int, v: np.uint64) -> int:
    while True:
        byte = v & U64(0x7F)
        v = v >> U64(7)
        if pos < out.shape[0]:
            out[pos] = np.uint8(byte | (U64(0x80) if v != U64(0) else U64(0)))
        pos += 1
        if v == U64(0):
            return pos


@njit(inline="always", cache=True)
def _get_varint(src: np.ndarray, pos: int, end: int) -> tuple[np.uint64, int]:
    """A canonical LEB128 varint (the shortest form, at most 64 bits), or ``(0, -1)``: so one value
    has one encoding, and no bit is silently dropped."""
    v = U64(0)
    shift = U64(0)
    while True:
        if pos >= end or shift > U64(63):
            return U64(0), -1
        byte = U64(src[pos])
        pos += 1
        if shift == U64(63) and byte > U64(1):
            return U64(0), -1
        v |= (byte & U64(0x7F)) << shift
        if byte < U64(0x80):
            if byte == U64(0) and shift > U64(0):  # a trailing zero group: not the shortest form
                return U64(0), -1
            return v, pos
        shift += U64(7)


@njit(inline="always", cache=True)
def _bitlen(v: np.uint64) -> int:
    n = 0
    while v != U64(0):
        v = v >> U64(1)
        n += 1
    return n


# --------------------------------------------------------------------------- scan
@njit(cache=True, nogil=True)
def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.empty(cap, a.dtype)
    out[: a.shape[0]] = a
    return out


@njit(cache=True, nogil=True)
def _scan(base, target, sh, mk, wmask, transform, counts, i, k, idx, rank, buck, step):  # type: ignore[no-untyped-def]
    """`find_changes` from element ``i`` with ``k`` changes found: stops at the end, or at a change
    that does not fit the arrays (its count not taken); returns where it stopped and the changes
    found. One count per element, read and written: a chain from one element of a bucket to the
    next, the loop's whole cost at low densities (`find_changes_pair` runs two chains at once)."""
    n = base.shape[0]
    cap = idx.shape[0]
    while i < n:
        b = base[i]
        t = target[i]
        e = np.int64((U64(b) >> sh) & mk)
        r = counts[e]
        counts[e] = r + 1
        if b != t:
            if k == cap:
                counts[e] = r
                return i, k
            idx[k] = i
            rank[k] = r
            buck[k] = e
            step[k] = ((U64(t) - U64(b)) & wmask) if transform == 2 else (U64(t) ^ U64(b))
            k += 1
        i += 1
    return i, k


@njit(cache=True, nogil=True)
def _scan_pair(ba, ta, bb, tb, sh, mk, wmask, transform, ca, cb, i, n, ka, kb, ia, ra, ea, sa, ib, rb, eb, sb):  # type: ignore[no-untyped-def]
    """`_scan` of two spans at once, element ``i`` of each per step, up to ``n``: their count chains
    are independent, so the core overlaps them. Stops at ``n``, or before a step when either side's
    arrays are full (nothing of that step taken)."""
    capa = ia.shape[0]
    capb = ib.shape[0]
    # Each half of the step is `_scan`'s body, written out per span on purpose (see `locate_pair`).
    while i < n:
        if ka == capa or kb == capb:
            return i, ka, kb
        x = ba[i]
        y = ta[i]
        e = np.int64((U64(x) >> sh) & mk)
        r = ca[e]
        ca[e] = r + 1
        if x != y:
            ia[ka] = i
            ra[ka] = r
            ea[ka] = e
            sa[ka] = ((U64(y) - U64(x)) & wmask) if transform == 2 else (U64(y) ^ U64(x))
            ka += 1
        x = bb[i]
        y = tb[i]
        e = np.int64((U64(x) >> sh) & mk)
        r = cb[e]
        cb[e] = r + 1
        if x != y:
            ib[kb] = i
            rb[kb] = r
            eb[kb] = e
            sb[kb] = ((U64(y) - U64(x)) & wmask) if transform == 2 else (U64(y) ^ U64(x))
            kb += 1
        i += 1
    return i, ka, kb


@njit(cache=True, nogil=True)
def _changes_for(n):  # type: ignore[no-untyped-def]
    """Empty change arrays for a span of ``n`` elements: room for 1/16 of them to start with."""
    cap = min(n, max(1024, n >> 4))
    return np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.uint64)


@njit(cache=True, nogil=True)
def _grown(idx, rank, buck, step, n):  # type: ignore[no-untyped-def]
    """The change arrays with twice the room (at most ``n``), what they hold kept."""
    cap = min(n, max(1, 2 * idx.shape[0]))
    return _grow(idx, cap), _grow(rank, cap), _grow(buck, cap), _grow(step, cap)


@njit(cache=True, nogil=True)
def _scan_rest(base, target, sh, mk, wmask, transform, counts, i, k, idx, rank, buck, step):  # type: ignore[no-untyped-def]
    """`_scan` from element ``i`` to the end, the arrays doubled as often as needed; the changes found."""
    n = base.shape[0]
    i, k = _scan(base, target, sh, mk, wmask, transform, counts, i, k, idx, rank, buck, step)
    while i < n:
        idx, rank, buck, step = _grown(idx, rank, buck, step, n)
        i, k = _scan(base, target, sh, mk, wmask, transform, counts, i, k, idx, rank, buck, step)
    return idx[:k], rank[:k], buck[:k], step[:k]


@njit(cache=True, nogil=True)
def find_changes(
    base: np.ndarray, target: np.ndarray, shift: int, mask: int, width: int, transform: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Positions, bucket ranks, buckets and steps of elements whose bits differ.

    Returns ``(idx, rank, bucket, step)`` for the changed elements, in index
    order; ``step`` is ``(target - base) mod 2**width`` (sub) or ``target ^ base``
    (xor), computed here while the elements are in cache. The arrays start with
    room for 1/16 of the elements and double when a denser span needs more, so
    memory follows the change, not the span.
    """
    idx, rank, buck, step = _changes_for(base.shape[0])
    return _scan_rest(
        base,
        target,
        U64(shift),
        U64(mask),
        _ALL64 >> U64(64 - width),
        transform,
        np.zeros(mask + 1, np.int64),
        0,
        0,
        idx,
        rank,
        buck,
        step,
    )


@njit(cache=True, nogil=True)
def find_changes_pair(  # type: ignore[no-untyped-def]
    base_a: np.ndarray,
    target_a: np.ndarray,
    base_b: np.ndarray,
    target_b: np.ndarray,
    shift: int,
    mask: int,
    width: int,
    transform: int,
):
    """`find_changes` of two spans of one dtype (any two: of one tensor or of two), both at once: the
    same two results, found about 1.3-1.5x faster on one core (measured on 2 M-element spans), because
    the two spans' count chains run side by side. The longer span's rest is scanned alone."""
    sh, mk, wmask = U64(shift), U64(mask), _ALL64 >> U64(64 - width)
    na, nb = base_a.shape[0], base_b.shape[0]
    ca, cb = np.zeros(mask + 1, np.int64), np.zeros(mask + 1, np.int64)
    ia, ra, ea, sa = _changes_for(na)
    ib, rb, eb, sb = _changes_for(nb)
    n = min(na, nb)
    i, ka, kb = _scan_pair(
        base_a, target_a, base_b, target_b, sh, mk, wmask, transform, ca, cb, 0, n, 0, 0, ia, ra, ea, sa, ib, rb, eb, sb
    )
    while i < n:
        if ka == ia.shape[0]:
            ia, ra, ea, sa = _grown(ia, ra, ea, sa, na)
        if kb == ib.shape[0]:
            ib, rb, eb, sb = _grown(ib, rb, eb, sb, nb)
        i, ka, kb = _scan_pair(
            base_a,
            target_a,
            base_b,
            target_b,
            sh,
            mk,
            wmask,
            transform,
            ca,
            cb,
            i,
            n,
            ka,
            kb,
            ia,
            ra,
            ea,
            sa,
            ib,
            rb,
            eb,
            sb,
        )
    return (
        _scan_rest(base_a, target_a, sh, mk, wmask, transform, ca, n, ka, ia, ra, ea, sa),
        _scan_rest(base_b, target_b, sh, mk, wmask, transform, cb, n, kb, ib, rb, eb, sb),
    )


@njit(cache=True, nogil=True)
def _rice_k(ranks: np.ndarray, lo: int, hi: int) -> int:
    # Mean gap -> Rice parameter so that quotients average about 1.
    n = hi - lo
    if n == 0:
        return 0
    total = ranks[hi - 1] - n + 1  # sum of (gap) = last_rank - (n - 1)
    mean = total / n
    k = 0
    while k < MAX_RICE_K and (1 << (k + 1)) <= mean * 0.69 + 1.0:  # 2**k ~ m*ln2 (Golomb)
        k += 1
    return k


# --------------------------------------------------------------------------- encode
@njit(cache=True, nogil=True)
def encode_body(
    rank: np.ndarray,
    buck: np.ndarray,
    step: np.ndarray,
    n_buckets: int,
    width: int,
    transform: int,
    out: np.ndarray,
) -> int:
    """Write the coded body (bucket table + range-coded stream) into ``out``.

    ``rank``/``buck``/``step`` come from `find_changes`. ``transform`` is 1 for
    xor, 2 for sub. Returns the number of bytes written, or ``-ERR_OVERFLOW``
    when ``out`` is too small.
    """
    n = rank.shape[0]
    wmask = _ALL64 >> U64(64 - width)
    signbit = U64(width - 1)
    # Stable counting sort of the changed elements by bucket.
    cnt = np.zeros(n_buckets + 1, np.int64)
    for j in range(n):
        cnt[buck[j] + 1] += 1
    for e in range(n_buckets):
        cnt[e + 1] += cnt[e]
    start = cnt.copy()
    order = np.empty(n, np.int64)
    for j in range(n):
        e = buck[j]
        order[start[e]] = j
        start[e] += 1
    sranks = np.empty(n, np.int64)
    for j in range(n):
        sranks[j] = rank[order[j]]
    # Bucket table.
    used = 0
    for e in range(n_buckets):
        if cnt[e + 1] > cnt[e]:
            used += 1
    pos = _put_varint(out, 0, U64(used))
    ks = np.zeros(n_buckets, np.int64)
    for e in range(n_buckets):
        lo = cnt[e]
        hi = cnt[e + 1]
        if hi == lo:
            continue
        is_all = sranks[hi - 1] == hi - lo - 1  # ranks are exactly 0..n-1
        k = _rice_k(sranks, lo, hi)
        ks[e] = k
        pos = _put_varint(out, pos, U64(e))
        pos = _put_varint(out, pos, U64(hi - lo))
        if pos < out.shape[0]:
            out[pos] = np.uint8(k | (0x80 if is_all else 0))
        pos += 1
    if pos > out.shape[0]:
        return -ERR_OVERFLOW
    # Range-coded stream: per bucket, each element's gap then its value. After each coded bit,
    # `if rng < _TOP` renormalises (one byte out: see the range coder's note).
    low, rng, cache, csize = U64(0), _M32, U64(0), U64(1)
    probs = np.full(N_CTX, _PROB_INIT, np.int64)
    cap = out.shape[0]
    for e in range(n_buckets):
        lo = cnt[e]
        hi = cnt[e + 1]
        if hi == lo:
            continue
        is_all = sranks[hi - 1] == hi - lo - 1
        k = ks[e]
        kk = U64(k)
        prev = -1
        for j in range(lo, hi):
            r = sranks[j]
            if not is_all:
                g = U64(r - prev - 1)
                q = g >> kk
                t = 0
                while True:  # q ones, then a zero
                    c = CTX_Q + min(t, N_QCTX - 1)
                    one = U64(t) < q
                    low, rng, probs[c] = _ebit(low, rng, probs[c], 1 if one else 0)
                    if rng < _TOP:
                        low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
                    if not one:
                        break
                    t += 1
                if k >= 1:
                    b1 = int((g >> (kk - U64(1))) & U64(1))
                    low, rng, probs[CTX_R + 1] = _ebit(low, rng, probs[CTX_R + 1], b1)
                    if rng < _TOP:
                        low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
                if k >= 2:
                    b2 = int((g >> (kk - U64(2))) & U64(1))
                    c = CTX_R + 2 + b1
                    low, rng, probs[c] = _ebit(low, rng, probs[c], b2)
                    if rng < _TOP:
                        low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
                    left = k - 2
                    while left > 0:
                        take = min(left, 8)
                        left -= take
                        low, rng = _edirect(low, rng, g >> U64(left), take)
                        if rng < _TOP:
                            low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
            prev = r
            d = step[order[j]]
            if transform == 2:
                neg = (d >> signbit) & U64(1)
                mag = ((U64(0) - d) & wmask) if neg else d
                low, rng, probs[CTX_SIGN] = _ebit(low, rng, probs[CTX_SIGN], int(neg))
                if rng < _TOP:
                    low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
            else:
                mag = d
            L = _bitlen(mag) - 1
            t = 0
            while t < L or (t == L and width - 1 > L):  # L ones, then a zero unless L is the widest
                c = CTX_L + min(t, N_LCTX - 1)
                one = t < L
                low, rng, probs[c] = _ebit(low, rng, probs[c], 1 if one else 0)
                if rng < _TOP:
                    low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
                t += 1
            if L >= 1:
                mb = int((mag >> U64(L - 1)) & U64(1))
                low, rng, probs[CTX_M + L] = _ebit(low, rng, probs[CTX_M + L], mb)
                if rng < _TOP:
                    low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
                left = L - 1
                while left > 0:
                    take = min(left, 8)
                    left -= take
                    low, rng = _edirect(low, rng, mag >> U64(left), take)
                    if rng < _TOP:
                        low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
        if pos > cap:
            return -ERR_OVERFLOW
    for _ in range(5):
        low, rng, cache, csize, pos = _shift_low(low, rng, cache, csize, pos, out)
    if pos > cap:
        return -ERR_OVERFLOW
    return np.int64(pos)


# --------------------------------------------------------------------------- decode
@njit(cache=True, nogil=True)
def decode_body(
    src: np.ndarray, n_changed: int, n_elems: int, n_buckets: int, width: int, transform: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Decode a body into per-bucket ranks and signed steps / xor masks.

    Returns ``(status, first, ranks, vals)``: ``first[e]`` is the offset of bucket
    ``e``'s run in ``ranks``/``vals`` (``-1`` when absent); each run ends with a
    sentinel rank ``-1`` that no element can match. ``status`` is ``0`` or a
    negative error code.
    """
    end = src.shape[0]
    first = np.full(n_buckets, -1, np.int64)
    ranks = np.full(1, -1, np.int64)
    vals = np.zeros(1, np.uint64)
    used, pos = _get_varint(src, 0, end)
    if pos < 0:
        return -ERR_TRUNCATED, first, ranks, vals
    if used > U64(n_buckets) or used > U64(n_changed) or (used == U64(0) and n_changed != 0):
        return -ERR_RANGE, first, ranks, vals
    nb = int(used)
    b_e = np.empty(nb, np.int64)
    b_n = np.empty(nb, np.int64)
    b_k = np.empty(nb, np.int64)
    b_all = np.empty(nb, np.bool_)
    seen = 0
    last_e = -1
    for j in range(nb):
        e, pos = _get_varint(src, pos, end)
        if pos < 0:
            return -ERR_TRUNCATED, first, ranks, vals
        c, pos = _get_varint(src, pos, end)
        if pos < 0 or pos >= end:
            return -ERR_TRUNCATED, first, ranks, vals
        flags = int(src[pos])
        pos += 1
        if int(e) <= last_e or e >= U64(n_buckets) or c == U64(0) or c > U64(n_changed - seen):
            return -ERR_RANGE, first, ranks, vals
        if (flags & 0x7F) > MAX_RICE_K:
            return -ERR_RANGE, first, ranks, vals
        last_e = int(e)
        b_e[j] = int(e)
        b_n[j] = int(c)
        b_k[j] = flags & 0x7F
        b_all[j] = (flags & 0x80) != 0
        seen += int(c)
    if seen != n_changed:
        return -ERR_RANGE, first, ranks, vals
    # One slot per change, a sentinel per run, and a shared sentinel at the end.
    ranks = np.full(n_changed + nb + 1, -1, np.int64)
    vals = np.zeros(n_changed + nb + 1, np.uint64)
    code, rng = U64(0), _M32
    for _ in range(5):
        code, _unused, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
    probs = np.full(N_CTX, _PROB_INIT, np.int64)
    wmask = _ALL64 >> U64(64 - width)
    half = U64(1) << U64(width - 1)
    # Reading past the end yields zero bytes; more than the 5 flush bytes'
    # worth of overrun means a truncated or corrupt stream.
    limit = end + 8
    out = 0
    for j in range(nb):
        first[b_e[j]] = out
        k = b_k[j]
        prev = -1
        for _ in range(b_n[j]):
            if b_all[j]:
                r = prev + 1
            else:
                q = 0
                while True:
                    c = CTX_Q + min(q, N_QCTX - 1)
                    code, rng, probs[c], bit = _dbit(code, rng, probs[c])
                    if rng < _TOP:
                        code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                    if bit == 0:
                        break
                    q += 1
                    if q > n_elems or pos > limit:
                        return -ERR_RANGE, first, ranks, vals
                if q > (n_elems >> k):  # no gap in the span is that long (and q << k stays in range)
                    return -ERR_RANGE, first, ranks, vals
                rem = U64(0)
                if k >= 1:
                    code, rng, probs[CTX_R + 1], b1 = _dbit(code, rng, probs[CTX_R + 1])
                    if rng < _TOP:
                        code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                    rem = U64(b1)
                if k >= 2:
                    c = CTX_R + 2 + b1
                    code, rng, probs[c], b2 = _dbit(code, rng, probs[c])
                    if rng < _TOP:
                        code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                    rem = (rem << U64(1)) | U64(b2)
                    left = k - 2
                    while left > 0:
                        take = min(left, 8)
                        left -= take
                        code, rng, d = _ddirect(code, rng, take)
                        if rng < _TOP:
                            code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                        rem = (rem << U64(take)) | d
                r = prev + 1 + ((q << k) | np.int64(rem))
            if r >= n_elems or r < 0:
                return -ERR_RANGE, first, ranks, vals
            prev = r
            neg = 0
            if transform == 2:
                code, rng, probs[CTX_SIGN], neg = _dbit(code, rng, probs[CTX_SIGN])
                if rng < _TOP:
                    code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
            L = 0
            while width - 1 > L:
                c = CTX_L + min(L, N_LCTX - 1)
                code, rng, probs[c], bit = _dbit(code, rng, probs[c])
                if rng < _TOP:
                    code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                if bit == 0:
                    break
                L += 1
            mag = U64(1)
            if L >= 1:
                code, rng, probs[CTX_M + L], mb = _dbit(code, rng, probs[CTX_M + L])
                if rng < _TOP:
                    code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                mag = (mag << U64(1)) | U64(mb)
                left = L - 1
                while left > 0:
                    take = min(left, 8)
                    left -= take
                    code, rng, d = _ddirect(code, rng, take)
                    if rng < _TOP:
                        code, rng, pos = _dnext(code, rng, pos, src[pos] if pos < end else 0)
                    mag = (mag << U64(take)) | d
            if pos > limit:
                return -ERR_TRUNCATED, first, ranks, vals
            if transform == 2:
                if mag > half or (neg == 0 and mag == half):
                    return -ERR_RANGE, first, ranks, vals
                v = ((U64(0) - mag) & wmask) if neg else mag
            else:
                v = mag & wmask
            ranks[out] = r
            vals[out] = v
            out += 1
        ranks[out] = -1  # sentinel closes the run
        out += 1
    if pos > end:  # every byte the encoder flushed is part of the body
        return -ERR_TRUNCATED, first, ranks, vals
    return 0, first, ranks[: out + 1], vals[: out + 1]


@njit(cache=True, nogil=True)
def _locate_start(first, ranks, n, nb):  # type: ignore[no-untyped-def]
    """`locate`'s state for a span of ``n`` elements: per bucket, where its run of decoded ranks is
    (``ptr``) and how many of its elements to pass before the next one (``left``; ``n``, which no
    count reaches, once its run is done). Absent buckets point at the shared sentinel slot."""
    ptr = np.empty(nb, np.int64)
    left = np.empty(nb, np.int64)
    sentinel = ranks.shape[0] - 1
    for e in range(nb):
        p = first[e] if first[e] >= 0 else sentinel
        ptr[e] = p
        left[e] = ranks[p] if ranks[p] >= 0 else n
    return ptr, left


@njit(cache=True, nogil=True)
def _locate_from(base, i, sh, mk, wmask, transform, ptr, left, ranks, vals, k, idx, new):  # type: ignore[no-untyped-def]
    """`locate` from element ``i`` with ``k`` found: the count found by the end, or ``-ERR_RANGE``.
    One table entry read and written per element (the same chain as `find_changes`')."""
    n = base.shape[0]
    cap = idx.shape[0]
    while i < n:
        b = base[i]
        e = np.int64((U64(b) >> sh) & mk)
        rest = left[e]
        if rest == 0:
            p = ptr[e]
            if k >= cap:
                return -ERR_RANGE
            v = vals[p]
            idx[k] = i
            new[k] = (U64(b) + v & wmask) if transform == 2 else (U64(b) ^ v)
            k += 1
            ptr[e] = p + 1
            nxt = ranks[p + 1]  # decode_body's runs are strictly increasing (it checks), closed by a -1
            left[e] = nxt - ranks[p] - 1 if nxt >= 0 else n
        else:
            left[e] = rest - 1
        i += 1
    return k


@njit(cache=True, nogil=True)
def locate(
    base: np.ndarray,
    shift: int,
    mask: int,
    first: np.ndarray,
    ranks: np.ndarray,
    vals: np.ndarray,
    n_changed: int,
    width: int,
    transform: int,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Scan the base and turn (bucket, rank, value) into (index, new bits).

    Returns ``(status, idx, new_bits)``; status ``-ERR_LEFTOVER`` means some
    decoded rank lies beyond its bucket in this base (wrong base or corrupt body).
    """
    ptr, left = _locate_start(first, ranks, base.shape[0], mask + 1)
    idx = np.empty(n_changed, np.int64)
    new = np.empty(n_changed, base.dtype)
    k = _locate_from(
        base, 0, U64(shift), U64(mask), _ALL64 >> U64(64 - width), transform, ptr, left, ranks, vals, 0, idx, new
    )
    return (k if k < 0 else (0 if k == n_changed else -ERR_LEFTOVER)), idx, new


@njit(cache=True, nogil=True)
def locate_pair(  # type: ignore[no-untyped-def]
    base_a, first_a, ranks_a, vals_a, n_a, base_b, first_b, ranks_b, vals_b, n_b, shift, mask, width, transform
):
    """`locate` of two spans of one dtype at once (their chains side by side: about 1.4x faster on one
    core, measured on 2 M-element spans): ``(status_a, idx_a, new_a, status_b, idx_b, new_b)``, each
    what `locate` returns for its span."""
    sh, mk, wmask = U64(shift), U64(mask), _ALL64 >> U64(64 - width)
    na, nb = base_a.shape[0], base_b.shape[0]
    pa, la = _locate_start(first_a, ranks_a, na, mask + 1)
    pb, lb = _locate_start(first_b, ranks_b, nb, mask + 1)
    ia, xa = np.empty(n_a, np.int64), np.empty(n_a, base_a.dtype)
    ib, xb = np.empty(n_b, np.int64), np.empty(n_b, base_b.dtype)
    ka = kb = 0
    n = min(na, nb)
    # The step is written out once per span on purpose: a shared helper (an @njit call LLVM does not
    # inline) measured 2x slower than this loop, and numba's own inlining of an array-taking helper
    # ref-counts at every call. Each half is `_locate_from`'s body.
    for i in range(n):
        b = base_a[i]
        e = np.int64((U64(b) >> sh) & mk)
        rest = la[e]
        if rest == 0:
            p = pa[e]
            if ka >= n_a:
                ka = -ERR_RANGE
                break
            v = vals_a[p]
            ia[ka] = i
            xa[ka] = (U64(b) + v & wmask) if transform == 2 else (U64(b) ^ v)
            ka += 1
            pa[e] = p + 1
            nxt = ranks_a[p + 1]
            la[e] = nxt - ranks_a[p] - 1 if nxt >= 0 else na
        else:
            la[e] = rest - 1
        b = base_b[i]
        e = np.int64((U64(b) >> sh) & mk)
        rest = lb[e]
        if rest == 0:
            p = pb[e]
            if kb >= n_b:
                kb = -ERR_RANGE
                break
            v = vals_b[p]
            ib[kb] = i
            xb[kb] = (U64(b) + v & wmask) if transform == 2 else (U64(b) ^ v)
            kb += 1
            pb[e] = p + 1
            nxt = ranks_b[p + 1]
            lb[e] = nxt - ranks_b[p] - 1 if nxt >= 0 else nb
        else:
            lb[e] = rest - 1
    if ka < 0 or kb < 0:  # a corrupt run (more matches than changes): each span alone says which
        sa, ia, xa = locate(base_a, shift, mask, first_a, ranks_a, vals_a, n_a, width, transform)
        sb, ib, xb = locate(base_b, shift, mask, first_b, ranks_b, vals_b, n_b, width, transform)
        return sa, ia, xa, sb, ib, xb
    ka = _locate_from(base_a, n, sh, mk, wmask, transform, pa, la, ranks_a, vals_a, ka, ia, xa)
    kb = _locate_from(base_b, n, sh, mk, wmask, transform, pb, lb, ranks_b, vals_b, kb, ib, xb)
    sa = ka if ka < 0 else (0 if ka == n_a else -ERR_LEFTOVER)
    sb = kb if kb < 0 else (0 if kb == n_b else -ERR_LEFTOVER)
    return sa, ia, xa, sb, ib, xb


@njit(cache=True, nogil=True)
def scatter(dst: np.ndarray, idx: np.ndarray, new: np.ndarray, old: np.ndarray) -> None:
    """``old[j] = dst[idx[j]]; dst[idx[j]] = new[j]`` (indices already checked)."""
    for j in range(idx.shape[0]):
        i = idx[j]
        old[j] = dst[i]
        dst[i] = new[j]


# --------------------------------------------------------------------------- sparse (positions as gaps)
# A SPARSE body (docs/delta-format.md §4.5) names its positions as LEB128 gaps and overwrites their
# values: O(changes) to apply, with no scan of the base, for about 4x a DELTA body's bytes.
@njit(cache=True, nogil=True)
def _scan_words(bw, tw, lanes, w, k, idx):  # type: ignore[no-untyped-def]
    """`changed_positions` over whole 64-bit words from word ``w``: a word compare skips ``lanes``
    equal elements at once; a differing word's lanes are tested in registers, stored without a
    branch. Stops at the end, or at a differing word whose lanes might not fit ``idx``."""
    nw = bw.shape[0]
    cap = idx.shape[0]
    bits = U64(64 // lanes)
    lane = (U64(1) << bits) - U64(1)
    while w < nw:
        d = bw[w] ^ tw[w]
        if d != U64(0):
            if k + lanes > cap:
                return w, k
            i = w * lanes
            for j in range(lanes):
                idx[k] = i + j
                k += np.int64(((d >> (bits * U64(j))) & lane) != U64(0))
        w += 1
    return w, k


@njit(cache=True, nogil=True)
def changed_positions(base: np.ndarray, target: np.ndarray, bw: np.ndarray, tw: np.ndarray) -> np.ndarray:
    """Ascending positions where the bits differ (no buckets, no ranks). ``bw``/``tw``: the leading
    whole 64-bit words of ``base``/``target`` viewed as ``uint64`` (`words`), or empty; the
    elements past them are compared one by one. The array starts at 1/16 of the span and doubles
    like `find_changes`'."""
    n = base.shape[0]
    lanes = 8 // base.itemsize
    nw = bw.shape[0]
    cap = min(n + lanes, max(1024, n >> 4))
    idx = np.empty(cap, np.int64)
    w, k = _scan_words(bw, tw, lanes, 0, 0, idx)
    while w < nw:
        cap = min(n + lanes, cap * 2)
        idx = _grow(idx, cap)
        w, k = _scan_words(bw, tw, lanes, w, k, idx)
    for i in range(nw * lanes, n):
        if base[i] != target[i]:
            if k == idx.shape[0]:
                idx = _grow(idx, min(n + lanes, 2 * k))
            idx[k] = i
            k += 1
    return idx[:k]


def words(a: np.ndarray) -> np.ndarray:
    """The leading whole 64-bit words of a flat contiguous bit array, as ``uint64`` (no copy), for
    `changed_positions`; empty for dtypes wider than 16 bits, where a word holds at most two
    elements and comparing them one by one measured faster, and on a big-endian host (the lanes
    of a word are its elements in order only on a little-endian one)."""
    if a.itemsize > 2 or sys.byteorder != "little":
        return np.empty(0, np.uint64)
    m = a.nbytes // 8 * 8 // a.itemsize
    return a[:m].view(np.uint64)


@njit(cache=True, nogil=True)
def encode_positions(idx: np.ndarray, out: np.ndarray) -> int:
    """Write ascending ``idx`` as LEB128 gaps (the first position, then each gap less one); returns
    the bytes written or ``-ERR_OVERFLOW``."""
    pos = 0
    prev = -1
    for j in range(idx.shape[0]):
        pos = _put_varint(out, pos, U64(idx[j] - prev - 1))
        prev = idx[j]
    return pos if pos <= out.shape[0] else -ERR_OVERFLOW


@njit(cache=True, nogil=True)
def decode_positions(src: np.ndarray, n_changed: int, n_elems: int) -> tuple[int, np.ndarray, int]:
    """Read ``n_changed`` gaps from ``src``: ``(status, idx, bytes read)``; every position is checked
    to lie in ``[0, n_elems)`` (so they are ascending and distinct by construction)."""
    end = src.shape[0]
    idx = np.empty(n_changed, np.int64)
    pos = 0
    prev = -1
    for j in range(n_changed):
        g, pos = _get_varint(src, pos, end)
        if pos < 0:
            return -ERR_TRUNCATED, idx, 0
        if g >= U64(n_elems - prev - 1):
            return -ERR_RANGE, idx, 0
        prev = prev + 1 + np.int64(g)
        idx[j] = prev
    return 0, idx, pos
