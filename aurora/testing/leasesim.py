"""A simulated coordinator and workers built from the real sans-IO machines.

`Coordinator` = `LeaseTable` + `PeerLiveness`; `Worker` = `LeaseHolder` +
`PeerLiveness` + a single-threaded job loop that takes ``work_s`` per item.
Both are `SimNode`s for `SimNetwork`; the stateful property tests and the
fault-schedule tests drive them. The coordinator keeps a log of every lease it
handed out and every result it accepted, so tests can check the invariants
against a reference model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aurora.protocol import (
    Heartbeat,
    Lease,
    LeaseHolder,
    LeaseTable,
    PeerLiveness,
    PeerLost,
    ResultAccepted,
    ResultRejected,
)

COORD = "coord"


@dataclass(frozen=True, slots=True)
class WorkRequest:
    incarnation: int


@dataclass(frozen=True, slots=True)
class Granted:
    leases: tuple[Lease, ...]


@dataclass(frozen=True, slots=True)
class Renew:
    tokens: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Renewed:
    leases: tuple[Lease, ...]


@dataclass(frozen=True, slots=True)
class Result:
    item: Any
    token: bytes


@dataclass(slots=True)
class CoordinatorLog:
    granted: list[tuple[float, Lease]] = field(default_factory=list)
    renewed: list[tuple[float, Lease]] = field(default_factory=list)
    accepted: list[ResultAccepted] = field(default_factory=list)
    rejected: list[ResultRejected] = field(default_factory=list)
    lost: list[tuple[float, PeerLost]] = field(default_factory=list)


class Coordinator:
    def __init__(self, items: list[Any], *, ttl_s: float = 5.0, hb_interval_s: float = 0.5,
                 suspect_after_s: float = 1.5, lost_after_s: float = 3.0, seed: int = 0) -> None:  # fmt: skip
        self.name = COORD
        self.table = LeaseTable(ttl_s=ttl_s, batch_s=2.0, max_batch=8)
        self.table.add_items(items)
        self.live = PeerLiveness(COORD, interval_s=hb_interval_s, jitter=0.2, suspect_after_s=suspect_after_s,
                                 lost_after_s=lost_after_s, seed=seed)  # fmt: skip
        self.log = CoordinatorLog()
        self._out: list[tuple[str, Any]] = []

    def handle(self, src: str, msg: Any, now: float) -> None:
        self.live.add_peer(src, now)
        if isinstance(msg, Heartbeat):
            self.live.on_heartbeat(msg, now)
        elif isinstance(msg, WorkRequest):
            leases = self.table.grant(src, now)
            self.log.granted += [(now, lease) for lease in leases]
            if leases:
                self._out.append((src, Granted(tuple(leases))))
        elif isinstance(msg, Renew):
            renewed = self.table.renew(src, msg.tokens, now)
            self.log.renewed += [(now, lease) for lease in renewed]
            if renewed:
                self._out.append((src, Renewed(tuple(renewed))))
        elif isinstance(msg, Result):
            self.table.complete(src, msg.item, msg.token, now)

    def tick(self, now: float) -> None:
        self.live.tick(now)
        for ev in self.live.events():
            if isinstance(ev, PeerLost):
                self.log.lost.append((now, ev))
                self.table.drop_worker(ev.peer)
        self.table.tick(now)
        for e in self.table.events():
            if isinstance(e, ResultAccepted):
                self.log.accepted.append(e)
            elif isinstance(e, ResultRejected):
                self.log.rejected.append(e)

    def next_deadline(self) -> float | None:
        ds = [d for d in (self.live.next_deadline(), self.table.next_deadline()) if d is not None]
        return min(ds, default=None)

    def outbox(self) -> list[tuple[str, Any]]:
        out = [(dst, hb) for dst, hb in self.live.messages_to_send()]
        out += self._out
        self._out = []
        return out


class Worker:
    def __init__(self, name: str, *, incarnation: int = 0, work_s: float = 0.2, request_every_s: float = 0.3,
                 hb_interval_s: float = 0.5, seed: int = 0) -> None:  # fmt: skip
        self.name = name
        self.incarnation = incarnation
        self.work_s = work_s
        self.request_every_s = request_every_s
        self.holder = LeaseHolder(name, renew_fraction=0.5)
        self.live = PeerLiveness(name, incarnation=incarnation, interval_s=hb_interval_s, jitter=0.2,
                                 suspect_after_s=1.5, lost_after_s=3.0, seed=seed)  # fmt: skip
        self.queue: deque[Any] = deque()
        self.current: tuple[Any, float] | None = None
        self.next_request = 0.0
        self.completed: list[Any] = []
        self._out: list[tuple[str, Any]] = []
        self._started = False

    def handle(self, src: str, msg: Any, now: float) -> None:
        if isinstance(msg, Heartbeat):
            self.live.on_heartbeat(msg, now)
        elif isinstance(msg, Granted):
            self.holder.on_granted(msg.leases, now)
            self.queue.extend(lease.item for lease in msg.leases)
        elif isinstance(msg, Renewed):
            self.holder.on_renewed(msg.leases, now)

    def tick(self, now: float) -> None:
        if not self._started:
            self.live.add_peer(COORD, now)
            self._started = True
        self.live.tick(now)
        self.live.events()
        self.holder.tick(now)
        self.holder.events()
        if self.current is not None and now >= self.current[1]:
            item = self.current[0]
            self.current = None
            lease = self.holder.take(item)
            if lease is not None:  # still ours: report it
                self.completed.append(item)
                self._out.append((COORD, Result(item, lease.token)))
        while self.current is None and self.queue:
            item = self.queue.popleft()
            if self.holder.lease(item) is not None:
                self.current = (item, now + self.work_s)
        tokens = self.holder.renewals_due(now)
        if tokens:
            self._out.append((COORD, Renew(tuple(tokens))))
        if not self.holder.items and now >= self.next_request:
            self._out.append((COORD, WorkRequest(self.incarnation)))
            self.next_request = now + self.request_every_s

    def next_deadline(self) -> float | None:
        ds = [
            self.live.next_deadline(),
            self.holder.next_deadline(),
            self.next_request if not self.holder.items else None,
        ]
        if self.current is not None:
            ds.append(self.current[1])
        return min((d for d in ds if d is not None), default=None)

    def outbox(self) -> list[tuple[str, Any]]:
        out = [(dst, hb) for dst, hb in self.live.messages_to_send()]
        out += self._out
        self._out = []
        return out
