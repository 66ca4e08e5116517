"""The tree that runs is the planned tree: a node whose planned parent starts late waits for it instead of
settling on a fallback, and children that failed over while their relay was down return to it once it
has been healthy a while (logged), so that a relay killed and restarted ends with its children back."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from aurora.actors.node import Node
from structlog.testing import capture_logs

from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import PARENT_ATTACHED, PARENT_RETURN
from aurora.node import run_node
from aurora.testing.links import LinkNet

TOPOLOGY = """
name: planned
regions: [{name: local}]
nodes:
  - {name: trainer, role: trainer, region: local, listen: "mem://trainer"}
  - {name: relay-a, role: relay, region: local, listen: "mem://relay-a", parent: trainer}
  - {name: r1, role: rollout, region: local, parent: relay-a, fallback_parents: [trainer]}
  - {name: r2, role: rollout, region: local, parent: relay-a, fallback_parents: [trainer]}
heartbeat: {interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}
learner: {kind: synthetic, params: 20000, tensors: 2, density: 0.05, interval_s: 0.2}
run: {steps: 100000}
"""


async def _until(cond: object, timeout_s: float, what: str) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # type: ignore[operator]  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_late_planned_parent_is_waited_for_and_a_restarted_relay_gets_its_children_back(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(TOPOLOGY)
    topo = load_topology(path)
    tree = plan(topo, str(path))
    net = LinkNet()
    nodes: dict[str, Node] = {}
    tasks: dict[str, asyncio.Task[None]] = {}
    transports = {}

    def start(name: str) -> None:
        t = net.transport(name, bind=topo.node(name).listen)
        transports[name] = t
        tasks[name] = asyncio.create_task(
            run_node(topo, tree, name, asyncio.Event(), transport=t, observe=lambda node: nodes.__setitem__(name, node))
        )

    def under(parent: str, *children: str) -> bool:
        return all(
            c in nodes and nodes[c].place.path == ("trainer", parent)[: 1 + (parent != "trainer")] for c in children
        )

    with capture_logs() as logs:
        start("trainer")
        start("r1")
        start("r2")
        await asyncio.sleep(2.0)  # the planned parent is late: the rollouts wait for it, not the fallback
        assert not any(c in nodes and nodes[c].place.path for c in ("r1", "r2"))
        start("relay-a")
        await _until(lambda: under("relay-a", "r1", "r2"), 30, "the rollouts under their planned relay")
        assert all(e["planned"] for e in logs if e["event"] == PARENT_ATTACHED)  # no fallback on the way
        # the relay dies: its children fail over to the trainer
        tasks.pop("relay-a").cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(transports["relay-a"].close())
        await _until(lambda: under("trainer", "r1", "r2"), 30, "the rollouts on their fallback")
        assert not nodes["r1"].report().planned
        # it comes back: once it has been healthy a while (5 × lost_after_s), they return to it
        start("relay-a")
        await _until(lambda: under("relay-a", "r1", "r2"), 30, "the rollouts back under the restarted relay")
        assert nodes["r1"].report().planned
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    returns = [e for e in logs if e["event"] == PARENT_RETURN]
    assert len(returns) >= 2  # both rollouts, logged
    assert all(e["to"] == "relay-a" and e["parent"] == "trainer" for e in returns)
