"""Work out, results back: the drivers of the trainer's coordinator and of the rollout worker.

Work messages (`aurora.protocol.messages`) travel the same channels as the
weight versions. Upward (from a worker towards the trainer; relays forward them
to their parent unchanged): `Want` {w, n, v}, `Renew` {w, tokens}, `Result` {w,
item, token, v, samples}. Downward (each relay routes them to the child that the
worker's messages came from, `Routes`): `Grant` {w, n, leases: [item, token,
ttl_s, prompt token ids]}, `Renewed`, `Verdict` {w, item, ok, reason}.

The rules — leasing, staleness, parking, what a result must be — are the pure
`aurora.protocol.workpool.WorkPool`; `Coordinator` feeds it messages and the
time, sends what it answers, and logs; `WorkBoard` wakes the learner when
results come in and the coordinator when leasing room may have opened. Who sent a
work message is checked one hop up from the worker: a rollout speaks only for itself
(`aurora.actors.node`).

The worker (`Worker`) switches its engine to the newest committed version only
between batches (`Engine.apply` with the tensors changed since its version), so
every completion is labelled with the weights that produced it.

Time: both read it from their actor's clock (`Actor.clock`) and never poll. The coordinator
sleeps until `WorkPool.next_deadline()` (a lease expires, a parked want lapses) or until room may
have opened (`WorkBoard.room`); the worker's renewals sleep until `LeaseHolder.next_deadline()`
(a renewal due, a lease given up) or a grant; a worker with no version waits for the first commit,
one that is not attached for its node to attach (`attached`), and one whose want went unanswered
asks again after `want_retry_s` (the pool drops a want its worker stopped repeating after half a
TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
from aurora.actors.flow import VersionFlow
from aurora.transport.base import Channel, Message

from aurora.config.topology import LeaseSpec
from aurora.errors import ActorDead, TransportClosed
from aurora.events import (
    BATCH_GENERATED,
    BATCH_RETURNED,
    BATCH_TAKEN,
    ENGINE_SWITCHED,
    LEASE_EXPIRED,
    LEASE_GIVEN_UP,
    LEASE_RENEWED,
    LEASES_GRANTED,
    RESULT_ACCEPTED,
    RESULT_SENT,
    WORK_STARTED,
)
from aurora.logs import Throttle
from aurora.protocol.leases import LeaseHolder
from aurora.protocol.messages import (
    AppMessage,
    Grant,
    Renew,
    Renewed,
    Result,
    SampleWire,
    Verdict,
    Want,
)
from aurora.protocol.workpool import Accepted, Rejected, WorkPool, leases_in, renew_messages
from aurora.rl.engines import Engine, WeightUpdate
from aurora.rl.types import Completion, Prompt
from aurora.runtime import Actor, in_thread, unwrap_group, wait_first
from aurora.store.journal import ResultJournal

log = structlog.get_logger("aurora.actors.work")

Send = Callable[[AppMessage, tuple[bytes | memoryview, ...]], Awaitable[bool]]
"""Send a message and its buffers one hop; False when there is nobody to send to right now."""
_quiet = Throttle(every_s=5.0)


# ---------------------------------------------------------------- trainer side
@dataclass
class WorkBoard:
    """What the coordinator and the learner wake each other with (both in the trainer's process)."""

    more: asyncio.Event = field(default_factory=asyncio.Event)
    """A result was accepted."""
    room: asyncio.Event = field(default_factory=asyncio.Event)
    """Leasing room may have opened for a parked want: a batch was taken, a version published, a
    result handled (the coordinator clears it when it wakes)."""
    validate_s: float = 0.0
    """Seconds the coordinator spent checking results (the result rules and the lease)."""
    results: int = 0
    """Results checked."""
    journal: ResultJournal | None = None
    """The trainer's record of acknowledged results (with a store): an accepted result is written to it
    before its verdict leaves, a take before the learner steps on it (`aurora.store.journal`)."""

    async def take(
        self, pool: WorkPool, n: int, current: int, stored: int | None = None
    ) -> list[tuple[Prompt, Completion]]:
        """Wait for `WorkPool.take` to hand over ``n`` results for version ``current``; journalled
        (with what the staleness rule dropped meanwhile) before it is returned. ``stored``: the newest
        version the trainer has stored, by which a journal grown too big is compacted."""
        dropped: list[int] = []
        while (batch := pool.take(n, current)) is None:
            dropped += pool.last_dropped
            self.more.clear()
            await self.more.wait()
        dropped += pool.last_dropped
        items = [c.prompt_id for _, c in batch]
        if self.journal is not None:
            await in_thread(self.journal.taken, items, current, dropped)
            if stored is not None and await in_thread(self.journal.too_big):
                await in_thread(self.journal.compact, stored)
        log.debug(BATCH_TAKEN, at=current, items=items, versions=[c.version for _, c in batch], dropped=dropped)
        self.room.set()
        return batch

    async def give_back(self, pool: WorkPool, batch: list[tuple[Prompt, Completion]]) -> None:
        """The learner could not train on ``batch``: back to the pool, first in line, and journalled so."""
        pool.samples[:0] = batch
        items = [c.prompt_id for _, c in batch]
        if self.journal is not None:
            await in_thread(self.journal.returned, items)
        log.debug(BATCH_RETURNED, items=items)
        self.more.set()

    async def accepted(self, worker: str, outcome: Accepted, current: int) -> None:
        """Journal an accepted result (its verdict is sent after)."""
        if self.journal is not None:
            await in_thread(self.journal.accepted, outcome.prompt, outcome.completion)
        c = outcome.completion
        log.debug(RESULT_ACCEPTED, worker=worker, item=c.prompt_id, version=c.version, current=current)


class Coordinator(Actor):
    """Answers the workers' `Want`/`Renew`/`Result` messages from the `WorkPool`.

    Messages arrive by `tell` as `Message`s; answers go back down with ``down``."""

    mailbox_size = 1024

    def __init__(
        self,
        pool: WorkPool,
        board: WorkBoard,
        flow: VersionFlow,
        down: Send,
        may_work: Callable[[str], bool] = lambda _: True,
    ) -> None:
        self.pool = pool
        self.board = board
        self.flow = flow
        self.down = down
        self.may_work = may_work
        """Whether a worker may be granted work now (a pool member that lost its place while its want
        waited in the mailbox may not)."""

    async def main(self) -> None:
        """Expire leases at their instant even when no message comes; answer parked wants when room
        may have opened. Sleeps until the pool's next deadline or `WorkBoard.room`, nothing else."""
        while True:
            now = self.clock.now()
            for e in self.pool.expire(now):
                log.info(LEASE_EXPIRED, worker=e.lease.worker, item=e.lease.item, token=e.lease.token.hex()[:8])
            for w, granted in self.pool.unpark(now, self.flow.version or 0).items():
                await self.down(self.pool.grant_message(w, granted), ())
            await self.clock.wait_until(self.board.room, self.pool.next_deadline())
            self.board.room.clear()

    async def receive(self, msg: Message) -> None:
        m, now = msg.msg, self.clock.now()
        if not isinstance(m, Want | Renew | Result) or (isinstance(m, Want) and not self.may_work(m.w)):
            return
        t = time.perf_counter()
        current = self.flow.version or 0
        answer = self.pool.handle(m, now, current)
        if isinstance(m, Result):
            self.board.validate_s += time.perf_counter() - t
            self.board.results += 1
            self.board.room.set()  # its lease ended: room for a parked want, maybe
        if isinstance(answer.outcome, Accepted):
            await self.board.accepted(m.w, answer.outcome, current)
            self.board.more.set()
        elif isinstance(answer.outcome, Rejected) and isinstance(m, Result):
            suppressed = _quiet.allow(f"rejected/{m.w}", now)
            if suppressed is not None:
                log.info(
                    "result_rejected",
                    worker=m.w,
                    item=m.item,
                    version=m.v,
                    reason=answer.outcome.reason,
                    suppressed=suppressed,
                )
        if answer.reply is not None:
            await self.down(answer.reply, ())


# ---------------------------------------------------------------- relay side
@dataclass
class Routes:
    """Which child each worker's messages came through, so answers go back the same way.

    A worker's route moves only with a `Want` (what a worker sends when it attaches, or runs out of
    work), or when the child it went through is gone: a relay cannot take over the answers to a
    worker attached elsewhere by sending renewals or results in its name."""

    via: dict[str, str] = field(default_factory=dict)

    def learn(self, worker: str, child: str, *, moves: bool = True, open_children: Mapping[str, Any] = {}) -> bool:
        """Record that ``worker``'s messages come through ``child``; False: they go through another
        child still attached, and this message may not move them (it is dropped)."""
        now = self.via.get(worker)
        if now is not None and now != child and not moves and now in open_children:
            return False
        self.via[worker] = child
        return True

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
    The engine, lease holder and stats live outside the actor and survive restarts, but
    a restarted worker gives up the leases it held (their prompts went with the crash);
    the lease renewals run in the actor's own task group (their failure is its crash).
    ``attached``: waits until the node has a parent to send to (at once if it has)."""

    mailbox_size = 256

    def __init__(
        self,
        name: str,
        engine: Engine,
        flow: VersionFlow,
        up: Send,
        leases: LeaseSpec,
        holder: LeaseHolder,
        stats: WorkerStats,
        attached: Callable[[], Awaitable[None]],
    ) -> None:
        self.name = name
        self.engine = engine
        self.flow = flow
        self.up = up
        self.leases = leases
        self.holder = holder
        self.stats = stats
        self.attached = attached
        self.prompts: dict[int, Prompt] = {}
        self.group_size = 1
        """Samples per prompt, as the coordinator's last grant asked."""
        self.granted = asyncio.Event()
        self._leases_moved = asyncio.Event()
        """Leases were granted or renewed: the holder's next deadline may be sooner (`_renew` wakes)."""

    @property
    def want_retry_s(self) -> float:
        """How long a want waits for its grant before the worker asks again: well within the half TTL
        (at least 2 s) after which the pool drops a parked want whose worker stopped asking."""
        return max(1.0, self.leases.ttl_s / 4)

    async def receive(self, msg: Message) -> None:
        m, now = msg.msg, self.clock.now()
        if isinstance(m, Grant):
            got = leases_in(m, self.name, now)
            self.holder.on_granted(got, now)
            self._leases_moved.set()
            self.group_size = m.n
            for g in m.leases:
                self.prompts[g.item] = Prompt(g.item, "", tokens=tuple(g.tokens))
            log.debug(LEASES_GRANTED, leases=[[x.item, x.token.hex()[:8]] for x in got])
            if not self.stats.completions and not self.granted.is_set():
                log.info(WORK_STARTED, leases=len(got))
            self.granted.set()
        elif isinstance(m, Renewed):
            rtts = self.holder.on_renewed(leases_in(m, self.name, now), now)
            self._leases_moved.set()
            if rtts:
                log.info(LEASE_RENEWED, leases=len(m.leases), rtt_ms=round(max(rtts) * 1e3, 2))
        elif isinstance(m, Verdict):
            if m.ok:
                self.stats.accepted += 1
            else:
                self.stats.rejected += 1
                log.info("result_rejected", item=m.item, reason=m.reason)

    async def main(self) -> None:
        # a restart: the leases held were for prompts the crashed run had (and may crash on again);
        # renewing them would keep them from everyone for good, so the coordinator gets them back
        for lease in self.holder.drop_all():
            log.info(LEASE_GIVEN_UP, item=lease.item, token=lease.token.hex()[:8], reason="the worker restarted")
        with unwrap_group():
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._renew())
                while True:
                    await self._batch()

    async def _renew(self) -> None:
        """Renew each lease when the holder says it is due, give up the ones that ran out: sleeps until
        `LeaseHolder.next_deadline()`, or until a grant or renewal moves it."""
        while True:
            await self.clock.wait_until(self._leases_moved, self.holder.next_deadline())
            self._leases_moved.clear()
            now = self.clock.now()
            self.holder.tick(now)
            for ev in self.holder.events():
                self.prompts.pop(cast(int, ev.lease.item), None)
                log.info(LEASE_GIVEN_UP, item=ev.lease.item, token=ev.lease.token.hex()[:8])
            for renew in renew_messages(self.name, self.holder.renewals_due(now)):
                await self.up(renew, ())

    async def _batch(self) -> None:
        if self.flow.version is None:  # nothing to serve until the first version arrives
            self.flow.committed.clear()
            await self.flow.committed.wait()
            return
        await self._switch()
        held = [self.prompts[i] for i in self.holder.items if i in self.prompts]
        if not held:
            self.granted.clear()
            self.flow.committed.clear()
            want = Want(w=self.name, n=max(1, min(256, self.leases.prompts_per_lease)), v=self.engine.version)
            if await self.up(want, ()):
                # a grant, or a new version (switch, then ask again with it: work may wait for it)
                with contextlib.suppress(TimeoutError):
                    async with self.clock.timeout(self.want_retry_s):
                        await wait_first(self.granted.wait(), self.flow.committed.wait())
            else:
                await self.attached()  # not attached: until the uplink is
            return
        version = self.engine.version
        assert version is not None
        t0 = time.perf_counter()
        done = await in_thread(self.engine.generate, held, version, self.group_size)
        self.stats.generate_s += time.perf_counter() - t0
        log.info(
            BATCH_GENERATED, prompts=len(done), version=version, generate_ms=round(1e3 * (time.perf_counter() - t0), 1)
        )
        for c in done:
            self.stats.completions += 1
            self.stats.tokens += sum(len(s.tokens) for s in c.samples)
            lease = self.holder.take(c.prompt_id)
            self.prompts.pop(c.prompt_id, None)
            if lease is None:
                continue  # given up meanwhile: the coordinator has leased it to someone else
            log.debug(RESULT_SENT, item=c.prompt_id, token=lease.token.hex()[:8])
            samples = [SampleWire(s.tokens, [min(0.0, lp) for lp in s.logprobs]) for s in c.samples]
            await self.up(Result(w=self.name, item=c.prompt_id, token=lease.token, v=version, samples=samples), ())

    async def _switch(self) -> None:
        """Bring the engine to the newest committed version (a batch engine: at a batch boundary)."""
        if self.flow.version == self.engine.version:
            return
        was = self.engine.version  # None: the first load of this engine, not a version switch
        t0 = time.perf_counter()
        async with self.flow.weights_lock:  # the host copy does not change while the engine reads it
            v, digest, w = self.flow.version, self.flow.digest, self.flow.weights
            assert v is not None
            assert digest is not None
            assert w is not None
            upd = WeightUpdate(v, digest, w, self.flow.touched_since(was))
            stopped = await self._apply(upd)
        applied = time.perf_counter() - t0
        stopped = applied if stopped is None else stopped
        self.stats.switches += 1
        self.stats.switch_s += stopped
        log.info(
            ENGINE_SWITCHED,
            version=v,
            from_version=was,
            tensors="all" if upd.touched is None else len(upd.touched),
            switch_ms=round(stopped * 1e3, 2),
            apply_ms=round(applied * 1e3, 2),
            **getattr(self.engine, "last_switch", {}),
        )

    async def _apply(self, update: WeightUpdate) -> float | None:
        """Apply ``update``; the seconds generation was stopped for it, None: all of it (a batch engine)."""
        await in_thread(self.engine.apply, update)
        return None


class ContinuousWorker(Worker):
    """A rollout worker on an engine that generates continuously (`AsyncVllmEngine`).

    Each leased prompt is submitted to the engine as soon as it is granted, and its result goes up
    as soon as its group is done; the worker asks for more whenever fewer than a lease's worth of
    prompts are in flight. A switcher task moves the engine to each newly committed version while
    generation goes on (the engine pauses, loads, resumes: requests in flight continue on the new
    weights). A result's version is the oldest that made any of its tokens; a sample made by several
    carries its spans. The engine holds back results until the loads that made them passed their
    check, and drops (and generates again) those that did not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[int, asyncio.Task[None]] = {}
        self._done = asyncio.Event()
        """A prompt's result went up (or was dropped): room to ask for more."""

    async def main(self) -> None:
        for lease in self.holder.drop_all():
            log.info(LEASE_GIVEN_UP, item=lease.item, token=lease.token.hex()[:8], reason="the worker restarted")
        engine = cast(Any, self.engine)
        try:
            with unwrap_group():
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._renew())
                    tg.create_task(self._switcher())
                    while True:
                        await self._feed(tg, engine)
        finally:
            for t in self.running.values():
                t.cancel()
            self.running.clear()

    async def _switcher(self) -> None:
        """Bring the engine to the newest committed version whenever one commits (or the engine, after
        a failed check, serves none); generation goes on meanwhile."""
        engine = cast(Any, self.engine)
        while True:
            if self.flow.version is not None and self.flow.version != engine.version:
                await self._switch()
                continue
            self.flow.committed.clear()
            engine.unserved.clear()
            await wait_first(self.flow.committed.wait(), engine.unserved.wait())

    async def _apply(self, update: WeightUpdate) -> float | None:
        engine = cast(Any, self.engine)
        paused = engine.pause_s
        await engine.apply(update)  # pause (keep), load, resume: the check runs after
        return float(engine.pause_s - paused)

    async def _feed(self, tg: asyncio.TaskGroup, engine: Any) -> None:
        """Submit what was granted; ask for more when fewer than a lease's worth are in flight."""
        if engine.version is None:  # nothing to serve until the first version is in
            await engine.serving.wait()
            return
        for item, prompt in list(self.prompts.items()):
            if item not in self.running and item in self.holder.items:
                self.running[item] = tg.create_task(self._one(prompt, engine))
        want = max(1, min(256, self.leases.prompts_per_lease))
        self._done.clear()
        if len(self.running) >= want:
            await self._done.wait()
            return
        self.granted.clear()
        if await self.up(Want(w=self.name, n=want - len(self.running), v=engine.version), ()):
            with contextlib.suppress(TimeoutError):
                async with self.clock.timeout(self.want_retry_s):
                    await wait_first(self.granted.wait(), self._done.wait())
        else:
            await self.attached()

    async def _one(self, prompt: Prompt, engine: Any) -> None:
        try:
            t0 = time.perf_counter()
            c: Completion = await engine.complete(prompt, self.group_size)
            self.stats.completions += 1
            self.stats.tokens += sum(len(s.tokens) for s in c.samples)
            self.stats.generate_s += time.perf_counter() - t0
            versions = sorted({v for s in c.samples for v in s.versions(c.version)})
            log.info(
                BATCH_GENERATED,
                prompts=1,
                version=c.version,
                versions=versions,
                generate_ms=round(1e3 * (time.perf_counter() - t0), 1),
            )
            lease = self.holder.take(c.prompt_id)
            self.prompts.pop(c.prompt_id, None)
            if lease is None:
                return  # given up meanwhile: the coordinator has leased it to someone else
            log.debug(RESULT_SENT, item=c.prompt_id, token=lease.token.hex()[:8])
            samples = [SampleWire(s.tokens, [min(0.0, lp) for lp in s.logprobs], s.spans) for s in c.samples]
            await self.up(Result(w=self.name, item=c.prompt_id, token=lease.token, v=c.version, samples=samples), ())
        finally:
            self.running.pop(prompt.id, None)
            self._done.set()


async def tell_or_drop(ref: Any, msg: Message) -> None:
    """Hand a work message to a local actor; while it restarts the message is dropped (leases expire)."""
    try:
        await ref.tell(msg)
    except ActorDead:
        log.debug("work_message_dropped", k=type(msg.msg).__name__)


async def send_or_drop(ch: Channel | None, msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool:
    if ch is None:
        return False
    try:
        await ch.send(msg, *buffers)
        return True
    except TransportClosed:
        return False
