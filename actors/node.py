"""A node's actors, and `Node`: the state that outlives them.

`aurora.node.run_node` (the composition root of ``aurora node``) builds a `Node` — its
`VersionFlow` (weights and recent deltas), its place in the tree, the work routes, the trainer's
`WorkPool` and store, a rollout's engine — and runs the actors under one `Supervisor`
(one_for_one), so a crashed actor restarts from that state. Each actor is given the narrow part it
works on: the publisher its learner, pool, board, flow and status; the reporter a report and the way
up; the tree's actors (children, uplink) a `TreeView` of the node. The actors:

* ``children`` (trainer, relays): accepts child connections; each child's
  first message is a `Hello`; then its `Have` reports go to the flow and its
  work messages (`Want`/`Renew`/`Result`) to the coordinator (trainer) or up
  to this node's parent (relay);
* ``uplink`` (relays, rollouts): dials the planned parent and, when it is lost
  (heartbeats), unreachable or refuses, the fallbacks in turn; on attach the
  node says which version it holds and catches up; the parent's stream feeds
  the flow, its work answers go to the worker or down to the right child;
* ``coordinator`` and ``publisher`` (trainer): leases prompts and gates results
  (`aurora.actors.work`); the learner steps every ``learner.interval_s``, or
  after ``learner.samples_per_step`` accepted results, and each version is
  stored before its seal leaves (a restarted trainer resumes from it);
* ``worker`` (rollouts with an ``engine`` section): generates, switching the
  engine's version only between batches.

Trust and isolation (docs/security.md):

* who a peer is comes from its CurveZMQ key (`aurora.auth.keys`); a node takes as
  children only the nodes the topology allows under it (the planned tree and the
  fallbacks); a rollout speaks only for itself in work and status messages, a
  relay for the nodes that may be below it;
* every message is typed and validated on arrival; one that is out of place is the
  peer's fault (`Channel.fault`): dropped, and a peer that keeps at it is cut off;
* blame by cause (`aurora.errors.peer_fault`): a peer's fault while serving one child closes
  that child's channel, and one in a parent's stream makes the node leave that parent
  (`parent_failed`) and try the next, so no peer can crash an actor or the node; any other
  error (a bug, a full disk) crashes the actor, and its supervisor counts it.

The tree that runs is the planned tree: at start a node keeps trying its planned parent
for `PLANNED_PATIENCE_S` before it falls back, and a node on a fallback parent probes its
planned parent and returns once that has accepted probes for ``return_after_s``
(hysteresis: a flapping parent does not pull children back and forth). A parent answers a
child's hello with its path from the trainer, or refuses the child while it is itself
detached or when the child is its own ancestor; a node whose parent's path comes to run
through itself leaves that parent — so failover never closes a cycle. These rules are
values in `aurora.protocol.membership`: the uplink actor drives its `Uplink` machine (sleeps
until its next deadline, dials whom it names, feeds it what the parent says and does) and
children are answered by the node's `Place`. Logs say what happened: ``version_published``,
``version_committed``, ``parent_attached``, ``parent_lost``, ``parent_failed``,
``parent_return``, ``child_attached``, ``child_failed``, ``engine_switched``, ``step``
(the names other code reads are constants in `aurora.events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import msgspec
import structlog
from aurora.actors.flow import VersionFlow
from aurora.actors.status import STATUS_EVERY_S, ClusterStatus
from aurora.actors.work import (
    Routes,
    Send,
    WorkBoard,
    WorkerStats,
    send_or_drop,
    tell_or_drop,
)
from aurora.transport.base import Channel, Transport

from aurora.auth.keys import OPERATOR, NodeKeys
from aurora.auth.pool import Revocations, check_cert
from aurora.auth.seal import SealVerifier
from aurora.codec import Weights
from aurora.config.plan import Tree
from aurora.config.topology import Role, Topology, WebRtcSpec
from aurora.errors import AuroraError, TransportClosed, peer_fault
from aurora.events import (
    CHILD_ATTACHED,
    EVALUATED,
    LEASE_EXPIRED,
    PARENT_ATTACHED,
    PARENT_FAILED,
    PARENT_LOST,
    PARENT_RETURN,
    POOL_MEMBER_JOINED,
    POOL_MEMBER_LEFT,
    POOL_MEMBER_REFUSED,
    STEP,
    VERSION_SYNCED,
    WEBRTC_PARENT_CONNECTED,
)
from aurora.logs import Throttle
from aurora.protocol import membership
from aurora.protocol.messages import (
    DOWN,
    MAX_REASON_CHARS,
    UP,
    Admitted,
    AppMessage,
    DeltaChunk,
    DeltaManifest,
    DeltaSeal,
    Have,
    Held,
    Hello,
    Join,
    Lane,
    MemberCert,
    NodeReport,
    PathUpdate,
    Refused,
    Signal,
    SignalHello,
    Status,
    StatusQuery,
    StatusSnapshot,
    Want,
)
from aurora.protocol.roster import PoolRoster
from aurora.protocol.workpool import WorkPool
from aurora.rl.learners import Learner
from aurora.runtime import (
    Actor,
    ActorRef,
    Clock,
    LoopClock,
    Supervisor,
    in_thread,
    unwrap_group,
)
from aurora.store import DeltaStore
from aurora.tracking import Tracker, Trackers

if TYPE_CHECKING:  # aiortc is the webrtc extra: imported only where a topology uses WebRTC
    from aurora.transport.webrtc import WebRtcTransport
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

log = structlog.get_logger("aurora.node")
_quiet = Throttle(every_s=5.0)

HELLO_WAIT_S = 10.0
"""A child's first message (its hello, a status query, signalling) is due this long after its channel
opens; then the channel is closed (a child says hello the moment it hears its parent)."""
MEMBER_SLACK = 16
"""Pool members a node serves or routes for beyond the pools' sizes (members leaving and joining at once)."""


class NodeTransport(Transport, Protocol):
    """What a node needs from its transport: `Transport`, plus a listening address and hanging up."""

    address: str

    async def disconnect(self, peer: str) -> None: ...


class TreeView(Protocol):
    """What the tree's actors — ``children`` and ``uplink`` — use of their node: its name, place and
    keys, its versions, the work routes and pool, the links up and down, and its status. Nothing of
    its learner, engine, store or the factory that built it."""

    name: str
    topo: Topology
    clock: Clock
    keys: NodeKeys
    role: dict[str, Role]
    place: membership.Place
    rules: membership.TreeRules
    routes: Routes
    pool: WorkPool | None
    rtc: WebRtcTransport | None
    parent: Channel | None
    flow: VersionFlow

    cert: MemberCert | None
    roster: PoolRoster | None
    max_members: int
    connecting_members: int

    def ref(self, actor: str) -> ActorRef | None: ...
    async def admit(self, member: str, cert: MemberCert | None, probe: bool, key: bytes | None) -> str | None: ...
    def on_admitted(self, m: Admitted) -> bool: ...
    def join(self, member: str, cert: MemberCert, parent: str) -> str | None: ...
    def heard_member(self, member: str) -> bool: ...
    async def evict(self, member: str, via: Channel) -> None: ...
    def may_work(self, worker: str) -> bool: ...
    def fail(self, why: str) -> None: ...
    def member_routes(self) -> int: ...
    def report(self) -> NodeReport: ...
    def on_status_message(self, m: Held | Status) -> None: ...
    def snapshot(self) -> StatusSnapshot: ...
    async def up(self, msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool: ...
    async def down(self, msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool: ...
    async def tell_children(self, update: PathUpdate) -> None: ...


class Node:
    """State that outlives the node's actors (see the module docstring)."""

    def __init__(
        self,
        name: str,
        topo: Topology,
        tree: Tree,
        file: str | None,
        keys: NodeKeys | None = None,
        threads: int = 1,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.clock: Clock = clock or LoopClock()
        """The node's clock (its actors' too): status times and the flow's link timing read it."""
        self.threads = threads
        """Cores the codec may use for each version (encode on the trainer, decode and apply elsewhere)."""
        self.topo = topo
        self.tree = tree
        self.file = file
        self.keys = keys or NodeKeys()
        self.role = {n.name: n.role for n in topo.nodes}
        self.rules = membership.TreeRules(
            tree.parent, tree.fallbacks, self.role, {p.name: p.parents for p in topo.pools}
        )
        """Who may attach where, and whom a child speaks for."""
        self.place = membership.Place(name, self.rules)
        """Where this node sits (its path; None while detached) and the parents it holds in quarantine."""
        self._parent: Channel | None = None
        self._parent_moved = asyncio.Event()
        self.verifier = SealVerifier(self.keys.verifier)
        self.flow: VersionFlow
        """The node's versions: built once (`aurora.node.open_trainer` or `open_store`), from what the node starts with."""
        self.routes = Routes()
        self.pool: WorkPool | None = None
        self.board = WorkBoard()
        self.learner: Learner | None = None
        self.store: DeltaStore | None = None
        self.engine: Any = None
        self.worker_stats = WorkerStats()
        self.tracker = Trackers()
        """Where a trainer's figures go besides its log (`aurora.tracking`): none until it opens some."""
        self.status = ClusterStatus(
            [n.name for n in topo.nodes if n.role != "trainer"],
            planned={n: p for n, p in tree.parent.items() if p is not None},
        )
        self.pools = {p.name: p for p in topo.pools}
        self.pool_keys: dict[str, Ed25519PublicKey] = {}
        """Each pool's public key (at a pool's parent: `aurora.node` loads them)."""
        self.roster = (
            PoolRoster(
                {p.name: p.max_size for p in topo.pools}, max(2 * topo.heartbeat.lost_after_s, 3 * STATUS_EVERY_S)
            )
            if topo.pools and self.role.get(name) == "trainer"
            else None
        )
        """The trainer's: each pool's members (`aurora.protocol.roster`)."""
        self.revocations: Revocations | None = None
        """The pools' revocation files (at a pool's parents and the trainer: `aurora.node` opens them)."""
        self.cert: MemberCert | None = None
        """A pool member's certificate, shown with its hello."""
        self.failed = asyncio.Event()
        self.failure: str | None = None
        """Why the node stops on its own (a pool member whose credential ended); `aurora.node` raises it."""
        self._admissions: dict[str, tuple[asyncio.Event, list[Admitted]]] = {}
        """A relay's hellos of pool members waiting for the trainer's answer to their `Join`."""
        self.max_members = sum(p.max_size for p in topo.pools) + MEMBER_SLACK
        """Pool members this node serves or routes for at most at once (beyond: refused, as an attack)."""
        self.connecting_members = 0
        """Pool members' channels open here and not yet attached (their hello not yet answered)."""
        self.sup: Supervisor | None = None
        self.rtc: WebRtcTransport | None = None
        """WebRTC: answers children that come over WebRTC, or dials this node's parent."""

    @property
    def parent(self) -> Channel | None:
        """The channel to the parent while attached."""
        return self._parent

    @parent.setter
    def parent(self, ch: Channel | None) -> None:
        self._parent = ch
        self._parent_moved.set()

    async def wait_attached(self) -> None:
        """Until this node has an open channel to a parent (at once if it has). Cancellation-safe."""
        while self._parent is None or self._parent.closed:  # a closed one is replaced (None, then the next)
            self._parent_moved.clear()
            await self._parent_moved.wait()

    def ref(self, actor: str) -> ActorRef | None:
        assert self.sup is not None
        try:
            return self.sup.ref(actor)
        except KeyError:
            return None

    async def admit(self, member: str, cert: MemberCert | None, probe: bool, key: bytes | None) -> str | None:
        """Why pool member ``member``, which said hello with ``cert`` on a connection authenticated with
        ``key``, may not attach here (None: it may). Its certificate is checked here
        (`aurora.auth.pool.check_cert`, and that it is of the very key the member connected with); then,
        unless it only probes, the trainer gives it a place in its pool — here, or asked with a `Join`
        up the tree that carries the certificate (no answer within half a ``lost_after_s``: refused,
        and the member says hello again). A second hello of a member while one waits waits for the
        same answer."""
        if cert is None:
            return "a pool member shows its certificate with its hello"
        if key is not None and cert.key != key:
            return "its certificate is of another key than the one it connected with"
        why = self._cert_problem(cert, member, self.name)
        if why is not None:
            return why
        if probe:
            return None
        if self.roster is not None:
            return self.join(member, cert, self.name)
        waiting = self._admissions.get(member)
        if waiting is None:
            waiting = self._admissions[member] = (asyncio.Event(), list[Admitted]())
            if not await self.up(Join(w=member, parent=self.name, cert=cert), ()):
                del self._admissions[member]
                return "this node has no parent to ask the trainer through"
        answered, answer = waiting
        try:
            if not await self.clock.wait_until(answered, self.clock.now() + self.topo.heartbeat.lost_after_s / 2):
                return "the trainer did not answer its join in time"
        finally:
            if self._admissions.get(member) is waiting:
                del self._admissions[member]
        return None if answer[0].ok else (answer[0].reason or "refused by the trainer")

    def on_admitted(self, m: Admitted) -> bool:
        """The trainer's answer to a `Join` this node sent: True if a hello was waiting for it."""
        waiting = self._admissions.get(m.w)
        if waiting is None:
            return False
        waiting[1].append(m)
        waiting[0].set()
        return True

    def join(self, member: str, cert: MemberCert, parent: str) -> str | None:
        """Trainer: a place for ``member`` in its pool (None), or why there is none; logged. Its
        certificate is checked again here (a relay is not trusted with who is a member)."""
        assert self.roster is not None
        now = self.clock.now()
        self._left(now)
        had = self.roster.holds(member)
        why = self._cert_problem(cert, member, parent) or self.roster.join(member, now)
        if why is not None:
            if (suppressed := _quiet.allow(f"member/{member}", now)) is not None:
                log.warning(POOL_MEMBER_REFUSED, member=member, reason=why, suppressed=suppressed)
        elif not had:
            log.info(POOL_MEMBER_JOINED, member=member, pool=self.roster.pool_of(member), members=self.roster.members())
        return why

    def _cert_problem(self, cert: MemberCert, member: str, parent: str) -> str | None:
        """Why ``cert`` does not let ``member`` attach under ``parent`` now (`check_cert`, this node's pool
        keys and revocations), or None."""
        why = check_cert(cert, member, parent, self.pools, self.pool_keys, time.time(), self._revoked(cert.pool))
        return None if why is None else f"its certificate {why}"

    def _left(self, now: float) -> None:
        """Trainer: forget the members not heard from for the roster's ``hold_s``; their leases run out as
        any worker's."""
        assert self.roster is not None
        for gone in self.roster.prune(now):
            # its leases run on: a member behind a relay that failed over comes back under them
            self._leave(gone, now, f"not heard from for {self.roster.hold_s:g} s", end_leases=False)

    def _leave(self, member: str, now: float, reason: str, *, end_leases: bool) -> None:
        """Trainer: ``member`` has no place any more; with ``end_leases`` (revoked) its leases end now and
        their prompts go back to the pool, else they run out as any worker's."""
        assert self.roster is not None
        self.roster.remove(member)
        self.status.forget(member)
        self.routes.via.pop(member, None)
        log.info(POOL_MEMBER_LEFT, member=member, reason=reason)
        if self.pool is not None and end_leases:
            for e in self.pool.leave(member, now):
                log.info(LEASE_EXPIRED, worker=e.lease.worker, item=e.lease.item, token=e.lease.token.hex()[:8])
            self.board.room.set()

    def heard_member(self, member: str) -> bool:
        """Trainer: pool member ``member`` was heard from (a report, a work message): does it hold a
        place? Only a member that holds one keeps it; one that lost its place (silent for too long) is
        told so (`evict`) and must say hello again."""
        pool = self.rules.pool_of(member)
        if self.roster is None or pool is None:
            return False
        now = self.clock.now()
        self._left(now)
        if member in self._revoked(pool) and self.roster.holds(member):
            self._leave(member, now, "its credential was revoked", end_leases=True)
        return self.roster.holds(member) and self.roster.seen(member, now)

    def _revoked(self, pool: str) -> frozenset[str]:
        return self.revocations.of(pool, self.clock.now()) if self.revocations is not None else frozenset()

    def fail(self, why: str) -> None:
        """Stop the node, for ``why`` (its ``aurora node`` exits non-zero saying so)."""
        if self.failure is None:
            self.failure = why
            log.error("node_failed", reason=why)
        self.failed.set()

    def may_work(self, worker: str) -> bool:
        """Trainer: may ``worker`` be granted work now (a named rollout, or a pool member with a place)?"""
        return self.roster is None or self.rules.pool_of(worker) is None or self.roster.holds(worker)

    async def evict(self, member: str, via: Channel) -> None:
        """Trainer: tell pool member ``member``, whose message came through child ``via`` and which holds
        no place, that it has none (its parent closes its channel; it says hello again and asks for one)."""
        if _quiet.allow(f"evict/{member}", self.clock.now()) is None:
            return  # told within the last few seconds
        pool = self.rules.pool_of(member)
        revoked = pool is not None and member in self._revoked(pool)
        reason = "its credential is revoked" if revoked else "no place in the pool (silent too long): say hello again"
        with contextlib.suppress(TransportClosed):
            if via.peer == member:  # a child of the trainer itself
                await via.close(reason)
            else:
                await via.send(Admitted(w=member, ok=False, reason=reason))
        self.routes.via.pop(member, None)

    def member_routes(self) -> int:
        """Pool members whose work goes through this node's children."""
        return sum(1 for w in self.routes.via if self.rules.pool_of(w) is not None)

    def report(self) -> NodeReport:
        """This node's `Status` report (see `aurora.actors.status`)."""
        parent = self.place.path[-1] if self.place.path else None
        r = NodeReport(
            version=self.flow.version,
            parent=parent,
            planned=parent is None or parent == self.place.planned,
            bytes_in=self.flow.bytes_in,
            link_mbit=self.flow.link_mbit,
        )
        if self.engine is not None:
            w = self.worker_stats
            r = msgspec.structs.replace(
                r,
                completions=w.completions,
                accepted=w.accepted,
                rejected=w.rejected,
                tok_s=w.tokens / w.generate_s if w.generate_s else 0.0,
                switches=w.switches,
                switch_ms=1e3 * w.switch_s / w.switches if w.switches else 0.0,
            )
        return r

    def on_status_message(self, m: Held | Status) -> None:
        """Trainer: a `Held` notice or a `Status` report from a node below."""
        if isinstance(m, Held):
            dt = self.status.on_held(m.n, m.v, self.clock.now())
            if dt is not None:
                log.info(VERSION_SYNCED, version=m.v, sync_s=round(dt, 4))
                self.tracker.record(m.v, {"sync_s": dt})
        elif self.rules.pool_of(m.n) is None:
            self.status.on_report(m.n, m.r, self.clock.now())
        elif self.heard_member(m.n):
            self.status.on_report(m.n, m.r, self.clock.now(), member=True)

    def snapshot(self) -> StatusSnapshot:
        assert self.pool is not None
        snap = self.status.snapshot(self.flow.version, self.pool.stats(), self.clock.now())
        if self.roster is not None:
            self._left(self.clock.now())
            snap = msgspec.structs.replace(snap, pools=self.roster.members())
        snap = msgspec.structs.replace(snap, speeds=self.pool.measured())
        return StatusSnapshot(snap=snap)

    async def up(self, msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool:
        return await send_or_drop(self.parent, msg, buffers)

    async def down(self, msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool:
        worker = getattr(msg, "w", None)
        child = None if worker is None else self.routes.child_for(worker)
        return await send_or_drop(None if child is None else self.flow.channel(child), msg, buffers)

    async def tell_children(self, update: PathUpdate) -> None:
        """Send every attached child this node's new path."""
        for ch in self.flow.channels():
            with contextlib.suppress(TransportClosed):
                await ch.send(update)


class PublisherActor(Actor):
    """The trainer's learner loop: take a batch, step, publish (stored before its seal leaves).

    The learner's next step overlaps the last one's publication: while version ``v`` is encoded
    and sent, the learner already takes its batch at ``v`` (the weights it holds) and trains
    ``v + 1``. Versions still go out in order, one at a time: ``v + 1`` is published once ``v``
    is. A learner that fails lets the publication in flight finish first, so every version the
    flow holds is one the learner made. When an evaluation is due (``learner.eval``), the learner
    evaluates the version it just made while that version is published, before its next step (the
    run's last version before it is published: a run ends once every node holds it).
    ``deliver`` False: versions are adopted, not sent (the sync-free ideal of `aurora bench rl`)."""

    def __init__(
        self,
        learner: Learner,
        pool: WorkPool,
        board: WorkBoard,
        flow: VersionFlow,
        status: ClusterStatus,
        steps: int,
        deliver: bool,
        tracker: Tracker | None = None,
    ) -> None:
        self.learner = learner
        self.pool = pool
        self.board = board
        self.flow = flow
        self.status = status
        self.steps = steps
        self.deliver = deliver
        self.tracker: Tracker = tracker or Trackers()

    async def main(self) -> None:
        learned = self.flow.version or 0  # the learner's weights: published, or being published
        with unwrap_group():
            await self._steps(learned)
        log.info("steps_done", steps=self.steps, version=self.flow.version)

    async def _evaluate(self, version: int) -> None:
        """Evaluate the learner's weights (version ``version``) on held-out prompts, when due."""
        try:
            figs = await in_thread(self.learner.evaluate, version)
        except Exception as e:  # noqa: BLE001  (an evaluation that fails costs its figures, not the run)
            log.warning(EVALUATED, version=version, error=repr(e)[:300])
            return
        if figs is not None:
            self.status.evaluated = {"eval_version": version, "eval_accuracy": figs.get("eval_accuracy")}
            log.info(EVALUATED, version=version, **figs)
            self.tracker.record(version, figs)

    async def _steps(self, learned: int) -> None:
        learner = self.learner
        if learned == 0:
            await self._evaluate(0)  # where the run starts from
        async with asyncio.TaskGroup() as tg:
            publishing: asyncio.Task[None] | None = None
            while learned < self.steps:
                if learner.batch_size:
                    stored = self.flow.version if self.deliver else None  # adopted versions are not stored
                    batch = await self.board.take(self.pool, learner.batch_size, learned, stored)
                else:
                    await self.clock.sleep(learner.interval_s)
                    batch = []
                try:
                    new = await in_thread(learner.step, batch)
                except Exception:
                    if batch:
                        await self.board.give_back(self.pool, batch)  # untrained: not lost with this step
                    if publishing is not None:
                        await publishing
                    raise
                if publishing is not None:
                    await publishing
                learned += 1
                last = learned >= self.steps
                if last:  # before it goes out: a run ends once every node holds its last version
                    await self._evaluate(learned)
                publishing = tg.create_task(self._publish(new, len(batch), dict(learner.stats)))
                if not last:
                    await self._evaluate(learned)  # while that version is published

    async def _publish(self, new: Weights, results: int, stats: dict[str, Any]) -> None:
        flow, board = self.flow, self.board
        self.status.on_published((flow.version or 0) + 1, self.clock.now())
        if self.deliver:
            v = await flow.publish(new)  # stored before its seal leaves
        else:
            v = await flow.adopt(new)
        board.room.set()  # a new version: work for it may be leased now
        checks = {"validate_us": round(1e6 * board.validate_s / board.results, 2) if board.results else None}
        rollouts = self.status.rollout_figures()
        self.status.step = {"version": v, **stats, **flow.last_published, **self.status.evaluated}
        # the node's own figures win over a learner's stat of the same name (a training loop's own, say)
        log.info(STEP, **{**stats, "version": v, "results": results, **self.pool.stats(), **checks, **rollouts})
        self.tracker.record(v, {**stats, **flow.last_published, **rollouts})


class ReporterActor(Actor):
    """Sends this node's status report up the tree every `STATUS_EVERY_S`."""

    def __init__(self, name: str, report: Callable[[], NodeReport], up: Send) -> None:
        self.name = name
        self.report = report
        self.up = up

    async def main(self) -> None:
        while True:
            await self.up(Status(n=self.name, r=self.report()), ())
            await self.clock.sleep(STATUS_EVERY_S)


class ChildrenActor(Actor):
    """Accepts child connections and serves each in its own task; closes them all when it stops
    (so that children notice a restart of this actor and attach again)."""

    def __init__(self, node: TreeView, zt: NodeTransport) -> None:
        self.node = node
        self.zt = zt
        self.open: set[Channel] = set()

    async def main(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                if self.node.rtc is not None:
                    tg.create_task(self._accept(self.node.rtc, tg))
                await self._accept(self.zt, tg)
        finally:
            for ch in list(self.open):
                with contextlib.suppress(TransportClosed):
                    await ch.close("the parent's children actor restarted")

    async def _accept(self, t: Transport, tg: asyncio.TaskGroup) -> None:
        while True:
            ch = await t.accept()
            tg.create_task(self._serve(ch))

    async def _serve(self, ch: Channel) -> None:
        self.open.add(ch)
        await _child(self.node, ch)
        self.open.discard(ch)  # served to its end; a crash or a cancellation leaves it to `main` to close


async def _child(node: TreeView, ch: Channel) -> None:
    """Serve one child channel. A peer's fault closes this channel and no other; a local failure crashes the actor."""
    try:
        await _serve_child(node, ch)
    except TransportClosed as e:
        log.info("child_detached", child=ch.peer, reason=str(e))
    except Exception as e:
        if not peer_fault(e):
            raise  # a local failure (a bug, a full disk): the children actor crashes and its supervisor counts it
        log.warning("child_failed", child=ch.peer, error=repr(e)[:500])
        with contextlib.suppress(TransportClosed):
            await ch.close(f"failed while serving this child: {type(e).__name__}")
    finally:
        if node.flow.channel(ch.peer) is ch:
            node.flow.remove_child(ch.peer)


async def _serve_child(node: TreeView, ch: Channel) -> None:
    if node.rules.pool_of(ch.peer) is None:
        await _serve_hello(node, ch)
        return
    # a pool member: any key may get this far at a pool's parent, so how many wait here is bounded
    if node.connecting_members >= node.max_members:
        await ch.close("too many pool members connecting")
        return
    node.connecting_members += 1
    try:
        await _serve_hello(node, ch)
    finally:
        node.connecting_members -= 1


async def _serve_hello(node: TreeView, ch: Channel) -> None:
    flow, place = node.flow, node.place
    try:
        async with node.clock.timeout(HELLO_WAIT_S):
            hello = (await ch.recv()).msg
    except TimeoutError:
        await ch.close(f"no first message within {HELLO_WAIT_S:g} s")
        return
    if isinstance(hello, StatusQuery):
        if node.pool is None or (node.keys.secure and ch.peer != OPERATOR and ch.peer not in node.role):
            await ch.close("no status here")
            return
        await ch.send(node.snapshot())
        await ch.close("status sent")
        return
    if isinstance(hello, SignalHello) and node.rtc is not None and place.may_signal(ch.peer):
        await _signalling(node.rtc, ch)
        return
    if not isinstance(hello, Hello):
        log.warning("bad_hello", child=ch.peer, kind=type(hello).__name__)
        await ch.close("expected a hello")
        return
    answer = place.hello(ch.peer)
    member = node.rules.pool_of(ch.peer) is not None
    if not isinstance(answer, Refused) and member:
        why = await node.admit(ch.peer, hello.cert, hello.probe, ch.peer_key)
        answer = place.hello(ch.peer) if why is None else Refused(reason=why[:MAX_REASON_CHARS])
    if isinstance(answer, Refused):
        if (
            suppressed := _quiet.allow(f"refused/{ch.peer if not member else 'members'}", node.clock.now())
        ) is not None:
            log.info("child_refused", child=ch.peer, reason=answer.reason, probe=hello.probe, suppressed=suppressed)
        await ch.send(answer)
        await ch.close("refused")
        return
    await ch.send(answer)
    if hello.probe:
        await ch.close("probe answered")
        return
    log.info(CHILD_ATTACHED, child=ch.peer, version=hello.v)
    flow.add_child(ch, hello.v)
    # a member's credential ends at its expiry (wall-clock), attached or not
    until = None if hello.cert is None or not member else node.clock.now() + (hello.cert.expires - time.time())
    try:
        async with node.clock.timeout_at(until):
            with unwrap_group():
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(flow.serve_child(ch))  # what goes down to this child: its own task
                    await _from_child(node, ch)
    except TimeoutError:
        log.info("child_credential_expired", child=ch.peer)
        await ch.close("its pool credential expired")
    finally:
        if member and node.routes.via.get(ch.peer) == ch.peer:  # a member speaks only for itself: its
            del node.routes.via[ch.peer]  # route goes with it (it attaches again only with a new hello)


async def _from_child(node: TreeView, ch: Channel) -> None:
    """Everything a child sends after its hello (until its channel closes)."""
    coordinator = node.ref("coordinator")
    while True:
        msg = await ch.recv()
        m = msg.msg
        if isinstance(m, Have):
            node.flow.on_child_version(ch.peer, m.v)
        elif isinstance(m, Held | Status):
            if not node.place.speaks_for(ch.peer, m.n):
                ch.fault(f"{ch.peer!r} sent {type(m).__name__} for {m.n!r}, which it does not speak for")
            elif node.pool is not None:
                node.on_status_message(m)
            else:
                await node.up(m, ())
        elif isinstance(m, UP):
            if not node.place.speaks_for_worker(ch.peer, m.w):
                ch.fault(f"{ch.peer!r} sent {type(m).__name__} for worker {m.w!r}, which it does not speak for")
                continue
            member = node.rules.pool_of(m.w) is not None
            if isinstance(m, Join) and (not member or not node.place.speaks_for(ch.peer, m.parent)):
                ch.fault(f"{ch.peer!r} sent a join for {m.w!r} under {m.parent!r}, which it does not speak for")
                continue
            if member and m.w not in node.routes.via and node.member_routes() >= node.max_members:
                ch.fault(f"{ch.peer!r} sent work for {m.w!r}, one pool member more than the pools hold")
                continue
            if node.roster is not None and member and not isinstance(m, Join) and not node.heard_member(m.w):
                await node.evict(m.w, ch)  # a member without a place gets no work: it must say hello again
                continue
            if not node.routes.learn(m.w, ch.peer, moves=isinstance(m, Want | Join), open_children=node.flow.children):
                ch.fault(f"{ch.peer!r} sent {type(m).__name__} for {m.w!r}, whose work goes through another child")
                continue
            if node.roster is not None and isinstance(m, Join):
                why = node.join(m.w, m.cert, m.parent)
                await node.down(Admitted(w=m.w, ok=why is None, reason=why), ())
                if why is not None:
                    node.routes.via.pop(m.w, None)
            elif coordinator is not None:
                await tell_or_drop(coordinator, msg)
            else:
                await node.up(m, tuple(msg.buffers))
        else:
            ch.fault(f"a {type(m).__name__} from a child")


class _Left(Exception):
    """The membership machine left the parent: unwinds what serves it (its stream, the probes)."""

    def __init__(self, leave: membership.Leave) -> None:
        super().__init__(leave.parent)
        self.leave = leave


class UplinkActor(Actor):
    """Keeps this node attached to the first parent in its order that accepts it: the driver of a
    `membership.Uplink`. It sleeps until the machine's next deadline, dials the parent it names, feeds
    it what that parent says and does, carries out its commands and logs its events. Its time is the
    actor's clock (the node's): the machine's ``now`` and every wait."""

    def __init__(self, node: TreeView, zt: NodeTransport, lost_after_s: float) -> None:
        self.node = node
        self.zt = zt
        self.lost_after_s = lost_after_s

    async def main(self) -> None:
        up = membership.Uplink(self.node.place, self.lost_after_s, self.clock.now())
        while True:
            for out in up.tick(await self.clock.sleep_until(up.next_deadline())):
                assert isinstance(out, membership.Dial), out  # detached, the machine only dials
                await self._with(up, out.parent)

    async def _with(self, up: membership.Uplink, parent: str) -> None:
        """Dial ``parent`` and serve it until the machine leaves it; then drop what was in flight from
        it and hang up."""
        node = self.node
        addr = node.topo.node(parent).listen
        assert addr is not None  # checked when the topology was loaded
        try:
            with unwrap_group():
                async with asyncio.TaskGroup() as tg:  # owns the WebRTC signalling loop while with this parent
                    signalling: asyncio.Task[None] | None = None
                    try:
                        if node.rtc is not None and isinstance(node.topo.node(node.name).transport, WebRtcSpec):
                            ch, signalling = await _dial_webrtc(node.rtc, self.zt, parent, addr, tg)
                        else:
                            ch = await self.zt.connect(parent, addr)
                    except TransportClosed as e:
                        with contextlib.suppress(_Left):
                            await self._do(up, None, up.unreachable(str(e), self.clock.now()))
                    else:
                        try:
                            await self._serve(up, ch)
                        except _Left as left:
                            if left.leave.close is not None:
                                with contextlib.suppress(TransportClosed):
                                    await ch.close(left.leave.close)
                        finally:
                            if signalling is not None:
                                signalling.cancel()  # then awaited by the task group
                                with contextlib.suppress(TransportClosed):
                                    await ch.close("leaving this parent")
        finally:  # left, or crashed on a local failure: the next life of the uplink dials afresh
            node.flow.parent_lost(left=True)
            await self.zt.disconnect(parent)

    async def _serve(self, up: membership.Uplink, ch: Channel) -> NoReturn:
        """Say hello on ``ch`` and follow the parent's stream; what ends it is fed to the machine, which
        leaves the parent (`_Left`)."""
        node = self.node
        outs = up.dialed(self.clock.now())
        try:
            async with self.clock.timeout_at(up.next_deadline()):
                await self._do(up, ch, outs)  # the hello: sent once the parent is heard
                answer = (await ch.recv()).msg
            await self._do(up, ch, up.answered(answer, self.clock.now()))
            node.parent = ch
            await self._follow(up, ch)
        except _Left:
            raise
        except (TransportClosed, TimeoutError) as e:
            outs = up.lost(str(e) or "no answer", self.clock.now())
        except Exception as e:
            if not peer_fault(e):
                raise  # a local failure is not the parent's: the uplink crashes and its supervisor counts it
            outs = up.failed(
                repr(e)[:500], type(e).__name__, self.clock.now()
            )  # a corrupt, forged or out-of-order stream
        finally:
            node.parent = None
        await self._do(up, ch, outs)
        raise AssertionError(f"the uplink did not leave {up.parent!r}")

    async def _follow(self, up: membership.Uplink, ch: Channel) -> None:
        """Attached: the parent's stream; on a fallback, the machine's probes of the planned parent beside it."""
        if not up.on_fallback:
            await self._stream(up, ch)
            return
        with unwrap_group():
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._timers(up, ch))
                await self._stream(up, ch)

    async def _timers(self, up: membership.Uplink, ch: Channel) -> None:
        while True:
            await self._do(up, ch, up.tick(await self.clock.sleep_until(up.next_deadline())))

    async def _do(self, up: membership.Uplink, ch: Channel | None, outs: list[membership.Output]) -> None:
        """Carry out the machine's commands and log its events, in order (`membership.Leave` raises `_Left`)."""
        node = self.node
        for out in outs:
            if isinstance(out, membership.SendHello):
                assert ch is not None
                await ch.send(Hello(v=node.flow.version, cert=node.cert))
            elif isinstance(out, membership.TellChildren):
                await node.tell_children(out.update)
            elif isinstance(out, membership.Probe):
                answer = await _probe(node, self.zt, out.parent, out.timeout_s)
                await self._do(up, ch, up.probed(answer, self.clock.now()))
            elif isinstance(out, membership.Leave):
                raise _Left(out)
            elif isinstance(out, membership.Dial):
                raise AssertionError(f"{out} while with {up.parent!r}")
            else:
                _log_membership(node, out)

    async def _stream(self, up: membership.Uplink, ch: Channel) -> None:
        """The parent's messages, one reader per lane: control (paths to the machine, work down the
        tree) never waits for the version stream, whose reader waits on commits (docs/transport.md)."""
        with unwrap_group():
            async with asyncio.TaskGroup() as tg:
                versions = tg.create_task(self._versions(ch))
                try:
                    await self._control(up, ch)
                except TransportClosed:
                    # the parent is gone: what is queued in the bulk lane (a commit under way, a seal
                    # that arrived) is still taken; the version reader then meets the close itself
                    await versions
                    raise

    async def _versions(self, ch: Channel) -> None:
        """The bulk lane: versions to the flow (a commit may wait here; credit holds the parent back)."""
        node = self.node
        while True:
            msg = await ch.recv(Lane.BULK)
            if not isinstance(msg.msg, DeltaManifest | DeltaChunk | DeltaSeal):
                ch.fault(f"a {type(msg.msg).__name__} from the parent")
                continue
            v = await node.flow.on_parent_message(msg)
            if v is not None:
                await ch.send(Have(v=v))
                await ch.send(Held(n=node.name, v=v))

    async def _control(self, up: membership.Uplink, ch: Channel) -> None:
        """The control lane: paths to the machine, work down the tree; never waits on a commit."""
        node = self.node
        worker = node.ref("worker")
        while True:
            msg = await ch.recv(Lane.CONTROL)
            m = msg.msg
            if isinstance(m, PathUpdate):
                await self._do(up, ch, up.path_moved(m.path, self.clock.now()))
            elif isinstance(m, Admitted):
                if node.on_admitted(m):
                    continue
                child = node.flow.channel(m.w)
                if not m.ok and child is not None:  # a member of this node's that lost its place
                    with contextlib.suppress(TransportClosed):
                        await child.close(m.reason or "no place in the pool")
                elif m.w in node.routes.via:
                    await node.down(m, tuple(msg.buffers))  # a join or an eviction that goes further down
                # else: the answer to a hello that stopped waiting (the member says hello again)
            elif isinstance(m, DOWN):
                if worker is not None and m.w == node.name:
                    await tell_or_drop(worker, msg)
                elif m.w in node.routes.via:
                    await node.down(m, tuple(msg.buffers))
                else:
                    ch.fault(f"a {type(m).__name__} for {m.w!r}, which is not below this node")
            elif isinstance(m, Signal):
                ch.fault("signalling on a version stream")
            else:
                ch.fault(f"a {type(m).__name__} from the parent")


def _log_membership(node: TreeView, e: membership.Event) -> None:
    if isinstance(e, membership.ParentAttached):
        log.info(PARENT_ATTACHED, parent=e.parent, version=node.flow.version, path=list(e.path), planned=e.planned)
    elif isinstance(e, membership.ParentRefused):
        log.info("parent_refused", parent=e.parent, reason=e.reason)
        if (
            node.cert is not None
            and e.reason.startswith("its certificate")
            and ("revoked" in e.reason or "expired" in e.reason)
        ):
            node.fail(f"refused by {e.parent}: {e.reason}")  # a member asks no more with a credential that ended
    elif isinstance(e, membership.ParentUnreachable):
        log.warning("parent_unreachable", parent=e.parent, reason=e.reason)
    elif isinstance(e, membership.ParentLost):
        log.warning(PARENT_LOST, parent=e.parent, reason=e.reason)
    elif isinstance(e, membership.ParentFailed):
        log.error(PARENT_FAILED, parent=e.parent, error=e.error, quarantine_s=e.quarantine_s)
    else:
        log.info(PARENT_RETURN, parent=e.parent, to=e.to, reason=e.reason)


async def _probe(node: TreeView, zt: NodeTransport, parent: str, timeout_s: float) -> object:
    """Ask ``parent`` whether it would take this node now (a `Hello` probe: answered, then closed).
    Returns its answer, None if there was none within ``timeout_s`` (or it could not be reached)."""
    addr = node.topo.node(parent).listen
    assert addr is not None
    try:
        ch = await zt.connect(parent, addr)
        try:
            async with node.clock.timeout(timeout_s):
                await ch.send(Hello(v=node.flow.version, probe=True, cert=node.cert))
                return (await ch.recv()).msg
        finally:
            await zt.disconnect(parent)
    except (TransportClosed, TimeoutError, AuroraError):
        return None


async def _dial_webrtc(
    rtc: WebRtcTransport, zt: NodeTransport, parent: str, addr: str, tg: asyncio.TaskGroup
) -> tuple[Channel, asyncio.Task[None]]:
    """A WebRTC channel to ``parent``, signalled over a ZeroMQ channel to the parent (the rendezvous).
    Returns the channel and the signalling loop, a task of ``tg`` (cancel it on leaving the parent)."""
    sig = await zt.connect(parent, addr)
    await sig.send(SignalHello())
    loop = tg.create_task(rtc.serve_signalling(sig, stamp=True))
    try:
        ch = await rtc.connect_via(parent, sig)
    except BaseException:
        loop.cancel()
        raise
    log.info(WEBRTC_PARENT_CONNECTED, parent=parent)
    return ch, loop


async def _signalling(rtc: WebRtcTransport, ch: Channel) -> None:
    """Answer a child's WebRTC offers on its signalling channel; ``from`` is the channel's own peer,
    so a child cannot speak for another."""
    log.info("signalling_for", child=ch.peer)
    await rtc.serve_signalling(ch, stamp=True)


__all__ = ["ChildrenActor", "Node", "NodeTransport", "PublisherActor", "ReporterActor", "TreeView", "UplinkActor"]
