"""`aurora bench leases`: how the shipped work pool divides work among rollout workers.

The lease simulation (`aurora.testing.leasesim`: the shipped `WorkPool` as the coordinator drives
it, a learner, and model workers exchanging the real work messages on a simulated network) runs
the main job's leasing — leases of 4 prompts, a learner batch of 4, 2 batches ahead, one-step
asynchronous, 30 s TTL — for ``seconds`` of simulated time, for equal workers and for a worker
twice as fast as the other, with a learner step of 0.2 s (generation is the bottleneck), 2 s and
7 s (the learner is; the main job's is about 7 s here), and workers whose batch takes the same
time whatever its size (vLLM, the synthetic engine) or a time per prompt. It prints each worker's
share of the accepted results next to its share of the generation speed, the part of the results
it returned that were refused as too stale, the learner's steps, and the worst gap (the largest
|share / speed's share − 1|).
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora.protocol.workpool import PoolSettings
from aurora.testing.leasesim import ContinuousSimWorker, SimTrainer, SimWorker
from aurora.testing.simnet import Faults, SimNetwork

CASES = {"2 equal": {"a": 1.0, "b": 1.0}, "2x": {"fast": 0.5, "slow": 1.0}, "3 equal": {"a": 1.0, "b": 1.0, "c": 1.0}}
"""Seconds a worker's batch (or prompt) takes."""
TRAIN_S = (0.2, 2.0, 7.0)
ENGINES = ("batched", "per-prompt", "continuous")
"""A batch takes a worker's time whatever its size (the synthetic engine, vLLM's offline one); or its
time per prompt; or each prompt is a request of its own taking that time, up to a lease's worth at once
(vLLM's async engine: `aurora.testing.leasesim.ContinuousSimWorker`)."""


@dataclass(frozen=True)
class Row:
    case: str
    train_s: float
    engine: str
    """`ENGINES`: how a worker's time grows with its prompts."""
    shares: dict[str, float]
    speed: dict[str, float]
    steps: int
    stale: dict[str, float]
    """Each worker's results refused as too stale, as a fraction of all it returned."""

    @property
    def worst(self) -> float:
        """The largest relative gap between a worker's share and its speed's share."""
        return max(abs(self.shares[w] / self.speed[w] - 1) for w in self.shares)


def simulate(work_s: dict[str, float], train_s: float, engine: str, seconds: float, seed: int = 0) -> Row:
    net = SimNetwork(seed=seed, faults=Faults(delay_s=0.01, jitter_s=0.02))
    pool = PoolSettings(ttl_s=30.0, prompts_per_lease=4, batch_s=2.0, ahead_steps=2, max_stale=1)
    trainer = SimTrainer(pool, batch=4, steps=10**9, children=list(work_s), train_s=train_s)
    net.add(trainer)
    for w, s in work_s.items():
        if engine == "continuous":
            net.add(ContinuousSimWorker(w, work_s=s, prompts_per_lease=4))
        else:
            net.add(SimWorker(w, work_s=s, prompts_per_lease=4, batched=engine == "batched"))
    net.advance(seconds)
    done = [a.worker for a in trainer.log.accepted]
    refused = [w for _, w, r in trainer.log.rejected if r.kind == "stale"]
    returned = {w: done.count(w) + sum(1 for _, x, _ in trainer.log.rejected if x == w) for w in work_s}
    fast = {w: 1 / s for w, s in work_s.items()}
    return Row(
        "",
        train_s,
        engine,
        {w: done.count(w) / max(1, len(done)) for w in work_s},
        {w: v / sum(fast.values()) for w, v in fast.items()},
        len(trainer.log.taken),
        {w: refused.count(w) / max(1, returned[w]) for w in work_s},
    )


def bench(seconds: float = 600.0, seed: int = 0) -> list[Row]:
    rows = []
    for case, work_s in CASES.items():
        for train_s in TRAIN_S:
            for engine in ENGINES:
                r = simulate(work_s, train_s, engine, seconds, seed)
                rows.append(Row(case, r.train_s, r.engine, r.shares, r.speed, r.steps, r.stale))
    return rows


def render(rows: list[Row], seconds: float) -> str:
    lines = [
        f"aurora bench leases: the shipped WorkPool in the lease simulation, {seconds:.0f} s simulated each",
        f"{'workers':<8} {'learner s':>9} {'engine':>10} {'steps':>6}  shares of the results (speed's share) "
        "[returned too stale]  worst gap",
    ]
    for r in rows:
        parts = "  ".join(
            f"{w} {r.shares[w]:.3f} ({r.speed[w]:.3f})" + (f" [{100 * r.stale[w]:.0f} %]" if r.stale[w] else "")
            for w in r.shares
        )
        lines.append(f"{r.case:<8} {r.train_s:>9.1f} {r.engine:>10} {r.steps:>6}  {parts}  {100 * r.worst:.0f} %")
    return "\n".join(lines)
