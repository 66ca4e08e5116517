"""One node of a topology as a process: a root supervisor over the node's actors.

`run_node` is the composition root for ``aurora node``. The node's state —
its `VersionFlow` (weights and recent deltas), its place in the tree, the
work routes, the trainer's `WorkPool` and store, a rollout's engine — is made
here and outlives its actors; the actors run under one `Supervisor`
(one_for_one), so a crashed actor restarts from that state, and a crash loop
escalates (`RestartIntensityExceeded`): the node exits non-zero saying which
actor and why. The actors:

* ``children`` (trainer, relays): accepts child connections; each child's
  first message is a ``version`` hello; then its ``version`` reports go to the
  flow and its work messages (``want``/``renew``/``result``) to the
  coordinator (trainer) or up to this node's parent (relay);
* ``uplink`` (relays, rollouts): dials the planned parent and, when it is lost
  (heartbeats), unreachable or refuses, the fallbacks in turn; on attach the
  node says which version it holds and catches up; the parent's stream feeds
  the flow, its work answers go to the worker or down to the right child;
* ``coordinator`` and ``publisher`` (trainer): leases prompts and gates results
  (`aurora.actors.work`); the learner steps every ``learner.interval_s``, or
  after ``learner.samples_per_step`` accepted results, and each version is
  stored before its last chunk leaves (a restarted trainer resumes from it);
* ``worker`` (rollouts with an ``engine`` section): generates, switching the
  engine's version only between batches.

A parent answers a child's hello with its path from the trainer, or refuses
the child while it is itself detached or when the child is its own ancestor;
a node whose parent's path comes to run through itself leaves that parent —
so failover never closes a cycle. Logs say what happened:
``version_published``, ``version_committed``, ``parent_attached``,
``parent_lost``, ``child_attached``, ``engine_switched``, ``step``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from aurora.actors.flow import VersionFlow
from aurora.actors.status import STATUS_EVERY_S, ClusterStatus
from aurora.actors.work import (
    DOWN,
    UP,
    Coordinator,
    Routes,
    Worker,
    WorkerStats,
    WorkPool,
    send_or_drop,
    tell_or_drop,
)  # fmt: skip
from aurora.transport.base import Channel, Transport
from aurora.transport.zmq import CurveKeys, LinkConfig, ZmqTransport

from aurora.codec import Weights
from aurora.codec.warm import warm_up
from aurora.config.plan import Tree
from aurora.config.rl import EngineSpec
from aurora.config.topology import Topology, WebRtcSpec
from aurora.errors import ConfigError, DeltaFormatError, ProtocolError, TransportClosed
from aurora.protocol.leases import LeaseHolder
from aurora.rl.engines import make_engine
from aurora.rl.learners import Learner, make_learner
from aurora.rl.tasks import make_task
from aurora.runtime import Actor, ActorRef, ChildSpec, Supervisor
from aurora.store import DeltaStore

if TYPE_CHECKING:  # aiortc is the webrtc extra: imported only where a topology uses WebRTC
    from aurora.transport.webrtc import WebRtcTransport

log = structlog.get_logger("aurora.node")

RETRY_PAUSE_S = 0.5
MAX_RESTARTS = 5
RESTART_WINDOW_S = 30.0


class NodeTransport(Transport, Protocol):
    """What a node needs from its transport: `Transport`, plus a listening address and hanging up."""

    address: str

    async def listen_in(self, tg: asyncio.TaskGroup) -> str: ...

    async def disconnect(self, peer: str) -> None: ...


async def run_node(topo: Topology, tree: Tree, name: str, stop: asyncio.Event, *, file: str | None = None,
                   store: Path | None = None, transport: NodeTransport | None = None,
                   observe: Callable[[Node], None] | None = None) -> None:  # fmt: skip
    """Run node ``name`` until ``stop`` is set; cancellation-safe (closes its transport).

    ``store``: the node's version store (resume from its latest version); None keeps none.
    ``transport``: default ZeroMQ from the topology (tests pass `aurora.testing.links`).
    ``observe``: called with the `Node` once it is built (tests read its state)."""
    try:
        spec = topo.node(name)
    except KeyError:
        raise ConfigError(f"no node named {name!r} (nodes: {', '.join(n.name for n in topo.nodes)})",
                          file=file) from None  # fmt: skip
    hb = topo.heartbeat
    cfg = LinkConfig(heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s, lost_after_s=hb.lost_after_s)
    structlog.contextvars.bind_contextvars(node=name, role=spec.role, region=spec.region)
    node = Node(name, topo, file)
    await asyncio.to_thread(warm_up)  # compile/load the codec kernels now, not during the first version
    if spec.role == "trainer":
        await node.open_trainer(store)
    else:
        await node.open_store(store)
        if spec.role == "rollout" and topo.engine is not None:
            node.engine = await asyncio.to_thread(make_engine, topo.engine)
    zt: NodeTransport = transport or ZmqTransport(name, cfg=cfg, bind=spec.listen, **curve_options(topo, name, file))
    if any(isinstance(n.transport, WebRtcSpec) for n in topo.nodes):
        node.rtc = _rtc(topo, name, file)
    if observe is not None:
        observe(node)
    parent = tree.parent[name]
    specs = _actor_specs(node, zt, tree, cfg.lost_after_s)
    sup = Supervisor(name, specs, max_restarts=MAX_RESTARTS, within_s=RESTART_WINDOW_S, backoff_s=0.2)
    node.sup = sup
    try:
        async with asyncio.TaskGroup() as tg:
            if spec.listen is not None:
                await zt.listen_in(tg)
            else:
                zt.start_in(tg)
            if node.rtc is not None:
                node.rtc.start_in(tg)
            sup_task = await sup.start_in(tg)
            log.info("node_started", listen=zt.address or None, parent=parent, actors=[c.name for c in specs])
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({stopping, sup_task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            log.info("node_stopping")
            sup.stop()
            try:
                await sup_task  # raises RestartIntensityExceeded if that is why it ended
            finally:
                await zt.close()
    except BaseExceptionGroup as eg:  # one error (a crash loop, a bind failure): raise it as itself
        if len(eg.exceptions) == 1 and isinstance(eg.exceptions[0], Exception):
            raise eg.exceptions[0] from None
        raise


def _actor_specs(node: Node, zt: NodeTransport, tree: Tree, lost_after_s: float) -> list[ChildSpec]:
    """The node's actors by role, in start order (see the module docstring)."""
    name, topo = node.name, node.topo
    spec, parent = topo.node(name), tree.parent[name]
    specs: list[ChildSpec] = []
    if spec.listen is not None:
        specs.append(ChildSpec("children", actor=lambda: _Children(node, zt)))
    if parent is not None:
        order = [parent, *tree.fallbacks.get(name, ())]
        specs.append(ChildSpec("uplink", actor=lambda: _Uplink(node, zt, order, lost_after_s)))
    if node.pool is not None:
        pool = node.pool
        specs.append(ChildSpec("coordinator", actor=lambda: Coordinator(pool, node.flow, node.down)))
        specs.append(ChildSpec("publisher", actor=lambda: _Publisher(node), restart="transient"))
    if spec.role != "trainer":
        specs.append(ChildSpec("reporter", actor=lambda: _Reporter(node)))
    if node.engine is not None:
        engine, holder, stats = node.engine, LeaseHolder(name), node.worker_stats
        specs.append(ChildSpec("worker", actor=lambda: Worker(name, engine, node.flow, node.up, topo.leases,
                                                              holder, stats)))  # fmt: skip
    return specs


def curve_options(topo: Topology, name: str, file: str | None) -> dict[str, Any]:
    """`ZmqTransport` keyword arguments for CurveZMQ when the topology sets keys: this node's key
    pair (its ``secret_key_file``, relative to the topology file), every node's public key as
    the servers' allowlist (a child may fail over to any parent), and the parents' public keys."""
    spec = topo.node(name)
    if spec.public_key is None or spec.secret_key_file is None:
        return {}
    import zmq.auth

    i = next(k for k, n in enumerate(topo.nodes) if n.name == name)
    where = Path(file).parent if file else Path()
    path = where / spec.secret_key_file
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the CurveZMQ secret key {path}: {e}", file=file,
                          path=f"nodes[{i}].secret_key_file") from None  # fmt: skip
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (give the .key_secret file)", file=file,
                          path=f"nodes[{i}].secret_key_file")  # fmt: skip
    if public.decode() != spec.public_key:
        raise ConfigError(f"the key pair in {path} does not match this node's public_key", file=file,
                          path=f"nodes[{i}].public_key")  # fmt: skip
    keys = {n.name: n.public_key.encode() for n in topo.nodes if n.public_key is not None}
    return {"curve": CurveKeys(public, secret), "allowed_clients": set(keys.values()), "server_keys": keys}


class Node:
    """State that outlives the node's actors (see the module docstring)."""

    def __init__(self, name: str, topo: Topology, file: str | None) -> None:
        self.name = name
        self.topo = topo
        self.file = file
        spec = topo.node(name)
        self.place = Place(name, [] if spec.role == "trainer" else None)
        self.flow = VersionFlow(name, None, None, full_weights=topo.sync.full_weights)
        self.routes = Routes()
        self.pool: WorkPool | None = None
        self.learner: Learner | None = None
        self.store: DeltaStore | None = None
        self.engine: Any = None
        self.worker_stats = WorkerStats()
        self.status = ClusterStatus([n.name for n in topo.nodes if n.role != "trainer"])
        self.sup: Supervisor | None = None
        self.rtc: WebRtcTransport | None = None
        """WebRTC: answers children that come over WebRTC, or dials this node's parent."""

    async def open_trainer(self, store: Path | None) -> None:
        """The learner, version 0 (or the store's latest), and the work pool on the task's prompts."""
        task = make_task(self.topo.task)
        if store is not None:
            self.store = DeltaStore(store)
        engine = self.topo.engine or EngineSpec()
        learner = make_learner(self.topo.learner, model=self.topo.model, task=task, temperature=engine.temperature,
                               checkpoint_dir=None if store is None else store / "checkpoints")  # fmt: skip
        self.learner = learner
        latest = None if self.store is None else self.store.latest()
        if latest is None:
            weights, version = await asyncio.to_thread(learner.initial), 0
            if self.store is not None:
                await asyncio.to_thread(self.store.put_anchor, 0, weights)
        else:
            assert self.store is not None
            weights = await asyncio.to_thread(self.store.get, latest)
            version = latest
            await asyncio.to_thread(learner.restore, weights, version)
            log.info("trainer_resumed", version=version, store=str(store), digest=weights.digest().hex()[:16])
        self.flow = VersionFlow(self.name, weights, version, full_weights=self.topo.sync.full_weights,
                                store=self.store)  # fmt: skip
        self.pool = WorkPool(self.topo.leases, self.topo.staleness.max_versions, task.prompts(learner.seed),
                             group_size=learner.group_size, batch=learner.batch_size,
                             steps=self.topo.run.steps)  # fmt: skip

    async def open_store(self, store: Path | None) -> None:
        """A relay's or rollout's store: resume from its latest version (then catch up from the parent)."""
        if store is None:
            return
        self.store = DeltaStore(store)
        latest = self.store.latest()
        weights = None if latest is None else await asyncio.to_thread(self.store.get, latest)
        if weights is not None:
            log.info("node_resumed", version=latest, store=str(store), digest=weights.digest().hex()[:16])
        self.flow = VersionFlow(self.name, weights, latest, full_weights=self.topo.sync.full_weights,
                                store=self.store)  # fmt: skip

    def ref(self, actor: str) -> ActorRef | None:
        assert self.sup is not None
        try:
            return self.sup.ref(actor)
        except KeyError:
            return None

    def report(self) -> dict[str, Any]:
        """This node's ``status`` report (see `aurora.actors.status`)."""
        r: dict[str, Any] = {"version": self.flow.version, "parent": self.place.path[-1] if self.place.path else None,
                             "bytes_in": self.flow.bytes_in}  # fmt: skip
        if self.engine is not None:
            w = self.worker_stats
            r |= {"completions": w.completions, "accepted": w.accepted, "rejected": w.rejected,
                  "tok_s": w.tokens / w.generate_s if w.generate_s else 0.0, "switches": w.switches,
                  "switch_ms": 1e3 * w.switch_s / w.switches if w.switches else 0.0}  # fmt: skip
        return r

    def on_status_message(self, header: Mapping[str, Any]) -> None:
        """Trainer: a ``held`` notice or a ``status`` report from a node below."""
        if header["k"] == "held":
            dt = self.status.on_held(str(header["n"]), int(header["v"]))
            if dt is not None:
                log.info("version_synced", version=int(header["v"]), sync_s=round(dt, 4))
        else:
            self.status.on_report(str(header["n"]), dict(header["r"]))

    def snapshot(self) -> dict[str, Any]:
        assert self.pool is not None
        return self.status.snapshot({"version": self.flow.version, **self.pool.stats()})

    async def up(self, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
        return await send_or_drop(self.place.parent, header, buffers)

    async def down(self, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
        child = self.routes.child_for(str(header["w"]))
        return await send_or_drop(None if child is None else self.place.children.get(child), header, buffers)


class _Publisher(Actor):
    """The trainer's learner loop: take a batch, step, publish (stored before its last chunk leaves).

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
        publishing: asyncio.Future[None] | None = None
        try:
            while learned < steps:
                if learner.batch_size:
                    batch = await pool.take(learner.batch_size, learned)
                else:
                    await asyncio.sleep(learner.interval_s)
                    batch = []
                try:
                    new = await asyncio.to_thread(learner.step, batch)
                except Exception:
                    if publishing is not None:
                        await publishing
                    raise
                if publishing is not None:
                    await publishing
                learned += 1
                publishing = asyncio.ensure_future(self._publish(new, len(batch), dict(learner.stats)))
            if publishing is not None:
                await publishing
        finally:
            if publishing is not None and not publishing.done():
                publishing.cancel()
        log.info("steps_done", steps=steps, version=node.flow.version)

    async def _publish(self, new: Weights, results: int, stats: dict[str, Any]) -> None:
        node, pool = self.node, self.node.pool
        assert pool is not None
        node.status.on_published((node.flow.version or 0) + 1, time.monotonic())
        if node.topo.sync.deliver:
            v = await node.flow.publish(new)  # stored before its last chunk leaves
        else:
            v = await node.flow.adopt(new)
        node.status.step = {"version": v, **stats, **node.flow.last_published}
        log.info("step", version=v, results=results, **stats, **pool.stats())


class _Reporter(Actor):
    """Sends this node's status report up the tree every `STATUS_EVERY_S`."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def main(self) -> None:
        while True:
            await self.node.up({"k": "status", "n": self.node.name, "r": self.node.report()}, ())
            await asyncio.sleep(STATUS_EVERY_S)


class _Children(Actor):
    """Accepts child connections and serves each in its own task."""

    def __init__(self, node: Node, zt: NodeTransport) -> None:
        self.node = node
        self.zt = zt

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            if self.node.rtc is not None:
                tg.create_task(self._accept(self.node.rtc, tg))
            await self._accept(self.zt, tg)

    async def _accept(self, t: Transport, tg: asyncio.TaskGroup) -> None:
        while True:
            ch = await t.accept()
            tg.create_task(_child(self.node, ch))


class _Uplink(Actor):
    """Keeps this node attached to the first parent in its order that accepts it."""

    def __init__(self, node: Node, zt: NodeTransport, order: list[str], lost_after_s: float) -> None:
        self.node = node
        self.zt = zt
        self.order = order
        self.lost_after_s = lost_after_s

    async def main(self) -> None:
        await _follow_parents(self.node, self.zt, self.order, self.lost_after_s)


@dataclass
class Place:
    """Where this node sits: its path from the trainer (None while detached from the tree).

    A detached relay refuses new children, and a node refuses a parent whose path contains
    itself, so failover can never close a cycle (two relays that both lost the trainer
    would otherwise adopt each other)."""

    name: str
    path: list[str] | None
    children: dict[str, Channel] = field(default_factory=dict)
    parent: Channel | None = None
    """The channel to the parent while attached."""

    def below(self) -> list[str]:
        assert self.path is not None
        return [*self.path, self.name]

    async def moved(self, path: list[str] | None) -> None:
        self.path = path
        if path is not None:
            for ch in list(self.children.values()):
                with contextlib.suppress(TransportClosed):
                    await ch.send({"k": "path", "path": self.below()})


async def _child(node: Node, ch: Channel) -> None:
    flow, place = node.flow, node.place
    try:
        hello = await ch.recv()
        if hello.header.get("k") == "status?" and node.pool is not None:
            await ch.send({"k": "status", "snap": node.snapshot()})
            await ch.close("status sent")
            return
        if hello.header.get("k") == "signal" and node.rtc is not None:
            await _signalling(node.rtc, ch)
            return
        if hello.header.get("k") != "version":
            log.warning("bad_hello", child=ch.peer, header=dict(hello.header))
            await ch.close("expected a version hello")
            return
        if place.path is None or ch.peer in place.path:
            why = "not attached to the tree" if place.path is None else "it is an ancestor of this node"
            log.info("child_refused", child=ch.peer, reason=why)
            await ch.send({"k": "refused", "reason": why})
            return
        v = hello.header.get("v")
        await ch.send({"k": "path", "path": place.below()})
        place.children[ch.peer] = ch
        log.info("child_attached", child=ch.peer, version=v)
        await flow.add_child(ch, None if v is None else int(v))
        coordinator = node.ref("coordinator")
        while True:
            msg = await ch.recv()
            k = msg.header.get("k")
            if k == "version":
                await flow.on_child_message(ch.peer, msg)
            elif k in ("held", "status"):
                if node.pool is not None:
                    node.on_status_message(msg.header)
                else:
                    await node.up(msg.header, ())
            elif k in UP:
                node.routes.learn(str(msg.header["w"]), ch.peer)
                if coordinator is not None:
                    await tell_or_drop(coordinator, msg)
                else:
                    await node.up(msg.header, tuple(msg.buffers))
    except TransportClosed as e:
        log.info("child_detached", child=ch.peer, reason=str(e))
    finally:
        if flow.children.get(ch.peer) is ch:
            flow.remove_child(ch.peer)
        if place.children.get(ch.peer) is ch:
            del place.children[ch.peer]


async def _follow_parents(node: Node, zt: NodeTransport, order: list[str], lost_after_s: float) -> None:
    """Stay attached to the first parent in ``order`` that accepts, moving on when one is lost."""
    i = 0
    while True:
        parent = order[i]
        await _stay_with(node, zt, parent, lost_after_s)
        await node.place.moved(None)
        await zt.disconnect(parent)
        i = (i + 1) % len(order)
        await asyncio.sleep(RETRY_PAUSE_S)


async def _stay_with(node: Node, zt: NodeTransport, parent: str, lost_after_s: float) -> None:
    """Dial ``parent`` and follow its stream until it is unreachable, refuses, is lost or fails;
    logs which."""
    flow, place = node.flow, node.place
    addr = node.topo.node(parent).listen
    assert addr is not None  # checked when the topology was loaded
    signalling: asyncio.Future[None] | None = None
    try:
        if node.rtc is not None and isinstance(node.topo.node(node.name).transport, WebRtcSpec):
            ch, signalling = await _dial_webrtc(node.rtc, zt, parent, addr)
        else:
            ch = await zt.connect(parent, addr)
    except TransportClosed as e:
        log.warning("parent_unreachable", parent=parent, reason=str(e))
        return
    try:
        async with asyncio.timeout(lost_after_s):
            await ch.send({"k": "version", "v": flow.version})  # waits until the parent is heard
            answer = (await ch.recv()).header
        if answer.get("k") == "path" and place.name not in answer.get("path", []):
            await place.moved(list(answer["path"]))
            place.parent = ch
            log.info("parent_attached", parent=parent, version=flow.version, path=place.path)
            await _from_parent(node, ch)
        else:
            log.info("parent_refused", parent=parent, reason=answer.get("reason", "a cycle"))
    except (TransportClosed, TimeoutError, _Cycle) as e:
        log.warning("parent_lost", parent=parent, reason=str(e) or "no answer")
    except (ProtocolError, DeltaFormatError) as e:  # a corrupt or out-of-order stream: try the next parent
        log.error("parent_failed", parent=parent, error=str(e))
    finally:
        place.parent = None
        if signalling is not None:
            signalling.cancel()
            await ch.close("leaving this parent")


def _rtc(topo: Topology, name: str, file: str | None) -> WebRtcTransport:
    try:
        from aurora.transport.webrtc import IceServer, RtcConfig, WebRtcTransport
    except ImportError as e:
        raise ConfigError(f"this topology uses WebRTC, which needs the webrtc extra (pip install "
                          f"'aurora-rl[webrtc]'): {e}", file=file) from None  # fmt: skip
    spec = topo.node(name)
    hb = topo.heartbeat
    ice: tuple[IceServer, ...] = ()
    if isinstance(spec.transport, WebRtcSpec):
        if spec.transport.rendezvous not in (None, spec.parent):
            i = next(k for k, n in enumerate(topo.nodes) if n.name == name)
            raise ConfigError("a rendezvous other than the node's parent is not supported yet (leave it unset)",
                              file=file, path=f"nodes[{i}].transport.rendezvous")  # fmt: skip
        ice = tuple(IceServer(s.urls, s.username, s.credential) for s in spec.transport.ice_servers)
    cfg = RtcConfig(ice_servers=ice, heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s,
                    lost_after_s=hb.lost_after_s)  # fmt: skip
    return WebRtcTransport(name, cfg)


async def _dial_webrtc(rtc: WebRtcTransport, zt: NodeTransport, parent: str,
                       addr: str) -> tuple[Channel, asyncio.Future[None]]:  # fmt: skip
    """A WebRTC channel to ``parent``, signalled over a ZeroMQ channel to the parent (the rendezvous).
    Returns the channel and the signalling loop (cancel it on leaving the parent)."""
    sig = await zt.connect(parent, addr)
    await sig.send({"k": "signal"})
    loop = asyncio.ensure_future(rtc.serve_signalling(sig))
    try:
        ch = await rtc.connect_via(parent, sig)
    except BaseException:
        loop.cancel()
        raise
    log.info("webrtc_parent_connected", parent=parent)
    return ch, loop


async def _signalling(rtc: WebRtcTransport, ch: Channel) -> None:
    """Answer a child's WebRTC offers on its signalling channel; ``from`` is the channel's own peer,
    so a child cannot speak for another."""
    log.info("signalling_for", child=ch.peer)
    with contextlib.suppress(TransportClosed):
        while True:
            h = (await ch.recv()).header
            rtc.on_signal({**h, "from": ch.peer}, ch)


class _Cycle(Exception):
    """The parent's new path runs through this node."""


async def _from_parent(node: Node, ch: Channel) -> None:
    flow, place = node.flow, node.place
    worker = node.ref("worker")
    while True:
        msg = await ch.recv()
        k = msg.header.get("k")
        if k == "path":
            path = list(msg.header["path"])
            if place.name in path:
                raise _Cycle(f"the parent's path {' -> '.join(path)} runs through this node")
            await place.moved(path)
        elif k in DOWN:
            if worker is not None:
                await tell_or_drop(worker, msg)
            else:
                await node.down(msg.header, tuple(msg.buffers))
        else:
            v = await flow.on_parent_message(msg)
            if v is not None:
                await ch.send({"k": "version", "v": v})
                await ch.send({"k": "held", "n": node.name, "v": v})
