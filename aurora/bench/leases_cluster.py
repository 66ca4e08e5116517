"""`aurora bench leases --cluster`: how work divides among real rollout processes of two speeds.

The lease simulation (`aurora.bench.leases`) runs the work pool alone; this runs it for real: `aurora
run` of a generated topology on loopback — a trainer with the synthetic learner (a version per
``batch`` accepted results, each step taking ``step_s``), and two rollout processes whose synthetic
engines take ``token_s`` per token position of a batch (a rollout's own ``engine``: one at the base
time, one at ``ratio`` times it, or both at the base). A synthetic batch takes the same time whatever
its size, so a rollout's generation speed is in proportion to ``1 / token_s``: its *speed's share*.
Each rollout's *share* is its part of the results the trainer accepted (its ``result_accepted``
events, logged at debug level), after the first ``warmup`` versions.

Each case runs with a short learner step (generation sets the pace) and a long one (the learner
does). Minutes: each case is a cluster start and ``steps`` versions.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from aurora.events import RESULT_ACCEPTED
from aurora.logs import event_time, read_events
from aurora.run import run

BASE_TOKEN_S = 0.05
MAX_NEW_TOKENS = 8
STEP_S = (0.1, 1.5)
CASES = {"2 equal": (1.0, 1.0), "2x": (1.0, 2.0)}
"""Each rollout's ``token_s`` as a multiple of `BASE_TOKEN_S` (the first is the faster)."""


@dataclass(frozen=True)
class ClusterRow:
    case: str
    step_s: float
    shares: dict[str, float]
    speed: dict[str, float]
    accepted: int
    seconds: float

    @property
    def worst(self) -> float:
        return max(abs(self.shares[w] / self.speed[w] - 1) for w in self.shares)


def topology(token_s: dict[str, float], step_s: float, steps: int, port: int) -> dict[str, Any]:
    """The generated topology (two rollouts under the trainer, each with its own engine speed)."""
    engine = {"kind": "synthetic", "max_new_tokens": MAX_NEW_TOKENS, "token_s": BASE_TOKEN_S}
    nodes: list[dict[str, Any]] = [
        {"name": "trainer", "role": "trainer", "region": "local", "listen": f"tcp://127.0.0.1:{port}"}
    ]
    nodes += [
        {"name": w, "role": "rollout", "region": "local", "parent": "trainer", "engine": {**engine, "token_s": s}}
        for w, s in token_s.items()
    ]
    return {
        "name": "bench-leases",
        "regions": [{"name": "local"}],
        "nodes": nodes,
        "leases": {"ttl_s": 30.0, "prompts_per_lease": 4, "batch_s": 2.0},
        "staleness": {"max_versions": 1},
        "learner": {
            "kind": "synthetic",
            "params": 20_000,
            "tensors": 2,
            "density": 0.02,
            "samples_per_step": 4,
            "step_s": step_s,
        },
        "engine": engine,
        "run": {"steps": steps},
    }


def measure(state: Path, rollouts: list[str], warmup: int) -> tuple[dict[str, int], float]:
    """Each rollout's accepted results after version ``warmup``, and the seconds they span."""
    events = [e for e in read_events(state / "trainer.log") if e.get("event") == RESULT_ACCEPTED]
    counted = [e for e in events if int(e.get("current", 0)) >= warmup]
    got = {w: sum(1 for e in counted if e.get("worker") == w) for w in rollouts}
    times = [event_time(e) for e in counted]
    return got, (max(times) - min(times)) if times else 0.0


def bench(*, steps: int = 60, warmup: int = 5, port: int = 47300, progress: Any = print) -> list[ClusterRow]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="aurora-bench-leases-") as tmp:
        for case, (a, b) in CASES.items():
            token_s = {"rollout-a": a * BASE_TOKEN_S, "rollout-b": b * BASE_TOKEN_S}
            for step_s in STEP_S:
                name = f"{case.replace(' ', '-')}-{step_s}"
                f = Path(tmp) / f"{name}.yaml"
                f.write_text(yaml.safe_dump(topology(token_s, step_s, steps, port)))
                progress(f"-- {case}, learner step {step_s} s: {steps} versions")
                run(f, progress=lambda text, redraw=False: None, state=Path(tmp) / name, log_level="debug")
                got, seconds = measure(Path(tmp) / name, list(token_s), warmup)
                total = sum(got.values()) or 1
                fast = {w: 1 / s for w, s in token_s.items()}
                rows.append(
                    ClusterRow(
                        case,
                        step_s,
                        {w: n / total for w, n in got.items()},
                        {w: v / sum(fast.values()) for w, v in fast.items()},
                        sum(got.values()),
                        seconds,
                    )
                )
    return rows


def render(rows: list[ClusterRow]) -> str:
    lines = [
        "aurora bench leases --cluster: real rollout processes (synthetic engines) under the trainer, on loopback",
        f"{'workers':<8} {'learner s':>9} {'results':>8}  shares of the accepted results (speed's share)  worst gap",
    ]
    for r in rows:
        parts = "  ".join(f"{w} {r.shares[w]:.3f} ({r.speed[w]:.3f})" for w in r.shares)
        lines.append(f"{r.case:<8} {r.step_s:>9.1f} {r.accepted:>8}  {parts}  {100 * r.worst:.0f} %")
    return "\n".join(lines)
