"""One node of a topology as a process: weight versions over ZeroMQ down the planned relay tree.

`run_node` is the composition root for ``aurora node``. What runs today:

* every node holds a `VersionFlow`; a node with a ``listen`` address serves
  children (each child's first message is a ``version`` hello);
* the trainer publishes a version from its learner (`SyntheticLearner` until
  the RL issue) every ``learner.interval_s`` for ``run.steps`` steps;
* relays and rollouts dial their planned parent and, when it is lost
  (heartbeats), unreachable or refuses them, their fallbacks in turn; on
  attach they say which version they hold and catch up;
* a parent answers a child's hello with its path from the trainer, or
  refuses the child while it is itself detached or when the child is its own
  ancestor; a node whose parent's path comes to run through itself leaves
  that parent — so failover never closes a cycle.

Not here yet (issue 5 continues): leases and the coordinator, rollout
engines, WebRTC parents, CurveZMQ keys from the topology, a status channel.
Logs say what happened: ``version_published``, ``version_committed``,
``parent_attached``, ``parent_lost``, ``child_attached``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import structlog
from aurora.actors.flow import VersionFlow
from aurora.transport.base import Channel
from aurora.transport.zmq import LinkConfig, ZmqChannel, ZmqTransport

from aurora.config.plan import Tree
from aurora.config.topology import Topology
from aurora.errors import ConfigError, TransportClosed
from aurora.learner import SyntheticLearner

log = structlog.get_logger("aurora.node")

RETRY_PAUSE_S = 0.5


async def run_node(topo: Topology, tree: Tree, name: str, stop: asyncio.Event, *, file: str | None = None) -> None:
    """Run node ``name`` until ``stop`` is set; cancellation-safe (closes its sockets)."""
    try:
        spec = topo.node(name)
    except KeyError:
        raise ConfigError(f"no node named {name!r} (nodes: {', '.join(n.name for n in topo.nodes)})",
                          file=file) from None  # fmt: skip
    hb = topo.heartbeat
    cfg = LinkConfig(heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s, lost_after_s=hb.lost_after_s)
    learner = SyntheticLearner.from_section(topo.learner, file) if spec.role == "trainer" else None
    flow = VersionFlow(name, learner.initial() if learner else None, 0 if learner else None)
    zt = ZmqTransport(name, cfg=cfg, bind=spec.listen)
    place = Place(name, [] if spec.role == "trainer" else None)
    structlog.contextvars.bind_contextvars(node=name, role=spec.role, region=spec.region)
    async with asyncio.TaskGroup() as tg:
        tasks: list[asyncio.Task[None]] = []
        if spec.listen is not None:
            await zt.listen_in(tg)
            tasks.append(tg.create_task(_serve_children(zt, flow, place, tg)))
        else:
            zt.start_in(tg)
        parent = tree.parent[name]
        if parent is not None:
            order = [parent, *tree.fallbacks.get(name, ())]
            tasks.append(tg.create_task(_follow_parents(topo, zt, flow, place, order, cfg.lost_after_s)))
        if learner is not None:
            tasks.append(tg.create_task(_publish(flow, learner, topo.run.steps)))
        log.info("node_started", listen=zt.address or None, parent=parent)
        await stop.wait()
        log.info("node_stopping")
        for t in tasks:
            t.cancel()
        await zt.close()


async def _publish(flow: VersionFlow, learner: SyntheticLearner, steps: int) -> None:
    for _ in range(steps):
        await asyncio.sleep(learner.spec.interval_s)
        new = await asyncio.to_thread(learner.step, ())
        await flow.publish(new)
    log.info("steps_done", steps=steps, version=flow.version)


@dataclass
class Place:
    """Where this node sits: its path from the trainer (None while detached from the tree).

    A detached relay refuses new children, and a node refuses a parent whose path contains
    itself, so failover can never close a cycle (two relays that both lost the trainer
    would otherwise adopt each other)."""

    name: str
    path: list[str] | None
    children: dict[str, Channel] = field(default_factory=dict)

    def below(self) -> list[str]:
        assert self.path is not None
        return [*self.path, self.name]

    async def moved(self, path: list[str] | None) -> None:
        self.path = path
        if path is not None:
            for ch in list(self.children.values()):
                with contextlib.suppress(TransportClosed):
                    await ch.send({"k": "path", "path": self.below()})


async def _serve_children(zt: ZmqTransport, flow: VersionFlow, place: Place, tg: asyncio.TaskGroup) -> None:
    while True:
        ch = await zt.accept()
        tg.create_task(_child(flow, place, ch))


async def _child(flow: VersionFlow, place: Place, ch: ZmqChannel) -> None:
    try:
        hello = await ch.recv()
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
        while True:
            await flow.on_child_message(ch.peer, await ch.recv())
    except TransportClosed as e:
        log.info("child_detached", child=ch.peer, reason=str(e))
    finally:
        if flow.children.get(ch.peer) is ch:
            flow.remove_child(ch.peer)
        if place.children.get(ch.peer) is ch:
            del place.children[ch.peer]


async def _follow_parents(topo: Topology, zt: ZmqTransport, flow: VersionFlow, place: Place, order: list[str],
                          lost_after_s: float) -> None:  # fmt: skip
    """Stay attached to the first parent in ``order`` that accepts, moving on when one is lost."""
    i = 0
    while True:
        parent = order[i % len(order)]
        addr = topo.node(parent).listen
        assert addr is not None  # checked when the topology was loaded
        ch = await zt.connect(parent, addr)
        try:
            async with asyncio.timeout(lost_after_s):
                await ch.send({"k": "version", "v": flow.version})  # waits until the parent is heard
                answer = (await ch.recv()).header
            if answer.get("k") == "path" and place.name not in answer.get("path", []):
                await place.moved(list(answer["path"]))
                log.info("parent_attached", parent=parent, version=flow.version, path=place.path)
                await _from_parent(flow, place, ch)
            else:
                log.info("parent_refused", parent=parent, reason=answer.get("reason", "a cycle"))
        except (TransportClosed, TimeoutError, _Cycle) as e:
            log.warning("parent_lost", parent=parent, reason=str(e) or "no answer")
        await place.moved(None)
        await zt.disconnect(parent)
        i = (i + 1) % len(order)
        await asyncio.sleep(RETRY_PAUSE_S)


class _Cycle(Exception):
    """The parent's new path runs through this node."""


async def _from_parent(flow: VersionFlow, place: Place, ch: Channel) -> None:
    while True:
        msg = await ch.recv()
        if msg.header.get("k") == "path":
            path = list(msg.header["path"])
            if place.name in path:
                raise _Cycle(f"the parent's path {' -> '.join(path)} runs through this node")
            await place.moved(path)
            continue
        v = await flow.on_parent_message(msg)
        if v is not None:
            await ch.send({"k": "version", "v": v})
