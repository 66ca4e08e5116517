"""`run_node`: one node of a topology as a process — the composition root of `aurora node`.

It builds what outlives the node's actors (`aurora.actors.node.Node`: the node's `VersionFlow`, built
once from what it starts with; its place in the tree; the work routes; the trainer's learner,
`WorkPool`, store and result journal; a rollout's engine), the transports, and the actors — each
given the narrow part of that state it works on (`aurora.actors.node` says what each does) — under
one `Supervisor` (one_for_one): a crashed actor restarts from that state, and a crash loop
escalates (`RestartIntensityExceeded`), so the node exits non-zero saying which actor and why.

A trainer resumes from its store's newest version (a corrupt one is refused: it does not guess) and
takes back from its result journal every acknowledged result no stored version trained on
(`aurora.store.journal`); a relay or rollout resumes from its store's newest usable version (one
that does not read or verify is skipped and logged), then catches up from its parent.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from aurora.actors.coding import CodingPolicy
from aurora.actors.flow import VersionFlow
from aurora.actors.node import (
    ChildrenActor,
    Node,
    NodeTransport,
    PublisherActor,
    ReporterActor,
    UplinkActor,
)
from aurora.actors.work import ContinuousWorker, Coordinator, Worker
from aurora.auth.keys import exposed_nodes, load_member_keys, load_node_keys
from aurora.auth.pool import Credential, Revocations, member_name, pool_verifiers
from aurora.auth.seal import Sealer, state_hash, weights_layout
from aurora.codec import Weights
from aurora.codec.warm import warm_up
from aurora.config.plan import Tree
from aurora.config.rl import EngineSpec
from aurora.config.topology import NodeSpec, PoolSpec, Topology, WebRtcSpec
from aurora.errors import AuthError, ConfigError, StoreError
from aurora.events import NODE_RESUMED, NODE_STARTED, RESULTS_RESTORED, STORE_VERSION_UNUSABLE, TRAINER_RESUMED
from aurora.protocol.leases import LeaseHolder
from aurora.protocol.messages import MAX_MANIFEST_BYTES
from aurora.protocol.roster import member_pool
from aurora.protocol.workpool import PoolSettings, ResultRules, WorkPool
from aurora.rl.engines import make_engine
from aurora.rl.learners import Learner, make_learner
from aurora.rl.tasks import Task, make_task
from aurora.rl.types import Prompt
from aurora.runtime import ChildSpec, Clock, LoopClock, Supervisor, cancel_and_wait, in_thread, unwrap_group
from aurora.store import DeltaStore
from aurora.store.journal import Replayed, ResultJournal
from aurora.tracking import open_trackers
from aurora.transport.zmq import LinkConfig, ZmqTransport

if TYPE_CHECKING:  # aiortc is the webrtc extra: imported only where a topology uses WebRTC
    from aurora.transport.webrtc import WebRtcTransport

log = structlog.get_logger("aurora.node")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 30.0
"""A node's supervisor restarts a crashed actor at most `MAX_RESTARTS` times in this window; past it the node stops."""


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
    bind: str | None = None,
    credential: Credential | None = None,
    learner: Learner | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Run node ``name`` until ``stop`` is set; cancellation-safe (closes its transport).

    ``ready``: called once the node listens and its actors run.
    ``learner``: the trainer's learner, instead of the one the topology's ``learner`` section makes
    (`aurora.loop.TrainerLoop` passes the adapter of a training loop of its own).
    ``credential``: run as a member of the credential's pool (``name`` is then its member name,
    `aurora.auth.pool`), attached where the pool says.

    ``store``: the node's version store (resume from its latest usable version); None keeps none.
    ``transport``: default ZeroMQ from the topology (tests pass `aurora.testing.links`).
    ``observe``: called with the `Node` once it is built (tests read its state).
    ``insecure``: run without keys although some node listens beyond loopback.
    ``threads``: cores the codec uses per version (None: `default_threads`).
    ``clock``: what every timer and deadline of the node reads — its actors, supervisor, flow and
    transports (default: real time; a test's `aurora.runtime.VirtualClock` runs the node in
    virtual time; a ``transport`` given brings its own, which should be the same)."""
    clock = clock or LoopClock()
    if credential is not None:
        topo, tree, name = as_member(topo, tree, credential)
    try:
        spec = topo.node(name)
    except KeyError:
        raise ConfigError(
            f"no node named {name!r} (nodes: {', '.join(n.name for n in topo.nodes)})", file=file
        ) from None
    keys = (
        load_node_keys(topo, name, file) if credential is None else load_member_keys(topo, file, name, credential.curve)
    )
    pools_here = [p for p in topo.pools if name in p.parents]
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
    if credential is not None:
        node.cert = credential.cert
    if (pools_here or spec.role == "trainer") and topo.pools and keys.secure:
        node.pool_keys = pool_verifiers(topo, file)  # a pool's parents check members' certificates, the trainer again
        node.revocations = Revocations(topo, file)
    await in_thread(warm_up)  # compile/load the codec kernels now, not during the first version
    if spec.role == "trainer":
        await open_trainer(node, store, learner)
    else:
        await open_store(node, store)
        if spec.role == "rollout" and topo.engine is not None:
            node.engine = await in_thread(make_engine, spec.engine or topo.engine)
            if getattr(node.engine, "continuous", False):
                await node.engine.start()  # vLLM's engine core: a process of its own, on this event loop
    try:
        zt: NodeTransport = transport or ZmqTransport(
            name,
            cfg=cfg,
            bind=bind or spec.listen,
            keys=keys,
            members=_members_rule(pools_here) if pools_here else None,
            clock=clock,
        )
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
                if ready is not None:
                    ready()
                stopping = asyncio.ensure_future(stop.wait())
                failing = asyncio.ensure_future(node.failed.wait())  # a pool member's credential refused
                expiring = None
                if credential is not None:  # a member stops at its credential's expiry (wall-clock)
                    expiring = asyncio.ensure_future(clock.sleep(max(0.0, credential.cert.expires - time.time())))
                waits = {stopping, failing, sup_task, *([expiring] if expiring is not None else [])}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in (stopping, failing, expiring):
                        if w is not None:
                            await cancel_and_wait(w)
                if expiring is not None and expiring.done() and not expiring.cancelled():
                    node.fail("its pool credential expired: enroll a new one (aurora keys enroll)")
                log.info("node_stopping")
                sup.stop()
                try:
                    await sup_task  # raises RestartIntensityExceeded if that is why it ended
                finally:
                    await zt.close()
                if node.failure is not None:
                    raise AuthError(f"{name}: {node.failure}")
    finally:
        node.tracker.close()  # the trainer's TensorBoard/W&B files flushed, however the node ends
        if getattr(node.engine, "continuous", False):
            await node.engine.close()  # its engine core process (or the vllm serve it launched) ends with the node


def as_member(topo: Topology, tree: Tree, credential: Credential) -> tuple[Topology, Tree, str]:
    """The topology and tree as a pool member sees them: itself added, a rollout of its pool's region
    under the pool's first parent, the others its fallbacks (the named nodes know it by its pool)."""
    pool = topo.pool(credential.cert.pool)
    name = credential.name
    if name in tree.parent:
        return topo, tree, name  # already added
    me = NodeSpec(
        name=name,
        role="rollout",
        region=topo.pool_region(pool),
        parent=pool.parents[0],
        fallback_parents=pool.parents[1:],
    )
    tree = replace(
        tree,
        parent={**tree.parent, name: pool.parents[0]},
        fallbacks={**tree.fallbacks, name: pool.parents[1:]},
        finish_s={**tree.finish_s, name: 0.0},
    )
    return replace(topo, nodes=(*topo.nodes, me)), tree, name


def _members_rule(pools: list[PoolSpec]) -> Callable[[str, bytes], bool]:
    """Whether a CurveZMQ key is that of the pool member it claims to be (of a pool parented here)."""
    names = {p.name: p for p in pools}

    def rule(claimed: str, key: bytes) -> bool:
        pool = member_pool(claimed, names)
        return pool is not None and member_name(pool, key) == claimed

    return rule


def _actor_specs(node: Node, zt: NodeTransport, tree: Tree, lost_after_s: float) -> list[ChildSpec]:
    """The node's actors by role, in start order (see the module docstring)."""
    name, topo = node.name, node.topo
    spec, parent = topo.node(name), tree.parent[name]
    specs: list[ChildSpec] = []
    if spec.listen is not None:
        specs.append(ChildSpec("children", actor=lambda: ChildrenActor(node, zt)))
    if parent is not None:
        specs.append(ChildSpec("uplink", actor=lambda: UplinkActor(node, zt, lost_after_s)))
    if node.pool is not None:
        pool, board, learner = node.pool, node.board, node.learner
        assert learner is not None
        specs.append(
            ChildSpec("coordinator", actor=lambda: Coordinator(pool, board, node.flow, node.down, node.may_work))
        )
        specs.append(
            ChildSpec(
                "publisher",
                actor=lambda: PublisherActor(
                    learner, pool, board, node.flow, node.status, topo.run.steps, topo.sync.deliver, node.tracker
                ),
                restart="transient",
            )
        )
    if spec.role != "trainer":
        specs.append(ChildSpec("reporter", actor=lambda: ReporterActor(name, node.report, node.up)))
    if node.engine is not None:
        engine, holder, stats = node.engine, LeaseHolder(name), node.worker_stats
        specs.append(
            ChildSpec(
                "worker",
                actor=lambda: (ContinuousWorker if getattr(engine, "continuous", False) else Worker)(
                    name, engine, node.flow, node.up, topo.leases, holder, stats, node.wait_attached
                ),
            )
        )
    return specs


def default_threads() -> int:
    """The codec's cores when none are given: all this process may run on but one (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def trainer_learner(topo: Topology, store: Path | None, task: Task | None = None) -> Learner:
    """The learner a trainer of ``topo`` runs, its checkpoints in ``store`` (the same on every rank of a
    sharded learner: rank 0 in the node, the others following it)."""
    engine = topo.engine or EngineSpec()
    return make_learner(
        topo.learner,
        model=topo.model,
        task=task or make_task(topo.task),
        temperature=engine.temperature,
        checkpoint_dir=None if store is None else store / "checkpoints",
        chat=topo.task.chat,
        max_new_tokens=engine.max_new_tokens,
    )


async def open_trainer(node: Node, store: Path | None, learner: Learner | None = None) -> None:
    """The learner (``learner``, or the topology's), version 0 (or the store's latest), and the work
    pool on the task's prompts."""
    task = make_task(node.topo.task)
    if store is not None:
        node.store = DeltaStore(store)
    learner = learner or trainer_learner(node.topo, store, task)
    node.learner = learner
    if store is not None:
        config = {"topology": node.topo.name, "task": asdict(node.topo.task), "learner": asdict(node.topo.learner)}
        node.tracker = open_trackers(store, node.topo.name, config)
    sealer = Sealer(node.keys.signer, node.store.run if node.store is not None else secrets.token_bytes(16))
    latest = None if node.store is None else node.store.latest()
    if latest is None:
        weights, version = await in_thread(learner.initial), 0
    else:
        assert node.store is not None
        try:
            weights = await in_thread(node.store.get, latest)
        except StoreError as e:
            raise StoreError(f"the trainer cannot resume from its store: {e}") from None
        version = latest
        await in_thread(learner.restore, weights, version)
        log.info(TRAINER_RESUMED, version=version, store=str(store), digest=weights.digest().hex()[:16])
    node.flow = _make_flow(
        node,
        weights,
        version,
        sealer=sealer,
        coding=CodingPolicy.of(node.topo, node.tree, lambda: node.status.slowest_link(node.clock.now())),
    )
    seal = await in_thread(node.flow.first_seal)
    if node.store is not None and latest is None:
        await in_thread(node.store.put_anchor, 0, weights, seal=seal)
    settings = PoolSettings(
        ttl_s=node.topo.leases.ttl_s,
        prompts_per_lease=node.topo.leases.prompts_per_lease,
        batch_s=node.topo.leases.batch_s,
        ahead_steps=node.topo.leases.ahead_steps,
        max_stale=node.topo.staleness.max_versions,
        max_life_s=node.topo.leases.max_life_s,
    )
    replayed = Replayed([], 0, 0)
    if store is not None:  # the acknowledged results no stored version trained on come back
        node.board.journal, replayed = await in_thread(ResultJournal.open, store, version)
        if latest is not None:
            log.info(
                RESULTS_RESTORED,
                items=[c.prompt_id for _, c in replayed.pending],
                next=replayed.next_id,
                done=replayed.done,
            )
    # the task's stream, past every prompt id the journal has seen (skipped here, in a thread, not at the first want)
    stream = await in_thread(_past, task.prompts(learner.seed), replayed.next_id)
    prompts = (replace(p, tokens=learner.tokenize(p)) for p in stream)
    engine = node.topo.engine or EngineSpec()
    rules = ResultRules(vocab_size=learner.vocab_size, max_new_tokens=engine.max_new_tokens)
    node.pool = WorkPool(
        settings,
        prompts,
        rules,
        group_size=learner.group_size,
        batch=learner.batch_size,
        steps=node.topo.run.steps,
        mint=lambda: secrets.token_bytes(16),
    )
    node.pool.samples = list(replayed.pending)


async def open_store(node: Node, store: Path | None) -> None:
    """A relay's or rollout's store: resume from its newest usable version (then catch up from the
    parent). A version that is unreadable, or whose seal does not verify, is skipped and logged.
    Without a store, or with none usable, the node starts holding nothing."""
    if store is not None:
        node.store = DeltaStore(store)
        for v in reversed(node.store.versions()):
            try:
                weights, seal = await in_thread(_resume_from, node, v)
            except (StoreError, AuthError) as e:
                log.warning(STORE_VERSION_UNUSABLE, version=v, store=str(store), error=str(e))
                continue
            log.info(NODE_RESUMED, version=v, store=str(store), digest=weights.digest().hex()[:16])
            node.flow = _make_flow(node, weights, v, seal=seal)
            return
    node.flow = _make_flow(node, None, None)


def _past(stream: Iterator[Prompt], next_id: int) -> Iterator[Prompt]:
    """``stream`` from its first prompt with an id of at least ``next_id`` on (the ones before drawn now)."""
    for p in stream:
        if p.id >= next_id:
            return itertools.chain([p], stream)
    return iter(())


def _make_flow(
    node: Node,
    weights: Weights | None,
    version: int | None,
    *,
    seal: Any = None,
    sealer: Sealer | None = None,
    coding: CodingPolicy | None = None,
) -> VersionFlow:
    """The node's `VersionFlow`, from what it starts with (the one place it is built)."""
    return VersionFlow(
        node.name,
        weights,
        version,
        full_weights=node.topo.sync.full_weights,
        store=node.store,
        sealer=sealer,
        verifier=node.verifier,
        seal=seal,
        threads=node.threads,
        coding=coding,
        clock=node.clock,
    )


def _resume_from(node: Node, v: int) -> tuple[Weights, Any]:
    """Version ``v`` from the store, checked against its seal (state hash: O(weights), once)."""
    assert node.store is not None
    weights = node.store.get(v)
    wire = node.store.seal(v)
    if node.verifier.authenticates:
        if wire is None:
            raise AuthError(f"version {v} in {node.store.root} was stored without a seal")
        seal = node.verifier.open(wire)
        if seal.v != v or seal.digest != weights.digest() or seal.layout != weights_layout(weights):
            raise AuthError(f"version {v}'s stored seal does not describe the stored weights")
        if state_hash(weights) != seal.state:
            raise AuthError(f"version {v} in {node.store.root} does not hash to its sealed state")
    return weights, wire


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
