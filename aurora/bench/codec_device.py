"""`aurora bench codec --scale --device cuda`: the device path's speed next to a copy on that device.

For each size: the bf16 pair of `codec_scale.step_pair` moved to the device; a
device-to-device copy of the weights (torch ``copy_``, the memory-speed yardstick);
the device's own passes alone (`device.find_changes` over every tensor); a whole
`encode_on_device` (passes, range coder on the host's threads, and the host digests
of base and target read back); a whole `apply_on_device` into a copy of the base
(decode on the host, locate and scatter on the device, the target digests read
back). The first size also checks that the device path's chunks are the CPU path's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aurora.bench.codec import _best
from aurora.bench.codec_scale import step_pair
from aurora.codec import Transform, encode
from aurora.codec.device import apply_on_device, encode_on_device, find_changes


@dataclass
class DeviceRow:
    elements: int
    device: str
    delta_bytes: int
    copy_gbps: float
    find_gbps: float
    encode_gbps: float
    apply_gbps: float
    same_bytes: bool | None


def _timed(f: Callable[[], object], sync: Callable[[], None], reps: int) -> float:
    """`_best` of ``f`` with the device's queued work finished before and inside each timing."""

    def run() -> None:
        f()
        sync()

    sync()
    return _best(run, reps)


def device_row(n: int, device: str, *, density: float, threads: int, reps: int, check: bool) -> DeviceRow:
    base, target = step_pair(n, density, seed=n % 1000)
    dev = torch.device(device)
    b = {k: t.to(dev) for k, t in base.to_tensors().items()}
    t = {k: x.to(dev) for k, x in target.to_tensors().items()}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gb = sum(x.numel() * x.element_size() for x in b.values()) / 1e9
    scratch = {k: torch.empty_like(x) for k, x in b.items()}

    def copy() -> None:
        for k, x in b.items():
            scratch[k].copy_(x)

    def find() -> None:
        for k in b:
            for _ in find_changes(b[k], t[k], base[k].dtype, Transform.SUB):
                pass

    def enc() -> object:
        return encode_on_device(b, t, base_version=0, target_version=1, threads=threads)

    delta = encode_on_device(b, t, base_version=0, target_version=1, threads=threads)
    same = encode(base, target, base_version=0, target_version=1).chunks == delta.chunks if check else None

    def app() -> None:
        for k, x in b.items():
            scratch[k].copy_(x)
        apply_on_device(scratch, delta.manifest, delta.chunks, base_checked=True, threads=threads)

    reset = _timed(copy, sync, reps)
    return DeviceRow(
        elements=n,
        device=str(dev),
        delta_bytes=delta.nbytes,
        copy_gbps=gb / reset,
        find_gbps=gb / _timed(find, sync, reps),
        encode_gbps=gb / _timed(enc, sync, reps),
        apply_gbps=gb / max(1e-9, _timed(app, sync, reps) - reset),  # less the copy that resets the base
        same_bytes=same,
    )


def run_device(
    sizes: list[int], device: str, *, density: float = 0.01, threads: int = 1, progress: Callable[[str], None] = print
) -> list[DeviceRow]:
    rows = []
    for i, n in enumerate(sizes):
        progress(f"{n / 2**20:.0f} M elements on {device} at {density:.0%} ...")
        rows.append(device_row(n, device, density=density, threads=threads, reps=2, check=i == 0))
    progress(format_device(rows, density, threads))
    return rows


def format_device(rows: list[DeviceRow], density: float, threads: int) -> str:
    lines = [
        f"codec device path: bf16, {density:.0%} of positions stepped by ±1–2 ULP; GB/s of weights; "
        f"range coder on {threads} host thread(s)",
        f"{'elements':>9}{'device':>8}{'delta MB':>10}{'copy':>8}{'passes':>8}{'encode':>8}{'apply':>8}"
        f"{'enc/cp':>8}{'app/cp':>8}  same bytes as CPU",
    ]
    for r in rows:
        same = "-" if r.same_bytes is None else ("yes" if r.same_bytes else "NO")
        lines.append(
            f"{r.elements / 2**20:>8.0f}M{r.device:>8}{r.delta_bytes / 1e6:>10.2f}{r.copy_gbps:>8.1f}"
            f"{r.find_gbps:>8.2f}{r.encode_gbps:>8.2f}{r.apply_gbps:>8.2f}{r.encode_gbps / r.copy_gbps:>8.3f}"
            f"{r.apply_gbps / r.copy_gbps:>8.3f}  {same}"
        )
    lines.append(
        "copy: torch copy_ on the device; passes: the device's scans alone; encode/apply: whole, with the "
        "host digests read back"
    )
    return "\n".join(lines)
