"""`SimNetwork`: a seeded discrete-event network with a virtual clock.

It runs N endpoints of sans-IO machines (anything with `handle`, `tick`,
`next_deadline` and an outbox) and carries their messages under a fault
schedule: per-link partitions, crashed nodes, random drop, duplication, and
delay with jitter (which reorders). All randomness comes from one
`random.Random(seed)` and events are ordered by (time, sequence number), so a
run with the same seed and the same calls replays exactly.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class SimNode(Protocol):
    """A sans-IO endpoint the simulator drives."""

    name: str

    def handle(self, src: str, msg: Any, now: float) -> None: ...

    def tick(self, now: float) -> None: ...

    def next_deadline(self) -> float | None: ...

    def outbox(self) -> list[tuple[str, Any]]:
        """Drain (destination, message) pairs to send."""
        ...


@dataclass(slots=True)
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    delay_s: float = 0.01
    jitter_s: float = 0.0
    partitions: set[frozenset[str]] = field(default_factory=set)
    crashed: set[str] = field(default_factory=set)

    def cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.partitions or a in self.crashed or b in self.crashed


@dataclass(order=True, slots=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    dst: str = field(compare=False)
    src: str = field(compare=False, default="")
    msg: Any = field(compare=False, default=None)


class SimNetwork:
    def __init__(self, seed: int = 0, faults: Faults | None = None) -> None:
        self.rng = random.Random(seed)
        self.faults = faults or Faults()
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self._q: list[_Event] = []
        self._seq = itertools.count()
        self._timer: dict[str, float] = {}
        self.on_drop: Callable[[str, str, Any], None] | None = None
        """Called for every message lost to a fault (for test bookkeeping)."""
        self.delivered = 0
        self.dropped = 0

    def add(self, node: SimNode) -> None:
        self.nodes[node.name] = node
        self._flush(node)

    def replace(self, node: SimNode) -> None:
        """Swap in a fresh incarnation (a restart after a crash)."""
        self.nodes[node.name] = node
        self._timer.pop(node.name, None)
        self._flush(node)

    def _push(self, at: float, kind: str, dst: str, src: str = "", msg: Any = None) -> None:
        heapq.heappush(self._q, _Event(at, next(self._seq), kind, dst, src, msg))

    def send(self, src: str, dst: str, msg: Any) -> None:
        f = self.faults
        if f.cut(src, dst) or self.rng.random() < f.drop:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(src, dst, msg)
            return
        copies = 2 if self.rng.random() < f.duplicate else 1
        for _ in range(copies):
            delay = f.delay_s + (self.rng.uniform(0, f.jitter_s) if f.jitter_s else 0.0)
            self._push(self.now + delay, "msg", dst, src, msg)

    def _flush(self, node: SimNode) -> None:
        if node.name in self.faults.crashed:
            node.outbox()
            return
        for dst, msg in node.outbox():
            self.send(node.name, dst, msg)
        dl = node.next_deadline()
        if dl is not None:
            at = max(dl, self.now)
            if self._timer.get(node.name) != at:
                self._timer[node.name] = at
                self._push(at, "tick", node.name)

    def run_until(self, t: float) -> None:
        """Process every event up to time ``t`` in order, then set the clock to ``t``."""
        while self._q and self._q[0].at <= t:
            ev = heapq.heappop(self._q)
            self.now = max(self.now, ev.at)
            node = self.nodes.get(ev.dst)
            if node is None or ev.dst in self.faults.crashed:
                continue
            if ev.kind == "msg":
                if self.faults.cut(ev.src, ev.dst):  # cut while in flight
                    self.dropped += 1
                    if self.on_drop is not None:
                        self.on_drop(ev.src, ev.dst, ev.msg)
                    continue
                self.delivered += 1
                node.handle(ev.src, ev.msg, self.now)
            else:
                if self._timer.get(ev.dst) != ev.at:
                    continue  # superseded timer
                self._timer.pop(ev.dst, None)
            node.tick(self.now)
            self._flush(node)
        self.now = max(self.now, t)
        for node in list(self.nodes.values()):
            if node.name not in self.faults.crashed:
                node.tick(self.now)
                self._flush(node)

    def advance(self, dt: float) -> None:
        self.run_until(self.now + dt)
