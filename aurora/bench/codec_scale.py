"""`aurora bench codec --scale`: the codec's cost at model sizes, next to memory and wire speed.

For each size (bf16 elements, in tensors of 16 M elements like a real checkpoint's
large matrices), two steps: ``uniform 1%`` (1 % of positions, uniform, stepped by
±1–2 ULP: the coder on its own) and ``AdamW lr 1e-6`` (fp32 masters ~N(0, 0.02)
moved by an Adam-sized update of ~lr each and cast to bf16 before and after, as a
trainer publishes: what changes depends on the exponent, at its own density). Each
step is coded both ways (CONDITIONED, the default, and SPARSE): encode and apply
(digests checked) GB/s of weights on one thread and on every core, a memory copy of
the same bytes in the same run, each side's ratio to the copy, (encode + apply)
against the delta's wire time at 100 Mbit/s and 1 Gbit/s, and the peak memory each
side needs beyond the weights it holds (heap in use, sampled while it runs), next to
the delta's bytes.

The weights are made slice by slice (no float32 copy of the whole set), so 1 G
elements need about 3 × 2 GB: base, target, and the receiver's working copy.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aurora.bench.codec import _best
from aurora.codec import Weights, apply_in_place, encode
from aurora.codec.encoder import Coding, Delta

TENSOR = 16 << 20
"""Elements per tensor."""
LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}


WORKLOADS = ("uniform 1%", "AdamW lr 1e-6")
"""The steps measured at each size (see the module docstring)."""
ADAM_LR = 1e-6


@dataclass
class ScaleRow:
    elements: int
    delta_bytes: int
    threads: int
    memcpy_gbps: float
    encode_gbps: float
    apply_gbps: float
    encode_gbps_all: float
    apply_gbps_all: float
    encode_peak_mb: float
    """Peak heap the encoder held beyond base and target (MB; the delta it returns included)."""
    apply_peak_mb: float
    """Peak heap the receiver held beyond its weights and the delta it was given (MB)."""
    workload: str = WORKLOADS[0]
    coding: str = "conditioned"
    density: float = 0.01

    def codec_over_wire(self, bits_per_s: float, all_threads: bool) -> float:
        enc, app = (self.encode_gbps_all, self.apply_gbps_all) if all_threads else (self.encode_gbps, self.apply_gbps)
        codec_s = self.elements * 2 / (enc * 1e9) + self.elements * 2 / (app * 1e9)
        return codec_s / (self.delta_bytes * 8 / bits_per_s)


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def _bf16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, as a trainer casts its masters (``tensor.to(torch.bfloat16)``)."""
    return torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _tensor_pairs(
    n: int, seed: int, make: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
) -> tuple[Weights, Weights]:
    """``n`` bf16 elements as a base and a target in tensors of `TENSOR` elements, each tensor's two bit
    arrays made by ``make(rng, size)`` (slice by slice: no float32 copy of the whole set)."""
    rng = np.random.default_rng(seed)
    base: dict[str, torch.Tensor] = {}
    target: dict[str, torch.Tensor] = {}
    for i, lo in enumerate(range(0, n, TENSOR)):
        b, t = make(rng, min(TENSOR, n - lo))
        name = f"layers.{i:04d}.weight"
        base[name], target[name] = _bf16(b), _bf16(t)
    return Weights.from_tensors(base), Weights.from_tensors(target)


def adam_pair(n: int, lr: float, seed: int) -> tuple[Weights, Weights]:
    """fp32 masters ~N(0, 0.02) and one Adam-like step of them (each moved by ``lr`` times a clipped
    N(0, 1): Adam's normalised update), both cast to bf16: a trainer's two versions. The density is
    the step's own (about 3 % at lr 1e-6)."""

    def make(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        master = rng.standard_normal(m, dtype=np.float32) * np.float32(0.02)
        update = np.clip(rng.standard_normal(m, dtype=np.float32), -3, 3) * np.float32(lr)
        return _bf16_bits(master), _bf16_bits(master - update)

    return _tensor_pairs(n, seed, make)


def step_pair(n: int, density: float, seed: int) -> tuple[Weights, Weights]:
    """bf16 N(0, 0.02) weights and a step that moves ``density`` of them by ±1–2 ULP, at uniform positions."""

    def make(rng: np.random.Generator, m: int) -> tuple[np.ndarray, np.ndarray]:
        f = rng.standard_normal(m, dtype=np.float32) * np.float32(0.02)
        b = (f.view(np.uint32) + np.uint32(0x8000) >> np.uint32(16)).astype(np.uint16)  # round to bf16 bits
        t = b.copy()
        pos = rng.choice(m, size=round(m * density), replace=False)
        steps = rng.choice(np.array([-2, -1, 1, 2], np.int32), size=pos.size, p=[0.1, 0.4, 0.4, 0.1])
        t[pos] = (t[pos].astype(np.int32) + steps).astype(np.uint16)
        return b, t

    return _tensor_pairs(n, seed, make)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: arenas plus mmapped blocks);
    numpy's arrays, Python's bytes and the numba kernels' arrays all come from it. None elsewhere."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def used() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)

    return used


def _peak_added_mb(f: Callable[[], object]) -> float:
    """Peak heap memory ``f`` holds beyond what was in use before it (MB), sampled every millisecond
    while it runs (NaN where glibc's mallinfo2 is missing)."""
    used = _heap_in_use()
    if used is None:
        return float("nan")
    before = used()
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, used())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        kept = f()  # what f returns is held too (an encoder's chunks) until sampled once more
        peak = max(peak, used())
        del kept
    finally:
        done.set()
        t.join()
    return max(0, peak - before) / 1e6


def scale_rows(n: int, workload: str, threads: int, reps: int) -> list[ScaleRow]:
    """One step of ``workload`` at ``n`` elements, coded each way (one row per coding)."""
    base, target = step_pair(n, 0.01, seed=n % 1000) if workload == WORKLOADS[0] else adam_pair(n, ADAM_LR, n % 997)
    base.tensor_digests()  # a publisher knows its base's digests already
    work = base.copy()
    names = list(base)
    gb = n * 2 / 1e9

    def copy_all(dst: Weights, src: Weights) -> None:
        for k in names:
            np.copyto(dst[k].bits, src[k].bits)

    rows = []
    for coding in Coding:
        d = encode(base, target, base_version=0, target_version=1, coding=coding)  # compiles, sizes the delta

        def enc(t: int, coding: Coding = coding) -> Callable[[], object]:
            def f() -> object:
                target.forget_digests()
                return encode(base, target, base_version=0, target_version=1, threads=t, coding=coding)

            return f

        def app(t: int, d: Delta = d) -> Callable[[], None]:
            def f() -> None:
                apply_in_place(work, d.manifest, d.chunks, threads=t)

            return f

        def timed_apply(t: int) -> float:
            best = float("inf")
            for _ in range(reps):
                copy_all(work, base)  # back to the base (not timed)
                work.forget_digests()
                t0 = time.perf_counter()
                app(t)()
                best = min(best, time.perf_counter() - t0)
            return best

        t_copy = _best(lambda: copy_all(work, base), reps)
        e1, ea = gb / _best(enc(1), reps), gb / _best(enc(threads), reps)
        a1, aa = gb / timed_apply(1), gb / timed_apply(threads)
        enc_peak = _peak_added_mb(enc(threads))
        copy_all(work, base)
        work.forget_digests()
        app_peak = _peak_added_mb(app(threads))
        copy_all(work, base)
        work.forget_digests()
        rows.append(
            ScaleRow(
                n,
                d.nbytes,
                threads,
                gb / t_copy,
                e1,
                a1,
                ea,
                aa,
                enc_peak,
                app_peak,
                workload,
                coding.value,
                d.stats.density,
            )
        )
    return rows


def run_scale(
    sizes: list[int],
    *,
    workloads: Sequence[str] = WORKLOADS,
    threads: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[ScaleRow]:
    torch.set_num_threads(1)
    threads = threads or len(os.sched_getaffinity(0))
    rows = []
    for n in sizes:
        for w in workloads:
            progress(f"{n / 2**20:.0f} M elements ({n * 2 / 1e9:.2f} GB of bf16), {w} ...")
            rows += scale_rows(n, w, threads, reps=1 if n >= 1 << 30 else 2)
    progress(format_scale(rows))
    progress("")
    span = min(16 << 20, max(sizes))
    progress(format_kernels(kernel_profile(span, density=0.01), span, 0.01))
    return rows


def format_scale(rows: list[ScaleRow]) -> str:
    t = rows[0].threads if rows else 1
    head = (
        f"{'elements':>9} {'workload':<14}{'density':>8} {'coding':<12}{'delta MB':>9}{'memcpy':>8}{'enc 1t':>8}"
        f"{'app 1t':>8}{'enc/cp':>8}{'app/cp':>8}{f'enc {t}t':>8}{f'app {t}t':>8}{'x1t':>6}"
        + "".join(f"{f'/wire {k}':>17}" for k in LINKS)
        + f"{'enc +MB':>9}{'app +MB':>9}"
    )
    lines = ["codec at scale, bf16; GB/s of weights", head, "-" * len(head)]
    for r in rows:
        speedup = (r.encode_gbps_all / r.encode_gbps + r.apply_gbps_all / r.apply_gbps) / 2
        wire = "".join(
            f"{r.codec_over_wire(bps, False):>8.1f}x/{r.codec_over_wire(bps, True):>6.1f}x" for bps in LINKS.values()
        )
        lines.append(
            f"{r.elements / 2**20:>8.0f}M {r.workload:<14}{r.density:>8.2%} {r.coding:<12}"
            f"{r.delta_bytes / 1e6:>9.2f}{r.memcpy_gbps:>8.2f}{r.encode_gbps:>8.2f}{r.apply_gbps:>8.2f}"
            f"{r.encode_gbps / r.memcpy_gbps:>8.2f}{r.apply_gbps / r.memcpy_gbps:>8.2f}"
            f"{r.encode_gbps_all:>8.2f}{r.apply_gbps_all:>8.2f}{speedup:>6.2f}{wire}"
            f"{r.encode_peak_mb:>9.0f}{r.apply_peak_mb:>9.0f}"
        )
    lines += [
        "workload: uniform 1% = 1 % of positions, uniform, +-1-2 ULP; AdamW lr 1e-6 = fp32 masters moved by an Adam-sized",
        "update and cast to bf16 (its own density). memcpy: a copy of the same weights in the same run (one thread);",
        f"enc/cp, app/cp: one thread's ratio to it; x1t: mean speed-up of {t} threads over one; /wire: (encode +",
        "apply) time over the delta's wire time, one thread / all threads; +MB: peak heap each side held beyond the",
        "weights (and the delta given to apply).",
    ]
    return "\n".join(lines)


@dataclass
class KernelRow:
    kernel: str
    seconds: float
    per_element_ns: float
    per_change_ns: float


def kernel_profile(n: int = 16 << 20, density: float = 0.01, reps: int = 3) -> list[KernelRow]:
    """Each codec kernel alone on one bf16 span of ``n`` elements (best of ``reps``): where an
    encode's and an apply's time goes."""
    from aurora.codec import kernels
    from aurora.codec.digest import tensor_digest
    from aurora.codec.dtypes import dtype_named

    base, target = step_pair(n, density, seed=3)
    b, t = next(iter(base.values())).bits, next(iter(target.values())).bits
    d = dtype_named("bfloat16")
    args = (d.exp_shift, d.exp_mask, d.width, 2)
    idx, rank, buck, step = kernels.find_changes(b, t, *args)
    out = np.empty(b.nbytes, np.uint8)

    def body_of(changes: tuple[np.ndarray, ...]) -> np.ndarray:
        _, r, e, s = changes
        return out[: kernels.encode_body(r, e, s, d.n_buckets, d.width, 2, out)].copy()

    body = body_of((idx, rank, buck, step))
    _, first, ranks, vals = kernels.decode_body(body, idx.size, b.size, d.n_buckets, d.width, 2)
    _, where, new = kernels.locate(b, d.exp_shift, d.exp_mask, first, ranks, vals, idx.size, d.width, 2)
    dst, old = b.copy(), np.empty_like(new)
    h = n // 2  # the span's halves as two spans, for the kernels that rank two at once
    pair = [kernels.find_changes(b[:h], t[:h], *args), kernels.find_changes(b[h:], t[h:], *args)]
    runs = [
        kernels.decode_body(body_of(r), r[0].size, m, d.n_buckets, d.width, 2)[1:]
        for r, m in zip(pair, (h, n - h), strict=True)
    ]
    steps: list[tuple[str, Callable[[], object]]] = [
        ("find_changes (scan, ranks)", lambda: kernels.find_changes(b, t, *args)),
        ("find_changes_pair (2 halves)", lambda: kernels.find_changes_pair(b[:h], t[:h], b[h:], t[h:], *args)),
        ("encode_body (range coder)", lambda: kernels.encode_body(rank, buck, step, d.n_buckets, d.width, 2, out)),
        ("decode_body (range decoder)", lambda: kernels.decode_body(body, idx.size, b.size, d.n_buckets, d.width, 2)),
        (
            "locate (scan, ranks)",
            lambda: kernels.locate(b, d.exp_shift, d.exp_mask, first, ranks, vals, idx.size, d.width, 2),
        ),
        (
            "locate_pair (2 halves)",
            lambda: kernels.locate_pair(
                b[:h], *runs[0], pair[0][0].size, b[h:], *runs[1], pair[1][0].size, d.exp_shift, d.exp_mask, d.width, 2
            ),
        ),
        ("scatter", lambda: kernels.scatter(dst, where, new, old)),
        ("digest (xxh3 of the span)", lambda: tensor_digest(t)),
    ]
    rows = []
    for name, f in steps:
        f()
        s = _best(f, reps)
        rows.append(KernelRow(name, s, s / n * 1e9, s / max(1, idx.size) * 1e9))
    return rows


def format_kernels(rows: list[KernelRow], n: int, density: float) -> str:
    lines = [
        f"kernels alone, one thread, one bf16 span of {n / 2**20:.0f} M elements at {density:.0%} (best of 3):",
        f"{'kernel':<30}{'ms':>8}{'ns/element':>12}{'ns/change':>11}",
    ]
    lines += [f"{r.kernel:<30}{r.seconds * 1e3:>8.1f}{r.per_element_ns:>12.2f}{r.per_change_ns:>11.0f}" for r in rows]
    return "\n".join(lines)
