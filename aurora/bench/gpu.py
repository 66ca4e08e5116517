"""`aurora bench gpu`: every GPU path of Aurora in one command, one table — for the day a GPU is lent.

Each check is a real run in a process of its own, with a time limit, on the GPUs this machine has:

1. **codec** — the codec's device path: ``aurora bench codec --scale --device cuda`` at 256M and 1G
   elements (its encode and apply speed, and whether its bytes are the CPU's).
2. **vllm** — vLLM with Aurora's weight-transfer backend on this machine's vLLM (upstream on a GPU
   machine): the engine tests (``tests/test_engine.py``, ``tests/test_engine_async.py``,
   ``tests/test_served_rollout.py``) on the tiny model — in-process, on a ``vllm serve``, and
   tensor-parallel where there are 2 GPUs.
3. **trainer** — the sharded GRPO learner on NCCL: ``aurora bench trainer`` on SmolLM2-135M with 1
   rank and, where there are 2 GPUs, 2 (one GPU per rank).
4. **rl** — a short RL run: ``aurora run`` of a trainer and one vLLM rollout on the tiny model.

Run it from a checkout (the vLLM check runs its tests). Where there is no CUDA device every row says
so and nothing is run. Budget: about 10 minutes on one H100 (the sum of the time limits is 10).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool | None
    """None: not run."""
    seconds: float
    figure: str
    """What it measured, or why it did not run or failed."""


def _run(argv: list[str], limit_s: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=limit_s, cwd=ROOT, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        return 124, f"over its {limit_s:g} s limit", time.monotonic() - t0
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _tail(out: str) -> str:
    lines = [x for x in out.strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def codec(tmp: Path, gpus: int) -> Check:
    path = tmp / "codec.json"
    argv = [sys.executable, "-m", "aurora", "bench", "codec", "--scale", "--sizes", "256M,1G", "--device", "cuda"]
    rc, out, dt = _run([*argv, "--json", str(path)], 150)
    if rc != 0:
        return Check("codec", False, dt, _tail(out))
    rows = json.loads(path.read_text())["device"]
    figure = "; ".join(
        f"{r['elements'] >> 20}M: encode {r['encode_gbps']:.1f} GB/s, apply {r['apply_gbps']:.1f} GB/s, "
        f"same bytes as CPU {'yes' if r['same_bytes'] else 'NO'}"
        for r in rows
    )
    return Check("codec", all(r["same_bytes"] for r in rows), dt, figure)


def vllm(tmp: Path, gpus: int) -> Check:
    tests = ["tests/test_engine.py", "tests/test_engine_async.py", "tests/test_served_rollout.py"]
    pick = "tiny or vllm" if gpus >= 2 else "(tiny or vllm) and not tp2"
    argv = [sys.executable, "-m", "pytest", *tests, "-q", "-m", "vllm", "-k", f"({pick}) and not smollm2"]
    rc, out, dt = _run(argv, 240)
    counts = re.findall(r"(\d+) (passed|failed|skipped|error)", out)
    return Check("vllm", rc == 0, dt, ", ".join(f"{n} {w}" for n, w in counts) or _tail(out))


def trainer(tmp: Path, gpus: int) -> Check:
    path = tmp / "trainer.json"
    ranks = "1,2" if gpus >= 2 else "1"
    rc, out, dt = _run([sys.executable, "-m", "aurora", "bench", "trainer", "--ranks", ranks, "--json", str(path)], 120)
    if rc != 0:
        return Check("trainer", False, dt, _tail(out))
    rows = json.loads(path.read_text())
    figure = "; ".join(
        f"{r['ranks']} rank(s): step {r['step_s']:.3f} s, version {r['make_version_s']:.3f} s, "
        f"state {r['peak_mem_bytes_per_rank'] / 2**20:.0f} MiB/rank"
        for r in rows
    )
    return Check("trainer", True, dt, figure + ("" if gpus >= 2 else " (1 GPU: NCCL between ranks not exercised)"))


RL = """name: gpu-check
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{port}"}}
  - {{name: rollout-1, role: rollout, region: local, parent: trainer}}
leases: {{ttl_s: 10.0, prompts_per_lease: 8, batch_s: 1.0}}
staleness: {{max_versions: 1}}
model: {{path: {tmp}/model, preset: tiny, seed: 0}}
task: {{kind: arithmetic, max_operand: 9}}
learner: {{kind: grpo, group_size: 8, prompts_per_step: 16, lr: 1.0e-3, warm_start_steps: 50}}
engine: {{kind: vllm, max_new_tokens: 5, temperature: 1.0}}
run: {{steps: 20}}
"""


def rl(tmp: Path, gpus: int) -> Check:
    topo = tmp / "rl.yaml"
    with socket.socket() as sock:  # a free port for the trainer
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    topo.write_text(RL.format(tmp=tmp, port=port))
    rc, out, dt = _run([sys.executable, "-m", "aurora", "run", str(topo), "--state", str(tmp / "rl")], 90)
    done = re.search(r"reward: .*", out)
    return Check("rl", rc == 0, dt, done.group(0)[:200] if done else _tail(out))


CHECKS: dict[str, Callable[[Path, int], Check]] = {"codec": codec, "vllm": vllm, "trainer": trainer, "rl": rl}


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bench(only: list[str] | None = None, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    gpus = gpu_count()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aurora-gpu-check-") as d:
        for name, check in CHECKS.items():
            if only and name not in only:
                continue
            if gpus == 0:
                rows.append(Check(name, None, 0.0, "not run: no CUDA device here"))
                continue
            progress(f"{name} ...")
            rows.append(check(Path(d), gpus))
    return {"gpus": gpus, "device": _device(), "checks": [asdict(r) for r in rows]}


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        return "no torch"


def render(r: dict[str, Any]) -> str:
    lines = [f"GPU check on {r['device']} ({r['gpus']} GPU(s))", "check    result   seconds  what"]
    for c in r["checks"]:
        res = "not run" if c["ok"] is None else ("ok" if c["ok"] else "FAILED")
        lines.append(f"{c['name']:<8} {res:<8} {c['seconds']:>7.1f}  {c['figure']}")
    return "\n".join(lines)
