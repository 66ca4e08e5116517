"""A seeded fault schedule for `aurora chaos`: which fault, on which node, at which version, for how long.

Faults (`Fault.kind`):

* ``kill`` — SIGKILL of a node's process group, restarted ``hold_s`` later (it resumes from its
  store: the trainer from its newest version and its result journal, any other node from its newest
  usable version, then catches up);
* ``partition`` — a silent partition between a node and its planned parent for ``hold_s``, then
  healed (`aurora.transport.faults`: SIGUSR1 twice);
* ``not_reading`` — a node stops reading from its parent for ``hold_s`` (SIGUSR2 twice).

The trainer is only ever killed (it has no parent). The first four faults are one of each: a kill
of the trainer, a kill, a partition and a stop of reading of other nodes (drawn); the rest are drawn
from every kind and node. Invariants: the same topology, step count, seed and fault count give the
same schedule; faults fire at versions in [2, steps − 2], in order, each on
one node (two faults on one node never overlap: the runner waits for the first to end).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from aurora.config.plan import Tree
from aurora.config.topology import Topology

KINDS = ("kill", "partition", "not_reading")


@dataclass(frozen=True, slots=True)
class Fault:
    at_version: int
    """Injected once the trainer has published this version."""
    kind: str
    node: str
    hold_s: float
    """How long it lasts: a killed node is restarted, a partition healed, reading resumed after it."""

    def describe(self) -> str:
        return f"v{self.at_version}: {self.kind} {self.node} for {self.hold_s:.1f} s"


def schedule(topo: Topology, tree: Tree, steps: int, seed: int, faults: int) -> list[Fault]:
    """``faults`` faults spread over a run of ``steps`` versions, drawn from ``seed``."""
    rng = random.Random(seed)
    names = [n.name for n in topo.nodes]
    children = [n for n in names if tree.parent[n] is not None]
    lo, hi = min(2, steps), max(min(2, steps), steps - 2)
    out = []
    first = rng.sample(children, min(len(KINDS), len(children)))  # one node each: none waits on another
    for k in range(faults):
        if k < len(first) + 1:  # every kind, and a kill of the trainer, come first
            kind = ("kill", *KINDS)[k]
            node = topo.trainer.name if k == 0 else first[k - 1]
        else:
            kind = rng.choice(KINDS) if children else "kill"
            node = rng.choice(names if kind == "kill" else children)
        hold_s = {"kill": rng.uniform(0.5, 4.0), "partition": rng.uniform(1.0, 10.0)}.get(kind, rng.uniform(1.0, 8.0))
        out.append(Fault(rng.randint(lo, hi), kind, node, round(hold_s, 1)))
    return sorted(out, key=lambda f: f.at_version)
