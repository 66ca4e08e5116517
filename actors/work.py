"""Work out, results back: the trainer's coordinator and the rollout worker.

Work messages travel the same channels as the weight versions. Upward (from a
worker towards the trainer; relays forward them to their parent unchanged):

* ``want`` {w, n, v} — the worker can take up to n prompts, generating with version v;
* ``renew`` {w, tokens} — keep these leases alive;
* ``result`` {w, item, token, v} + a `Completion` (its wire form) — the prompt's group
  of samples, generated with version v.

Downward (the coordinator's answers; each relay routes them to the child that
the worker's messages came from, `Routes`):

* ``grant`` {w, n, leases: [[item, token, ttl_s, text], ...]} — n samples per prompt;
* ``renewed`` {w, leases: [[item, token, ttl_s], ...]};
* ``verdict`` {w, item, ok, reason}.

Invariants (the coordinator, `WorkPool`):

* a result is accepted at most once per prompt, only under its current lease
  (`LeaseTable`), only with the group size asked for, and only if its version
  is within ``max_stale`` of the trainer's current version; a too-stale result
  gives its prompt back to the pool to be generated again with newer weights;
* the learner takes accepted results oldest first, and never one that has become
  more than ``max_stale`` versions older than the version it trains from;
* prompts' answers stay in the pool (rewards are the trainer's to compute).
* work is leased for what the learner will train on, not for rollouts that would go
  stale in the pool: with a learner batch of B prompts, leased plus accepted-but-not-
  taken prompts stay within ``leases.ahead_steps`` × B, and a worker on version u gets
  work only while the learner's takes that may still use u's results (its next one up
  to u + ``max_stale``) want more than the results, accepted or in flight, of versions
  up to u that they would take first. A ``want`` refused for either reason is parked
  and answered when room opens (a batch taken, a lease ended); the worker asks again
  with its new version once it has switched.
* a worker that goes silent stops renewing; its leases expire and their
  prompts go to other workers; its late results are rejected (fenced).

The worker (`Worker`) switches its engine to the newest committed version only
between batches (`Engine.apply` with the tensors changed since its version), so
every completion is labelled with the weights that produced it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
from aurora.actors.flow import VersionFlow
from aurora.transport.base import Message

from aurora.config.topology import LeaseSpec
from aurora.errors import ActorDead, TransportClosed
from aurora.protocol.leases import Lease, LeaseExpired, LeaseHolder, LeaseTable, ResultRejected
from aurora.rl.engines import Engine, WeightUpdate
from aurora.rl.types import Completion, Prompt
from aurora.runtime import Actor

log = structlog.get_logger("aurora.actors.work")

UP = frozenset({"want", "renew", "result"})
DOWN = frozenset({"grant", "renewed", "verdict"})

Send = Callable[[Mapping[str, Any], tuple[bytes | memoryview, ...]], Awaitable[bool]]
"""Send a header and buffers one hop; False when there is nobody to send to right now."""


# ---------------------------------------------------------------- trainer side
@dataclass
class WorkPool:
    """The coordinator's state: prompts, leases, accepted samples. Outlives actor restarts."""

    leases: LeaseSpec
    max_stale: int
    prompts: Iterator[Prompt]
    group_size: int = 1
    batch: int = 0
    """The learner's prompts per step (0: it does not take batches; leasing is not bounded)."""
    steps: int | None = None
    """The run's versions: the learner's last take is at ``steps - 1`` (None: no end)."""
    table: LeaseTable = field(init=False)
    open: dict[int, Prompt] = field(default_factory=dict)
    samples: list[tuple[Prompt, Completion]] = field(default_factory=list)
    accepted: int = 0
    dropped_stale: int = 0
    """Accepted results that grew too stale before the learner took them."""
    rejected: Counter[str] = field(default_factory=Counter)
    log: deque[tuple[int, str, int, int]] = field(default_factory=lambda: deque(maxlen=100_000))
    """Recent acceptances: (prompt id, worker, result's version, trainer's version then)."""
    made_with: dict[int, int | None] = field(default_factory=dict)
    """Per leased prompt, the version its worker said it generates with (stale entries, of
    prompts no longer in flight, are pruned as they are met)."""
    taken_at: int | None = None
    """The learner's version at its last take (its next take is at the next version); None
    before the first take of this coordinator."""
    parked: dict[str, tuple[int, int | None, float]] = field(default_factory=dict)
    """Workers whose ``want`` got nothing: worker -> (prompts asked for, their version, when). An idle
    worker asks again every few seconds, so a want older than half a lease TTL is from one gone."""
    _more: asyncio.Event = field(default_factory=asyncio.Event)
    _room: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        # tokens start from the clock (µs, with room for 4096 grants per µs), so a restarted
        # coordinator never reissues a token that a worker may still hold from before
        self.table = LeaseTable(ttl_s=self.leases.ttl_s, max_batch=self.leases.prompts_per_lease,
                                batch_s=self.leases.batch_s, first_token=(time.time_ns() // 1000) << 12)  # fmt: skip

    def room(self) -> int | None:
        """Prompts that may still be leased under the ``ahead_steps`` bound (None: unbounded)."""
        if not self.batch or not self.leases.ahead_steps:
            return None
        return max(0, self.leases.ahead_steps * self.batch - self.table.in_flight - len(self.samples))

    def _useful(self, version: int | None, current: int) -> bool:
        """Would results of ``version`` be trained on? The takes that may use them run from the
        learner's next one to ``version + max_stale`` (or its last, at ``steps - 1``); they are
        useful while those takes want more than the results that they would take first (`take`
        goes oldest version first): those accepted or in flight, made with this version or an
        older one still allowed."""
        if not self.batch or version is None:
            return True
        # the learner takes once per version: next at the version after its last take (it may
        # already be training on that take while the version before is still being published)
        first = current if self.taken_at is None else max(current, self.taken_at + 1)
        last = version + self.max_stale if self.steps is None else min(version + self.max_stale, self.steps - 1)
        takes = last - first + 1
        if takes <= 0:
            return False
        supply = sum(1 for v in self._supply(current) if first - self.max_stale <= v <= version)
        return supply < takes * self.batch

    def _supply(self, current: int) -> Iterator[int]:
        """The versions of the results the learner will be offered: accepted ones, then those in
        flight (a worker that named no version counts as on ``current``)."""
        for _, c in self.samples:
            yield c.version
        for item, v in list(self.made_with.items()):
            if self.table.current(item) is None:
                del self.made_with[item]
            else:
                yield current if v is None else v

    def want(self, worker: str, n: int, now: float, version: int | None = None,
             current: int = 0) -> list[tuple[Lease, Prompt]]:  # fmt: skip
        """Grant up to ``n`` prompts to a worker generating with ``version`` while the trainer is
        at ``current``; a want that gets nothing is parked until `unpark`."""
        asked = max(0, min(n, self.leases.prompts_per_lease))
        room = self.room()
        n = asked if room is None else min(asked, room)
        if not self._useful(version, current):
            n = 0
        self.parked.pop(worker, None)
        if n == 0:
            if asked:
                self.parked[worker] = (asked, version, now)
            return []
        while self.table.pending < n:  # the pool is endless: top it up on demand
            p = next(self.prompts)
            self.open[p.id] = p
            self.table.add_items([p.id])
        granted = self.table.grant(worker, now, n)
        if self.batch:  # only `_useful` reads it (and prunes it as it does)
            for lease in granted:
                self.made_with[cast(int, lease.item)] = version
        return [(lease, self.open[cast(int, lease.item)]) for lease in granted]

    def unpark(self, now: float, current: int = 0) -> dict[str, list[tuple[Lease, Prompt]]]:
        """Grant parked wants where there is room for them now, oldest first."""
        out = {}
        for worker, (n, version, since) in list(self.parked.items()):
            if now - since > max(2.0, self.leases.ttl_s / 2):
                del self.parked[worker]  # its worker stopped asking: do not lease to it
                continue
            if self.room() == 0:
                break
            granted = self.want(worker, n, now, version, current)
            if granted:
                out[worker] = granted
        return out

    async def wait_room(self, timeout_s: float) -> None:
        """Until a batch was taken (room may have opened) or ``timeout_s`` passed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._room.wait()
        except TimeoutError:
            pass
        self._room.clear()

    def renew(self, worker: str, tokens: list[int], now: float) -> list[Lease]:
        return self.table.renew(worker, tokens, now)

    def result(self, worker: str, item: int, token: int, version: int, current: int, c: Completion,
               now: float) -> str | None:  # fmt: skip
        """Offer a result; None if accepted, else why not."""
        if c.prompt_id != item or c.version != version or len(c.samples) != self.group_size:
            self.rejected["malformed"] += 1
            return (f"malformed: a result for prompt {c.prompt_id} with {len(c.samples)} samples of version "
                    f"{c.version} (expected prompt {item}, {self.group_size} samples, version {version})")  # fmt: skip
        if current - version > self.max_stale and self.table.release(worker, item, token, now):
            self.rejected["stale"] += 1
            return f"stale: made with version {version}, the trainer is at {current} (bound {self.max_stale})"
        if not self.table.complete(worker, item, token, now):
            reason = next(e.reason for e in reversed(self._events()) if isinstance(e, ResultRejected))
            self.rejected[reason] += 1
            return reason
        prompt = self.open.pop(item, None) or Prompt(item, "")
        self.log.append((item, worker, version, current))
        self.samples.append((prompt, c))
        self.accepted += 1
        self._more.set()
        return None

    def expire(self, now: float) -> None:
        self.table.tick(now)
        self._events()

    def _events(self) -> list[Any]:
        evs = self.table.events()
        for e in evs:
            if isinstance(e, LeaseExpired):
                log.info("lease_expired", worker=e.lease.worker, item=e.lease.item, token=e.lease.token)
        return evs

    async def take(self, n: int, current: int = 0) -> list[tuple[Prompt, Completion]]:
        """Wait for ``n`` accepted results made within ``max_stale`` of version ``current`` and
        hand them over, oldest version first (a newer result can wait for the next step, an
        older one could not), in order of acceptance within a version; older ones are dropped."""
        while True:
            fresh = [s for s in self.samples if current - s[1].version <= self.max_stale]
            self.dropped_stale += len(self.samples) - len(fresh)
            self.samples = fresh
            if len(fresh) >= n:
                fresh.sort(key=lambda s: s[1].version)  # stable: acceptance order within a version
                out, self.samples = fresh[:n], fresh[n:]
                self.taken_at = current
                self._room.set()
                return out
            self._more.clear()
            await self._more.wait()

    def stats(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": dict(self.rejected), "in_flight": self.table.in_flight,
                "pending": self.table.pending, "dropped_stale": self.dropped_stale, "parked": len(self.parked)}  # fmt: skip


class Coordinator(Actor):
    """Answers the workers' ``want``/``renew``/``result`` messages from the `WorkPool`.

    Messages arrive by `tell` as `Message`s; answers go back down with ``down``."""

    mailbox_size = 1024

    def __init__(self, pool: WorkPool, flow: VersionFlow, down: Send) -> None:
        self.pool = pool
        self.flow = flow
        self.down = down

    async def main(self) -> None:
        while True:  # expire leases on time even when no message comes; answer parked wants
            now = time.monotonic()
            self.pool.expire(now)
            for w, granted in self.pool.unpark(now, self.flow.version or 0).items():
                await self._grant(w, granted)
            await self.pool.wait_room(min(1.0, self.pool.leases.ttl_s / 4))

    async def _grant(self, w: str, granted: list[tuple[Lease, Prompt]]) -> None:
        leases = [[lease.item, lease.token, lease.ttl_s, p.text] for lease, p in granted]
        await self.down({"k": "grant", "w": w, "n": self.pool.group_size, "leases": leases}, ())

    async def receive(self, msg: Message) -> None:
        try:
            await self._handle(msg)
        except (KeyError, TypeError, ValueError) as e:  # a malformed message: the sender's fault, dropped
            log.warning("bad_work_message", k=msg.header.get("k"), worker=msg.header.get("w"), error=repr(e))

    async def _handle(self, msg: Message) -> None:
        h, now = msg.header, time.monotonic()
        w = str(h["w"])
        k = h.get("k")
        if k == "want":
            v = h.get("v")
            granted = self.pool.want(w, int(h["n"]), now, None if v is None else int(v), self.flow.version or 0)
            if granted:
                await self._grant(w, granted)
        elif k == "renew":
            renewed = self.pool.renew(w, [int(t) for t in h["tokens"]], now)
            if renewed:
                await self.down({"k": "renewed", "w": w, "leases": [[x.item, x.token, x.ttl_s] for x in renewed]}, ())
        elif k == "result":
            try:
                c = Completion.from_wire(msg.buffers[0])
            except (IndexError, ValueError) as e:
                # a bad result is the worker's fault: reject it, never crash the coordinator over it
                log.warning("bad_result", worker=w, item=h.get("item"), error=repr(e))
                await self.down({"k": "verdict", "w": w, "item": h.get("item"), "ok": False, "reason": "malformed"}, ())
                return
            current = self.flow.version or 0
            why = self.pool.result(w, int(h["item"]), int(h["token"]), int(h["v"]), current, c, now)
            if why is not None:
                log.info("result_rejected", worker=w, item=h["item"], version=h["v"], reason=why)
            await self.down({"k": "verdict", "w": w, "item": h["item"], "ok": why is None, "reason": why}, ())


# ---------------------------------------------------------------- relay side
@dataclass
class Routes:
    """Which child each worker's messages came through, so answers go back the same way."""

    via: dict[str, str] = field(default_factory=dict)

    def learn(self, worker: str, child: str) -> None:
        self.via[worker] = child

    def child_for(self, worker: str) -> str | None:
        return self.via.get(worker)


# ---------------------------------------------------------------- rollout side
@dataclass
class WorkerStats:
    completions: int = 0
    accepted: int = 0
    rejected: int = 0
    switches: int = 0
    switch_s: float = 0.0
    generate_s: float = 0.0
    tokens: int = 0


class Worker(Actor):
    """A rollout worker: asks for prompts, generates with its engine, sends results up.

    Between batches it switches the engine to the node's newest committed version.
    The engine, lease holder and stats live outside the actor and survive restarts."""

    mailbox_size = 256

    def __init__(self, name: str, engine: Engine, flow: VersionFlow, up: Send, leases: LeaseSpec,
                 holder: LeaseHolder, stats: WorkerStats) -> None:  # fmt: skip
        self.name = name
        self.engine = engine
        self.flow = flow
        self.up = up
        self.leases = leases
        self.holder = holder
        self.stats = stats
        self.prompts: dict[int, Prompt] = {}
        self.group_size = 1
        """Samples per prompt, as the coordinator's last grant asked."""
        self.granted = asyncio.Event()

    async def receive(self, msg: Message) -> None:
        h, now = msg.header, time.monotonic()
        k = h.get("k")
        if k == "grant":
            got = [Lease(int(i), self.name, int(t), now, now + float(ttl)) for i, t, ttl, _ in h["leases"]]
            self.holder.on_granted(got, now)
            self.group_size = max(1, int(h.get("n", 1)))
            for i, _, _, text in h["leases"]:
                self.prompts[int(i)] = Prompt(int(i), str(text))
            log.debug("leases_granted", leases=[[x.item, x.token] for x in got])
            if not self.stats.completions and not self.granted.is_set():
                log.info("work_started", leases=len(got))
            self.granted.set()
        elif k == "renewed":
            self.holder.on_renewed([Lease(int(i), self.name, int(t), now, now + float(ttl))
                                    for i, t, ttl in h["leases"]], now)  # fmt: skip
        elif k == "verdict":
            if h["ok"]:
                self.stats.accepted += 1
            else:
                self.stats.rejected += 1
                log.info("result_rejected", item=h["item"], reason=h["reason"])

    async def main(self) -> None:
        renewals = asyncio.ensure_future(self._renew())
        try:
            while True:
                await self._batch()
        finally:
            renewals.cancel()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.leases.ttl_s / 8)
            now = time.monotonic()
            self.holder.tick(now)
            for ev in self.holder.events():
                self.prompts.pop(cast(int, ev.lease.item), None)
                log.info("lease_given_up", item=ev.lease.item, token=ev.lease.token)
            tokens = self.holder.renewals_due(now)
            if tokens:
                await self.up({"k": "renew", "w": self.name, "tokens": tokens}, ())

    async def _batch(self) -> None:
        if self.flow.version is None:
            await asyncio.sleep(0.1)  # nothing to serve until the first version arrives
            return
        await self._switch()
        held = [self.prompts[i] for i in self.holder.items if i in self.prompts]
        if not held:
            self.granted.clear()
            self.flow.committed.clear()
            want = {"k": "want", "w": self.name, "n": self.leases.prompts_per_lease, "v": self.engine.version}
            if await self.up(want, ()):
                # a grant, or a new version (switch, then ask again with it: work may wait for it)
                waits = [asyncio.ensure_future(e.wait()) for e in (self.granted, self.flow.committed)]
                try:
                    await asyncio.wait(waits, timeout=max(1.0, self.leases.ttl_s / 4),
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                finally:
                    for f in waits:
                        f.cancel()
            else:
                await asyncio.sleep(0.1)  # not attached: wait for the uplink
            return
        version = self.engine.version
        assert version is not None
        t0 = time.perf_counter()
        done = await asyncio.to_thread(self.engine.generate, held, version, self.group_size)
        self.stats.generate_s += time.perf_counter() - t0
        for c in done:
            self.stats.completions += 1
            self.stats.tokens += sum(len(s.tokens) for s in c.samples)
            lease = self.holder.take(c.prompt_id)
            self.prompts.pop(c.prompt_id, None)
            if lease is None:
                continue  # given up meanwhile: the coordinator has leased it to someone else
            log.debug("result_sent", item=c.prompt_id, token=lease.token)
            await self.up({"k": "result", "w": self.name, "item": c.prompt_id, "token": lease.token, "v": version},
                          (c.to_wire(),))  # fmt: skip

    async def _switch(self) -> None:
        """At a batch boundary: bring the engine to the newest committed version."""
        if self.flow.version == self.engine.version:
            return
        was = self.engine.version  # None: the first load of this engine, not a version switch
        t0 = time.perf_counter()
        async with self.flow.weights_lock:  # the host copy does not change while the engine reads it
            v, digest, w = self.flow.version, self.flow.digest, self.flow.weights
            assert v is not None
            assert digest is not None
            assert w is not None
            upd = WeightUpdate(v, digest, w, self.flow.touched_since(self.engine.version))
            await asyncio.to_thread(self.engine.apply, upd)
        dt = time.perf_counter() - t0
        self.stats.switches += 1
        self.stats.switch_s += dt
        log.info("engine_switched", version=v, from_version=was,
                 tensors="all" if upd.touched is None else len(upd.touched), switch_ms=round(dt * 1e3, 2))  # fmt: skip


async def tell_or_drop(ref: Any, msg: Message) -> None:
    """Hand a work message to a local actor; while it restarts the message is dropped (leases expire)."""
    try:
        await ref.tell(msg)
    except ActorDead:
        log.debug("work_message_dropped", k=msg.header.get("k"))


async def send_or_drop(ch: Any, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
    if ch is None:
        return False
    try:
        await ch.send(header, *buffers)
        return True
    except TransportClosed:
        return False
