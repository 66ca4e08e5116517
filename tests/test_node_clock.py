"""Whole nodes under the virtual clock: a trainer, a relay and a rollout (`run_node`, the code `aurora
node` runs) in one event loop over in-memory links with heartbeats, every timer on one
`VirtualClock` that moves only when nothing else can happen (`aurora.testing.timeline`). Deadlines
are met at their virtual instant, never polled for, so the test asserts them exactly — in the
seconds the work itself takes, not the minutes of virtual time it covers:

* the learner steps every ``learner.interval_s`` from the publisher's start;
* a worker renews its lease at half its TTL, and the trainer's lease then runs one TTL from the
  renewal;
* a parent that falls silent (a partition nobody reports) is declared lost exactly ``lost_after_s``
  after the child last heard it, and not before;
* a lease whose renewals stop expires at the trainer exactly at its expiry, and the worker gives it
  up at the same instant;
* no real-time timer is ever pending under the virtual clock (`Timeline.run_until` checks).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import structlog
from aurora.actors.node import Node
from structlog.testing import capture_logs

from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import LEASE_EXPIRED, LEASE_GIVEN_UP, PARENT_ATTACHED, PARENT_LOST, STEP
from aurora.node import run_node
from aurora.protocol.leases import Lease
from aurora.protocol.link import LinkTimings
from aurora.runtime import VirtualClock
from aurora.testing.links import LinkNet
from aurora.testing.timeline import Timeline

INTERVAL_S = 7.0
TTL_S = 8.0
LOST_AFTER_S = 3.0
TOPOLOGY = f"""
name: virtual
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "mem://trainer"}}
  - {{name: relay, role: relay, region: local, listen: "mem://relay", parent: trainer}}
  - {{name: r1, role: rollout, region: local, parent: relay, fallback_parents: [trainer]}}
heartbeat: {{interval_s: 0.5, suspect_after_s: 1.5, lost_after_s: {LOST_AFTER_S}}}
leases: {{ttl_s: {TTL_S}, prompts_per_lease: 1, batch_s: 1.0}}
learner: {{kind: synthetic, params: 4000, tensors: 2, density: 0.05, interval_s: {INTERVAL_S}}}
engine: {{kind: synthetic, max_new_tokens: 4}}
run: {{steps: 4}}
"""
NODES = ("trainer", "relay", "r1")


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


async def test_a_tree_of_nodes_keeps_its_deadlines_exactly_under_the_virtual_clock(tmp_path: Path) -> None:
    path = tmp_path / "virtual.yaml"
    path.write_text(TOPOLOGY)
    topo = load_topology(path)
    tree = plan(topo, str(path))
    hb = topo.heartbeat
    clock = VirtualClock(start=1000.0)
    net = LinkNet(timings=LinkTimings(hb.interval_s, hb.suspect_after_s, hb.lost_after_s), clock=clock)
    timeline = Timeline(clock)
    nodes: dict[str, Node] = {}
    started: dict[str, float] = {}
    stop = asyncio.Event()

    def seen(name: str, node: Node) -> None:
        nodes[name] = node
        started[name] = clock.now()
        if node.engine is not None:
            timeline.hold(node.engine.generate)  # generation takes as long as the test says

    def stamp(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event["t"] = clock.now()
        return event

    def events(kind: str, **fields: Any) -> list[dict[str, Any]]:
        return [e for e in logs if e["event"] == kind and all(e.get(k) == v for k, v in fields.items())]

    def lease_of(worker: str) -> Lease | None:
        pool = nodes["trainer"].pool
        assert pool is not None
        held = [lease for lease in pool.table.valid_leases(clock.now()) if lease.worker == worker]
        return held[0] if held else None

    with capture_logs(processors=[structlog.contextvars.merge_contextvars, stamp]) as logs, timeline.running():
        links = {n: net.transport(n, bind=topo.node(n).listen) for n in NODES}
        tasks = [
            asyncio.create_task(
                run_node(
                    topo,
                    tree,
                    n,
                    stop,
                    transport=links[n],
                    threads=1,
                    clock=clock,
                    observe=lambda node, n=n: seen(n, node),
                )
            )
            for n in NODES
        ]
        try:
            # the rollout attached under its relay, holding a lease while it generates (held back)
            await timeline.run_until(
                lambda: bool(events(PARENT_ATTACHED, node="r1")) and lease_of("r1") is not None,
                within_s=60,
                what="r1 attached and leasing",
            )
            lease = lease_of("r1")
            assert lease is not None
            granted = lease.granted_at
            assert _close(lease.expires_at, granted + TTL_S)

            # renewed at half its TTL (the worker's LeaseHolder deadline): one TTL from the renewal
            await timeline.run_until(
                lambda: (cur := lease_of("r1")) is not None and cur.expires_at > lease.expires_at,
                within_s=TTL_S,
                what="the lease renewed",
            )
            renewed = lease_of("r1")
            assert renewed is not None
            assert _close(clock.now(), granted + TTL_S / 2)
            assert _close(renewed.expires_at, granted + TTL_S / 2 + TTL_S)

            # the rollout cut off from both its parents, unannounced: heartbeats find it out
            ours = links["r1"].channels["relay"]
            cut_at = clock.now()
            net.silence("relay", "r1")
            net.silence("trainer", "r1")
            await timeline.run_until(
                lambda: bool(events(LEASE_EXPIRED, item=renewed.item)), within_s=2 * TTL_S, what="the lease expired"
            )
            (lost,) = events(PARENT_LOST, node="r1", parent="relay")
            assert ours.heard_at is not None and ours.heard_at <= cut_at  # noqa: PT018
            assert _close(lost["t"], ours.heard_at + LOST_AFTER_S), (lost, ours.heard_at)
            assert "peer lost: silent for 3.0 s" in lost["reason"]
            (expired,) = events(LEASE_EXPIRED, item=renewed.item)
            assert _close(expired["t"], renewed.expires_at)  # at its instant, not on a later poll
            (given_up,) = events(LEASE_GIVEN_UP, node="r1", item=renewed.item)
            assert _close(given_up["t"], renewed.expires_at)  # the worker's own clock says the same

            # the learner's versions, every interval_s from the publisher's start
            await timeline.run_until(lambda: len(events(STEP)) == 4, within_s=4 * INTERVAL_S, what="four steps")
            steps = [e["t"] for e in events(STEP)]
            assert all(_close(t, started["trainer"] + (k + 1) * INTERVAL_S) for k, t in enumerate(steps)), steps
        finally:
            stop.set()  # an orderly stop: the supervisors' shutdown timeouts run on the clock too
            with contextlib.suppress(AssertionError):
                await timeline.run_until(lambda: all(t.done() for t in tasks), within_s=60, what="the nodes stopped")
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results == [None] * len(NODES)  # each stopped by itself, none cancelled or failed
    assert clock.now() - 1000.0 >= 4 * INTERVAL_S  # half a minute of timers, met in the seconds the work took
