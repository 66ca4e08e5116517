"""`aurora bench codec`: delta sizes against published designs, and codec throughput.

Prints, for each workload, bytes per changed element for (a) Aurora's format
(everything: manifest, chunk headers, bodies), (b) the published reference
design (LEB128 gaps + 2-byte values), (c) int32 positions + values, (d) the
blind entropy bound of the positions, plus the conditional bounds; then encode
and apply throughput next to a plain memory copy measured in the same run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from aurora.bench.refcoders import entropy_bounds, int32_bytes, leb128_bytes
from aurora.bench.weightgen import synthetic_pair, trained_versions
from aurora.codec import Weights, apply_in_place, encode
from aurora.codec.choice import CodecSpeed
from aurora.codec.encoder import Coding
from aurora.codec.format import HEADER_BYTES, pack_manifest
from aurora.store.atomic import write_bytes


@dataclass
class SizeRow:
    workload: str
    density: float
    changed: int
    ours: float
    ours_coded: float
    """ours without the fixed per-tensor costs (manifest rows, 80-byte chunk headers)."""
    leb128: float
    int32: float
    blind_entropy: float
    cond_entropy: float
    """positions | base exponent, plus values | exponent (empirical)."""
    ratio_vs_dense: float
    """dense bf16 bytes / our bytes."""
    sparse: float = 0.0
    """this format with SPARSE chunks (gaps and values), all-in."""


@dataclass
class SpeedRow:
    workload: str
    weight_bytes: int
    encode_gbps: float
    apply_gbps: float
    memcpy_gbps: float
    threads: int
    encode_gbps_threads: float
    apply_gbps_threads: float
    encode_gbps_sparse: float = 0.0
    apply_gbps_sparse: float = 0.0


def size_row(workload: str, b: Weights, t: Weights) -> SizeRow:
    d = encode(b, t, base_version=0, target_version=1)
    c = d.stats.changed
    ent = entropy_bounds(b, t)
    per = (lambda x: x / c) if c else (lambda x: 0.0)
    return SizeRow(
        workload=workload,
        density=d.stats.density,
        changed=c,
        ours=per(d.nbytes),
        ours_coded=per(d.nbytes - len(pack_manifest(d.manifest)) - HEADER_BYTES * len(d.chunks)),
        leb128=per(leb128_bytes(b, t)),
        int32=per(int32_bytes(b, t)),
        blind_entropy=per(ent["blind_positions"] / 8),
        cond_entropy=per((ent["cond_positions"] + ent["cond_values"]) / 8),
        ratio_vs_dense=t.nbytes / d.nbytes,
        sparse=per(encode(b, t, base_version=0, target_version=1, coding=Coding.SPARSE).nbytes),
    )


def _best(f: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def speed_row(workload: str, b: Weights, t: Weights, reps: int, threads: int) -> SpeedRow:
    nbytes = b.nbytes
    deltas = {c: encode(b, t, base_version=0, target_version=1, coding=c) for c in Coding}  # compiles the kernels
    b.tensor_digests()  # a publisher knows its base's digests already
    work = b.copy()
    src = b["w"].bits
    dst = np.empty_like(src)

    def enc(n: int, coding: Coding) -> Callable[[], None]:
        def f() -> None:
            t.forget_digests()
            encode(b, t, base_version=0, target_version=1, threads=n, coding=coding)

        return f

    def app(n: int, coding: Coding) -> Callable[[], None]:
        d = deltas[coding]

        def f() -> None:
            np.copyto(work["w"].bits, src)  # reset; its time (a memcpy) is subtracted below
            work.forget_digests()
            apply_in_place(work, d.manifest, d.chunks, threads=n)

        return f

    t_copy = _best(lambda: np.copyto(dst, src), reps)
    runs = [(1, Coding.CONDITIONED), (threads, Coding.CONDITIONED), (1, Coding.SPARSE)]
    gbps = [nbytes / _best(enc(n, c), reps) / 1e9 for n, c in runs]
    gbps_app = [nbytes / max(_best(app(n, c), reps) - t_copy, 1e-9) / 1e9 for n, c in runs]
    return SpeedRow(
        workload,
        nbytes,
        gbps[0],
        gbps_app[0],
        nbytes / t_copy / 1e9,
        threads,
        gbps[1],
        gbps_app[1],
        gbps[2],
        gbps_app[2],
    )


def coding_speed(speed: SpeedRow, at: SizeRow, itemsize: int = 2) -> CodecSpeed:
    """The rule's inputs (`aurora.codec.choice`) from this run: encode + apply seconds per element of
    each coding (one core), bytes per change of each on the workload ``at``."""
    return CodecSpeed(
        itemsize / 1e9 / speed.encode_gbps + itemsize / 1e9 / speed.apply_gbps,
        itemsize / 1e9 / speed.encode_gbps_sparse + itemsize / 1e9 / speed.apply_gbps_sparse,
        at.ours,
        at.sparse,
    )


def run(
    *, quick: bool = False, json_path: str | None = None, progress: Callable[[str], None] = print
) -> dict[str, object]:
    torch.set_num_threads(1)
    sizes: list[SizeRow] = []
    steps = 2 if quick else 4
    models = [(128, 4)] if quick else [(256, 4), (512, 8)]
    for dim, layers in models:
        for lr in (1e-6, 1e-5):
            vs = [Weights.from_tensors(v) for v in trained_versions(lr, steps, dim=dim, layers=layers)]
            params = sum(w.bits.size for w in vs[0].values())
            progress(
                f"trained a {params / 1e6:.1f}M-parameter transformer ({len(vs[0])} tensors) for {steps} "
                f"AdamW steps at lr {lr:g}"
            )
            sizes.extend(
                size_row(f"{params / 1e6:.0f}M lr={lr:g} step {i}", vs[i - 1], vs[i]) for i in range(1, len(vs))
            )
    n_syn = 1 << (20 if quick else 22)
    for dens in (0.001, 0.01, 0.1):
        b, t = synthetic_pair(n_syn, dens, seed=1)
        sizes.append(size_row(f"synthetic {dens:.1%}", Weights.from_tensors(b), Weights.from_tensors(t)))
    n_speed = 1 << (22 if quick else 26)
    progress(f"timing encode/apply on {n_speed * 2 / 2**20:.0f} MiB of bf16 weights at 1% density ...")
    b, t = synthetic_pair(n_speed, 0.01, seed=2)
    threads = max(1, min(4, os.cpu_count() or 1))
    speed = speed_row(
        f"synthetic {0.01:.1%}",
        Weights.from_tensors(b),
        Weights.from_tensors(t),
        reps=2 if quick else 3,
        threads=threads,
    )
    result: dict[str, object] = {"sizes": [asdict(r) for r in sizes], "speed": asdict(speed)}
    if json_path:
        write_bytes(Path(json_path), json.dumps(result, indent=2).encode())
    progress(format_tables(sizes, speed))
    return result


def format_tables(sizes: list[SizeRow], speed: SpeedRow) -> str:
    head = (
        f"{'workload':<24}{'density':>9}{'changed':>10}{'aurora':>9}{'(coded)':>9}{'sparse':>8}{'leb128':>9}"
        f"{'int32':>8}{'H(pos)':>9}{'H(.|exp)':>10}{'vs dense':>10}"
    )
    lines = ["bytes per changed element (all-in; lower is better)", head, "-" * len(head)]
    lines.extend(
        f"{r.workload:<24}{r.density:>9.3%}{r.changed:>10}{r.ours:>9.3f}{r.ours_coded:>9.3f}{r.sparse:>8.3f}"
        f"{r.leb128:>9.3f}{r.int32:>8.2f}{r.blind_entropy:>9.3f}{r.cond_entropy:>10.3f}{r.ratio_vs_dense:>9.0f}x"
        for r in sizes
    )
    at = next((r for r in sizes if r.workload == speed.workload), sizes[-1])
    rule = coding_speed(speed, at)
    lines += [
        "",
        "aurora = this format, all-in (conditioned coding); (coded) = without fixed per-tensor costs (manifest rows,",
        "chunk headers); sparse = this format with SPARSE chunks (gaps + values, O(changes) to apply), all-in;",
        "leb128 = published design (varint gaps + bf16 values); int32 = int32 positions + values;",
        "H(pos) = blind entropy bound of positions alone; H(.|exp) = positions and values given the base exponent.",
        "",
        f"throughput on {speed.weight_bytes / 2**20:.0f} MiB of weights, one core ({speed.workload}):",
        f"  encode {speed.encode_gbps:6.2f} GB/s   ({speed.encode_gbps / speed.memcpy_gbps:.2f}x of memcpy)",
        f"  apply  {speed.apply_gbps:6.2f} GB/s   ({speed.apply_gbps / speed.memcpy_gbps:.2f}x of memcpy; digests checked)",
        f"  memcpy {speed.memcpy_gbps:6.2f} GB/s",
        f"with {speed.threads} threads (chunks in parallel): encode {speed.encode_gbps_threads:.2f} GB/s, "
        f"apply {speed.apply_gbps_threads:.2f} GB/s",
        f"sparse coding, one core: encode {speed.encode_gbps_sparse:.2f} GB/s, apply {speed.apply_gbps_sparse:.2f} GB/s",
        "",
        f"the choice by link (sync.coding: auto) with these numbers: conditioned {rule.cond_s_per_element * 1e9:.2f} "
        f"ns/element and {rule.cond_bytes_per_change:.2f} B/change, sparse {rule.sparse_s_per_element * 1e9:.2f} ns/element",
        f"and {rule.sparse_bytes_per_change:.2f} B/change ({at.workload}); sparse is cheaper below a density of "
        + ", ".join(f"{_share(rule.threshold(mbit * 1e6 / 8))} at {mbit:g} Mbit/s" for mbit in (100, 1000, 10000)),
    ]
    return "\n".join(lines)


def _share(density: float) -> str:
    return "any (always)" if density >= 1 else f"{density:.2%}"
