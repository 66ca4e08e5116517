"""One node of a topology as a process: a root supervisor over the node's actors.

`run_node` is the composition root for ``aurora node``. The node's state —
its `VersionFlow` (weights and recent deltas), its place in the tree, the
work routes, the trainer's `WorkPool` and store, a rollout's engine — is made
here and outlives its actors; the actors run under one `Supervisor`
(one_for_one), so a crashed actor restarts from that state, and a crash loop
escalates (`RestartIntensityExceeded`): the node exits non-zero saying which
actor and why. The actors:

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
* anything that goes wrong while serving one child closes that child's channel, and
  anything that goes wrong with a parent's stream makes the node leave that parent
  (`parent_failed`) and try the next: no peer can crash an actor or the node.

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
import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import msgspec
import structlog
from aurora.actors.coding import CodingPolicy
from aurora.actors.flow import VersionFlow
from aurora.actors.status import STATUS_EVERY_S, ClusterStatus
from aurora.actors.work import (
    Coordinator,
    Routes,
    WorkBoard,
    Worker,
    WorkerStats,
    send_or_drop,
    tell_or_drop,
)
from aurora.transport.base import Channel, Transport
from aurora.transport.zmq import LinkConfig, ZmqTransport

from aurora.auth.keys import OPERATOR, NodeKeys, exposed_nodes, load_node_keys
from aurora.auth.seal import Sealer, SealVerifier, state_hash, weights_layout
from aurora.codec import Weights
from aurora.codec.warm import warm_up
from aurora.config.plan import Tree
from aurora.config.rl import EngineSpec
from aurora.config.topology import Topology, WebRtcSpec
from aurora.errors import AuroraError, AuthError, ConfigError, StoreError, TransportClosed, peer_fault
from aurora.events import (
    CHILD_ATTACHED,
    NODE_RESUMED,
    NODE_STARTED,
    PARENT_ATTACHED,
    PARENT_FAILED,
    PARENT_LOST,
    PARENT_RETURN,
    RESULTS_RESTORED,
    STEP,
    STORE_VERSION_UNUSABLE,
    TRAINER_RESUMED,
    VERSION_SYNCED,
    WEBRTC_PARENT_CONNECTED,
)
from aurora.protocol import membership
from aurora.protocol.leases import LeaseHolder
from aurora.protocol.messages import (
    DOWN,
    MAX_MANIFEST_BYTES,
    UP,
    AppMessage,
    DeltaChunk,
    DeltaManifest,
    DeltaSeal,
    Have,
    Held,
    Hello,
    Lane,
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
from aurora.protocol.workpool import PoolSettings, ResultRules, WorkPool
from aurora.rl.engines import make_engine
from aurora.rl.learners import Learner, make_learner
from aurora.rl.tasks import make_task
from aurora.runtime import (
    Actor,
    ActorRef,
    ChildSpec,
    Clock,
    LoopClock,
    Supervisor,
    cancel_and_wait,
    in_thread,
    unwrap_group,
)
from aurora.store import DeltaStore
from aurora.store.journal import Replayed, ResultJournal

if TYPE_CHECKING:  # aiortc is the webrtc extra: imported only where a topology uses WebRTC
    from aurora.transport.webrtc import WebRtcTransport

log = structlog.get_logger("aurora.node")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 30.0


class NodeTransport(Transport, Protocol):
    """What a node needs from its transport: `Transport`, plus a listening address and hanging up."""

    address: str

    async def disconnect(self, peer: str) -> None: ...


async def run_node(
    topo: Topology,
    tree: Tree,
    name: str,
    stop: asyncio.Event,
    *,
    file: str | None = None,
    store: Path | None = None,
    transport: NodeTransport | None = None,
    observe: Callable[[Node], None] | None = None,
    insecure: bool = False,
    threads: int | None = None,
    clock: Clock | None = None,
) -> None:
    """Run node ``name`` until ``stop`` is set; cancellation-safe (closes its transport).

    ``store``: the node's version store (resume from its latest usable version); None keeps none.
    ``transport``: default ZeroMQ from the topology (tests pass `aurora.testing.links`).
    ``observe``: called with the `Node` once it is built (tests read its state).
    ``insecure``: run without keys although some node listens beyond loopback.
    ``threads``: cores the codec uses per version (None: `default_threads`).
    ``clock``: what every timer and deadline of the node reads — its actors, supervisor, flow and
    transports (default: real time; a test's `aurora.runtime.VirtualClock` runs the node in
    virtual time; a ``transport`` given brings its own, which should be the same)."""
    clock = clock or LoopClock()
    try:
        spec = topo.node(name)
    except KeyError:
        raise ConfigError(
            f"no node named {name!r} (nodes: {', '.join(n.name for n in topo.nodes)})", file=file
        ) from None
    keys = load_node_keys(topo, name, file)
    exposed = exposed_nodes(topo) if transport is None else []  # a test's in-memory links listen nowhere
    if not keys.secure and exposed and not insecure:
        raise ConfigError(
            f"{', '.join(exposed)} listen beyond loopback, and the topology has no keys: anyone who "
            "can reach them could join the tree. Make keys (aurora keys generate --topology FILE, "
            "then keys: {dir: ...}) or pass --insecure",
            file=file,
            path="keys",
        )
    hb = topo.heartbeat
    cfg = LinkConfig(
        heartbeat_s=hb.interval_s,
        suspect_after_s=hb.suspect_after_s,
        lost_after_s=hb.lost_after_s,
        max_frame_bytes=MAX_MANIFEST_BYTES + 64 * 1024,  # the largest message a node sends
    )
    structlog.contextvars.bind_contextvars(node=name, role=spec.role, region=spec.region)
    if not keys.secure:
        log.warning("unauthenticated", detail="no keys: peers are not authenticated and versions are not signed")
    node = Node(
        name, topo, tree, file, keys, threads=default_threads() if threads is None else max(1, threads), clock=clock
    )
    await in_thread(warm_up)  # compile/load the codec kernels now, not during the first version
    if spec.role == "trainer":
        await node.open_trainer(store)
    else:
        await node.open_store(store)
        if spec.role == "rollout" and topo.engine is not None:
            node.engine = await in_thread(make_engine, topo.engine)
    zt: NodeTransport = transport or ZmqTransport(name, cfg=cfg, bind=spec.listen, keys=keys, clock=clock)
    if any(isinstance(n.transport, WebRtcSpec) for n in topo.nodes):
        node.rtc = _rtc(topo, name, file, clock)
    if observe is not None:
        observe(node)
    parent = tree.parent[name]
    specs = _actor_specs(node, zt, tree, cfg.lost_after_s)
    sup = Supervisor(name, specs, max_restarts=MAX_RESTARTS, within_s=RESTART_WINDOW_S, backoff_s=0.2, clock=clock)
    node.sup = sup
    with unwrap_group():  # one error (a crash loop, a bind failure): raised as itself
        async with asyncio.TaskGroup() as tg:
            await zt.start_in(tg)
            if node.rtc is not None:
                await node.rtc.start_in(tg)
            node.flow.start_in(tg)  # its anchor writes: a crash in one is the node's
            sup_task = await sup.start_in(tg)
            log.info(
                NODE_STARTED,
                listen=zt.address or None,
                parent=parent,
                actors=[c.name for c in specs],
                codec_threads=node.threads,
                authenticated=keys.secure,
            )
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({stopping, sup_task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(stopping)
            log.info("node_stopping")
            sup.stop()
            try:
                await sup_task  # raises RestartIntensityExceeded if that is why it ended
            finally:
                await zt.close()


def _actor_specs(node: Node, zt: NodeTransport, tree: Tree, lost_after_s: float) -> list[ChildSpec]:
    """The node's actors by role, in start order (see the module docstring)."""
    name, topo = node.name, node.topo
    spec, parent = topo.node(name), tree.parent[name]
    specs: list[ChildSpec] = []
    if spec.listen is not None:
        specs.append(ChildSpec("children", actor=lambda: _Children(node, zt)))
    if parent is not None:
        specs.append(ChildSpec("uplink", actor=lambda: _Uplink(node, zt, lost_after_s)))
    if node.pool is not None:
        pool, board = node.pool, node.board
        specs.append(ChildSpec("coordinator", actor=lambda: Coordinator(pool, board, node.flow, node.down)))
        specs.append(ChildSpec("publisher", actor=lambda: _Publisher(node), restart="transient"))
    if spec.role != "trainer":
        specs.append(ChildSpec("reporter", actor=lambda: _Reporter(node)))
    if node.engine is not None:
        engine, holder, stats = node.engine, LeaseHolder(name), node.worker_stats
        specs.append(
            ChildSpec(
                "worker",
                actor=lambda: Worker(name, engine, node.flow, node.up, topo.leases, holder, stats, node.wait_attached),
            )
        )
    return specs


def default_threads() -> int:
    """The codec's cores when none are given: all this process may run on but one (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


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
        self.rules = membership.TreeRules(tree.parent, tree.fallbacks, self.role)
        """Who may attach where, and whom a child speaks for."""
        self.place = membership.Place(name, self.rules)
        """Where this node sits (its path; None while detached) and the parents it holds in quarantine."""
        self._parent: Channel | None = None
        self._parent_moved = asyncio.Event()
        self.verifier = SealVerifier(self.keys.verifier)
        self.flow: VersionFlow
        """The node's versions: built once, by `open_trainer` or `open_store`, from what the node starts with."""
        self.routes = Routes()
        self.pool: WorkPool | None = None
        self.board = WorkBoard()
        self.learner: Learner | None = None
        self.store: DeltaStore | None = None
        self.engine: Any = None
        self.worker_stats = WorkerStats()
        self.status = ClusterStatus(
            [n.name for n in topo.nodes if n.role != "trainer"],
            planned={n: p for n, p in tree.parent.items() if p is not None},
        )
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

    async def open_trainer(self, store: Path | None) -> None:
        """The learner, version 0 (or the store's latest), and the work pool on the task's prompts."""
        task = make_task(self.topo.task)
        if store is not None:
            self.store = DeltaStore(store)
        engine = self.topo.engine or EngineSpec()
        learner = make_learner(
            self.topo.learner,
            model=self.topo.model,
            task=task,
            temperature=engine.temperature,
            checkpoint_dir=None if store is None else store / "checkpoints",
            chat=self.topo.task.chat,
        )
        self.learner = learner
        sealer = Sealer(self.keys.signer, self.store.run if self.store is not None else secrets.token_bytes(16))
        latest = None if self.store is None else self.store.latest()
        if latest is None:
            weights, version = await in_thread(learner.initial), 0
        else:
            assert self.store is not None
            try:
                weights = await in_thread(self.store.get, latest)
            except StoreError as e:
                raise StoreError(f"the trainer cannot resume from its store: {e}") from None
            version = latest
            await in_thread(learner.restore, weights, version)
            log.info(TRAINER_RESUMED, version=version, store=str(store), digest=weights.digest().hex()[:16])
        self.flow = self._flow(
            weights,
            version,
            sealer=sealer,
            coding=CodingPolicy.of(self.topo, self.tree, lambda: self.status.slowest_link(self.clock.now())),
        )
        seal = await in_thread(self.flow.first_seal)
        if self.store is not None and latest is None:
            await in_thread(self.store.put_anchor, 0, weights, seal=seal)
        settings = PoolSettings(
            ttl_s=self.topo.leases.ttl_s,
            prompts_per_lease=self.topo.leases.prompts_per_lease,
            batch_s=self.topo.leases.batch_s,
            ahead_steps=self.topo.leases.ahead_steps,
            max_stale=self.topo.staleness.max_versions,
            max_life_s=self.topo.leases.max_life_s,
        )
        replayed = Replayed([], 0, 0)
        if store is not None:  # the acknowledged results no stored version trained on come back
            self.board.journal, replayed = await in_thread(ResultJournal.open, store, version)
            if latest is not None:
                log.info(
                    RESULTS_RESTORED,
                    items=[c.prompt_id for _, c in replayed.pending],
                    next=replayed.next_id,
                    done=replayed.done,
                )
        prompts = (
            replace(p, tokens=learner.tokenize(p)) for p in task.prompts(learner.seed) if p.id >= replayed.next_id
        )
        rules = ResultRules(vocab_size=learner.vocab_size, max_new_tokens=engine.max_new_tokens)
        self.pool = WorkPool(
            settings,
            prompts,
            rules,
            group_size=learner.group_size,
            batch=learner.batch_size,
            steps=self.topo.run.steps,
            mint=lambda: secrets.token_bytes(16),
        )
        self.pool.samples = list(replayed.pending)

    async def open_store(self, store: Path | None) -> None:
        """A relay's or rollout's store: resume from its newest usable version (then catch up from the
        parent). A version that is unreadable, or whose seal does not verify, is skipped and logged.
        Without a store, or with none usable, the node starts holding nothing."""
        if store is not None:
            self.store = DeltaStore(store)
            for v in reversed(self.store.versions()):
                try:
                    weights, seal = await in_thread(self._resume_from, v)
                except (StoreError, AuthError) as e:
                    log.warning(STORE_VERSION_UNUSABLE, version=v, store=str(store), error=str(e))
                    continue
                log.info(NODE_RESUMED, version=v, store=str(store), digest=weights.digest().hex()[:16])
                self.flow = self._flow(weights, v, seal=seal)
                return
        self.flow = self._flow(None, None)

    def _flow(
        self,
        weights: Weights | None,
        version: int | None,
        *,
        seal: Any = None,
        sealer: Sealer | None = None,
        coding: CodingPolicy | None = None,
    ) -> VersionFlow:
        """The node's `VersionFlow`, from what it starts with (the one place it is built)."""
        return VersionFlow(
            self.name,
            weights,
            version,
            full_weights=self.topo.sync.full_weights,
            store=self.store,
            sealer=sealer,
            verifier=self.verifier,
            seal=seal,
            threads=self.threads,
            coding=coding,
            clock=self.clock,
        )

    def _resume_from(self, v: int) -> tuple[Weights, Any]:
        """Version ``v`` from the store, checked against its seal (state hash: O(weights), once)."""
        assert self.store is not None
        weights = self.store.get(v)
        wire = self.store.seal(v)
        if self.verifier.authenticates:
            if wire is None:
                raise AuthError(f"version {v} in {self.store.root} was stored without a seal")
            seal = self.verifier.open(wire)
            if seal.v != v or seal.digest != weights.digest() or seal.layout != weights_layout(weights):
                raise AuthError(f"version {v}'s stored seal does not describe the stored weights")
            if state_hash(weights) != seal.state:
                raise AuthError(f"version {v} in {self.store.root} does not hash to its sealed state")
        return weights, wire

    def ref(self, actor: str) -> ActorRef | None:
        assert self.sup is not None
        try:
            return self.sup.ref(actor)
        except KeyError:
            return None

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
        else:
            self.status.on_report(m.n, m.r, self.clock.now())

    def snapshot(self) -> StatusSnapshot:
        assert self.pool is not None
        return StatusSnapshot(snap=self.status.snapshot(self.flow.version, self.pool.stats(), self.clock.now()))

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


class _Publisher(Actor):
    """The trainer's learner loop: take a batch, step, publish (stored before its seal leaves).

    The learner's next step overlaps the last one's publication: while version ``v`` is encoded
    and sent, the learner already takes its batch at ``v`` (the weights it holds) and trains
    ``v + 1``. Versions still go out in order, one at a time: ``v + 1`` is published once ``v``
    is. A learner that fails lets the publication in flight finish first, so every version the
    flow holds is one the learner made."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def main(self) -> None:
        node, learner, pool = self.node, self.node.learner, self.node.pool
        assert learner is not None
        assert pool is not None
        steps = node.topo.run.steps
        learned = node.flow.version or 0  # the learner's weights: published, or being published
        with unwrap_group():
            await self._steps(learner, pool, steps, learned)
        log.info("steps_done", steps=steps, version=node.flow.version)

    async def _steps(self, learner: Learner, pool: WorkPool, steps: int, learned: int) -> None:
        node = self.node
        async with asyncio.TaskGroup() as tg:
            publishing: asyncio.Task[None] | None = None
            while learned < steps:
                if learner.batch_size:
                    batch = await node.board.take(pool, learner.batch_size, learned)
                else:
                    await self.clock.sleep(learner.interval_s)
                    batch = []
                try:
                    new = await in_thread(learner.step, batch)
                except Exception:
                    if publishing is not None:
                        await publishing
                    raise
                if publishing is not None:
                    await publishing
                learned += 1
                publishing = tg.create_task(self._publish(new, len(batch), dict(learner.stats)))

    async def _publish(self, new: Weights, results: int, stats: dict[str, Any]) -> None:
        node, pool = self.node, self.node.pool
        assert pool is not None
        node.status.on_published((node.flow.version or 0) + 1, self.clock.now())
        if node.topo.sync.deliver:
            v = await node.flow.publish(new)  # stored before its seal leaves
        else:
            v = await node.flow.adopt(new)
        board = node.board
        board.room.set()  # a new version: work for it may be leased now
        checks = {"validate_us": round(1e6 * board.validate_s / board.results, 2) if board.results else None}
        node.status.step = {"version": v, **stats, **node.flow.last_published}
        log.info(STEP, version=v, results=results, **stats, **pool.stats(), **checks)


class _Reporter(Actor):
    """Sends this node's status report up the tree every `STATUS_EVERY_S`."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def main(self) -> None:
        while True:
            await self.node.up(Status(n=self.node.name, r=self.node.report()), ())
            await self.clock.sleep(STATUS_EVERY_S)


class _Children(Actor):
    """Accepts child connections and serves each in its own task; closes them all when it stops
    (so that children notice a restart of this actor and attach again)."""

    def __init__(self, node: Node, zt: NodeTransport) -> None:
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


async def _child(node: Node, ch: Channel) -> None:
    """Serve one child channel. Whatever goes wrong here closes this channel and no other."""
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


async def _serve_child(node: Node, ch: Channel) -> None:
    flow, place = node.flow, node.place
    hello = (await ch.recv()).msg
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
    if isinstance(answer, Refused):
        log.info("child_refused", child=ch.peer, reason=answer.reason, probe=hello.probe)
        await ch.send(answer)
        await ch.close("refused")
        return
    await ch.send(answer)
    if hello.probe:
        await ch.close("probe answered")
        return
    log.info(CHILD_ATTACHED, child=ch.peer, version=hello.v)
    flow.add_child(ch, hello.v)
    with unwrap_group():
        async with asyncio.TaskGroup() as tg:
            tg.create_task(flow.serve_child(ch))  # what goes down to this child: its own task
            await _from_child(node, ch)


async def _from_child(node: Node, ch: Channel) -> None:
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
            if not node.routes.learn(m.w, ch.peer, moves=isinstance(m, Want), open_children=node.flow.children):
                ch.fault(f"{ch.peer!r} sent {type(m).__name__} for {m.w!r}, whose work goes through another child")
                continue
            if coordinator is not None:
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


class _Uplink(Actor):
    """Keeps this node attached to the first parent in its order that accepts it: the driver of a
    `membership.Uplink`. It sleeps until the machine's next deadline, dials the parent it names, feeds
    it what that parent says and does, carries out its commands and logs its events. Its time is the
    actor's clock (the node's): the machine's ``now`` and every wait."""

    def __init__(self, node: Node, zt: NodeTransport, lost_after_s: float) -> None:
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
                await ch.send(Hello(v=node.flow.version))
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


def _log_membership(node: Node, e: membership.Event) -> None:
    if isinstance(e, membership.ParentAttached):
        log.info(PARENT_ATTACHED, parent=e.parent, version=node.flow.version, path=list(e.path), planned=e.planned)
    elif isinstance(e, membership.ParentRefused):
        log.info("parent_refused", parent=e.parent, reason=e.reason)
    elif isinstance(e, membership.ParentUnreachable):
        log.warning("parent_unreachable", parent=e.parent, reason=e.reason)
    elif isinstance(e, membership.ParentLost):
        log.warning(PARENT_LOST, parent=e.parent, reason=e.reason)
    elif isinstance(e, membership.ParentFailed):
        log.error(PARENT_FAILED, parent=e.parent, error=e.error, quarantine_s=e.quarantine_s)
    else:
        log.info(PARENT_RETURN, parent=e.parent, to=e.to, reason=e.reason)


async def _probe(node: Node, zt: NodeTransport, parent: str, timeout_s: float) -> object:
    """Ask ``parent`` whether it would take this node now (a `Hello` probe: answered, then closed).
    Returns its answer, None if there was none within ``timeout_s`` (or it could not be reached)."""
    addr = node.topo.node(parent).listen
    assert addr is not None
    try:
        ch = await zt.connect(parent, addr)
        try:
            async with node.clock.timeout(timeout_s):
                await ch.send(Hello(v=node.flow.version, probe=True))
                return (await ch.recv()).msg
        finally:
            await zt.disconnect(parent)
    except (TransportClosed, TimeoutError, AuroraError):
        return None


def _rtc(topo: Topology, name: str, file: str | None, clock: Clock) -> WebRtcTransport:
    try:
        from aurora.transport.webrtc import IceServer, RtcConfig, WebRtcTransport
    except ImportError as e:
        raise ConfigError(
            f"this topology uses WebRTC, which needs the webrtc extra (pip install 'aurora-rl[webrtc]'): {e}", file=file
        ) from None
    spec = topo.node(name)
    hb = topo.heartbeat
    ice: tuple[IceServer, ...] = ()
    if isinstance(spec.transport, WebRtcSpec):
        if spec.transport.rendezvous not in (None, spec.parent):
            i = next(k for k, n in enumerate(topo.nodes) if n.name == name)
            raise ConfigError(
                "a rendezvous other than the node's parent is not supported yet (leave it unset)",
                file=file,
                path=f"nodes[{i}].transport.rendezvous",
            )
        ice = tuple(IceServer(s.urls, s.username, s.credential) for s in spec.transport.ice_servers)
    cfg = RtcConfig(
        ice_servers=ice, heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s, lost_after_s=hb.lost_after_s
    )
    return WebRtcTransport(name, cfg, accepting=spec.listen is not None, clock=clock)


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


__all__ = ["Node", "run_node"]
