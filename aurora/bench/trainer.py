"""`aurora bench trainer`: the GRPO learner on 1, 2, … ranks, side by side, on one model.

For each rank count a real job under torch's launcher (`aurora.bench.trainer_job`: gloo on CPUs,
NCCL on GPUs) takes the same RL steps on the same work; the CPUs are divided evenly among the ranks
(``OMP_NUM_THREADS``), so that a job of more ranks has no more compute than one of fewer. Reported
per rank count: the median step time and the median time to make a version (the version gathered
from the shards and cast to bf16, its delta against the one before encoded and its digest taken, as
the trainer's publisher does), both over the steps after the first; the bytes one rank holds of the
master weights, their gradients and the optimiser's state (counted tensor by tensor); rank 0's peak
resident memory (every buffer, activations and the interpreter included).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Row:
    ranks: int
    threads: int
    """CPU threads each rank computed with."""
    step_s: float
    make_version_s: float
    peak_mem_bytes_per_rank: int
    """Master weights + gradients + optimiser state one rank holds (rank 0's shards)."""
    peak_rss_bytes: int
    """Rank 0's peak resident memory."""
    delta_bytes: float
    changed: float
    """The fraction of elements a step changed (the published bf16 version's)."""
    cast_s: float
    encode_s: float
    digest_s: float


def job(ranks: int, model: Path, steps: int, prompts: int, group: int, threads: int, lr: float) -> dict[str, Any]:
    """One job's report (rank 0's): ``ranks`` ranks under torch's launcher, ``threads`` CPU threads each."""
    with tempfile.TemporaryDirectory(prefix="aurora-bench-trainer-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        argv += ["-m", "aurora.bench.trainer_job", "--model", str(model), "--report", str(report)]
        argv += ["--steps", str(steps), "--prompts", str(prompts), "--group", str(group), "--warm-start", "0"]
        argv += ["--lr", str(lr), "--max-positions", "512"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank job failed:\n{r.stderr[-3000:]}")
        return dict(json.loads(report.read_text()))


def bench(
    model: Path,
    ranks: Sequence[int],
    *,
    steps: int = 4,
    prompts: int = 8,
    group: int = 4,
    lr: float = 2e-5,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Row]:
    cpus = len(os.sched_getaffinity(0))
    rows = []
    for n in ranks:
        threads = max(1, cpus // n)
        progress(f"{n} rank(s), {threads} thread(s) each: {steps} steps of {prompts} prompts x {group} samples")
        rep = job(n, model, steps, prompts, group, threads, lr)
        later = rep["steps"][1:] or rep["steps"]
        rows.append(
            Row(
                ranks=n,
                threads=threads,
                step_s=statistics.median(s["step_s"] for s in later),
                make_version_s=statistics.median(s["make_version_s"] for s in later),
                peak_mem_bytes_per_rank=int(rep["state_bytes_rank0"]),
                peak_rss_bytes=int(rep["peak_rss_bytes_rank0"] or 0),
                delta_bytes=statistics.median(s["delta_bytes"] for s in later),
                changed=statistics.median(s["changed"] for s in later),
                cast_s=statistics.median(s["cast_s"] for s in later),
                encode_s=statistics.median(s["encode_s"] for s in later),
                digest_s=statistics.median(s["digest_s"] for s in later),
            )
        )
    return rows


def render(rows: Sequence[Row]) -> str:
    base = rows[0]
    lines = ["ranks  threads  step s   x      make version s  x      state MB/rank  x      rank-0 peak RSS MB"]
    lines += [
        (
            f"{r.ranks:>5}  {r.threads:>7}  {r.step_s:>7.3f}  {r.step_s / base.step_s:>5.2f}  "
            f"{r.make_version_s:>14.3f}  {r.make_version_s / base.make_version_s:>5.2f}  "
            f"{r.peak_mem_bytes_per_rank / 2**20:>13.1f}  {r.peak_mem_bytes_per_rank / base.peak_mem_bytes_per_rank:>5.2f}  "
            f"{r.peak_rss_bytes / 2**20:>18.0f}"
        )
        for r in rows
    ]
    lines += [
        f"{r.ranks} rank(s): making a version = gather + cast {r.cast_s:.3f} s, encode {r.encode_s:.3f} s, "
        f"digest {r.digest_s:.3f} s; delta {r.delta_bytes / 1e6:.2f} MB, {100 * r.changed:.2f} % changed"
        for r in rows
    ]
    lines.append(
        "x: against the first row. state: master weights + gradients + AdamW state one rank holds. "
        "make version: gather + bf16 cast on the learner, then encode + digest on rank 0."
    )
    return "\n".join(lines)


def to_json(rows: Sequence[Row]) -> str:
    """One object per rank count (``ranks``, ``step_s``, ``make_version_s``, ``peak_mem_bytes_per_rank``, ...)."""
    return json.dumps([asdict(r) for r in rows], indent=2)
