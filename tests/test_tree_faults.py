"""The whole tree in one process under hypothesis fault schedules (in-memory links).

Seven real nodes (`aurora.node.run_node`, the code `aurora node` runs) over
`aurora.testing.links`: nodes are killed (their tasks cancelled, their links dropped, as
in a crash) and restarted, links are partitioned and healed, in orders hypothesis picks.
After the schedule everything is healed and restarted, and the invariants are checked:

Every node keeps a store, so a restarted node resumes from what it had and catches up.

* every rollout converges to the trainer's last version, bit-exactly (its flow's weights
  and its engine's weights, read back, both hash to the trainer's digest);
* within one life, a node commits versions strictly in increasing order (none skipped
  back, none applied twice), and every committed digest is the one the trainer published;
* every prompt's result is accepted at most once per coordinator life;
* no accepted result was made more than ``staleness.max_versions`` versions before the
  trainer's version when it was accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from aurora.actors.node import Node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import CATCH_UP_SENT, NODE_RESUMED, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.node import run_node
from aurora.testing.links import LinkNet

STEPS = 8
TOPOLOGY = f"""
name: faults
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "mem://trainer"}}
  - {{name: relay-a, role: relay, region: local, listen: "mem://relay-a", parent: trainer}}
  - {{name: relay-b, role: relay, region: local, listen: "mem://relay-b", parent: trainer}}
  - {{name: r1, role: rollout, region: local, parent: relay-a, fallback_parents: [relay-b, trainer]}}
  - {{name: r2, role: rollout, region: local, parent: relay-a, fallback_parents: [trainer]}}
  - {{name: r3, role: rollout, region: local, parent: relay-b, fallback_parents: [relay-a, trainer]}}
  - {{name: r4, role: rollout, region: local, parent: relay-b, fallback_parents: [trainer]}}
heartbeat: {{interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}}
leases: {{ttl_s: 0.8, prompts_per_lease: 3, batch_s: 0.3}}
staleness: {{max_versions: 1}}
learner: {{kind: synthetic, params: 20000, tensors: 2, density: 0.05, samples_per_step: 6, step_s: 0.05}}
engine: {{kind: synthetic, max_new_tokens: 4, token_s: 0.01}}
run: {{steps: {STEPS}}}
"""
NODES = ["trainer", "relay-a", "relay-b", "r1", "r2", "r3", "r4"]
LINKS = [
    ("trainer", "relay-a"),
    ("trainer", "relay-b"),
    ("relay-a", "r1"),
    ("relay-a", "r2"),
    ("relay-b", "r3"),
    ("relay-b", "r4"),
    ("relay-b", "r1"),
    ("relay-a", "r3"),
    ("trainer", "r2"),
]

Op = tuple[Any, ...]
ops = st.lists(
    st.tuples(
        st.one_of(
            st.tuples(st.just("kill"), st.sampled_from(NODES)),
            st.tuples(st.just("partition"), st.sampled_from(LINKS)),
            st.tuples(st.just("heal")),
            st.tuples(st.just("restart")),
        ),
        st.floats(0.05, 0.6),
    ),
    max_size=6,
)


class Harness:
    def __init__(self, tmp: Path) -> None:
        path = tmp / "faults.yaml"
        path.write_text(TOPOLOGY)
        self.topo = load_topology(path)
        self.tree = plan(self.topo, str(path))
        self.store = tmp / "store"
        self.net = LinkNet()
        self.nodes: dict[str, Node] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.transports: dict[str, Any] = {}
        self.lives: list[dict[str, Any]] = []  # the log, with a marker at each node start
        self.pools: list[Any] = []

    def start(self, name: str) -> None:
        # until the new life is built (`observe`), the node is not there: its dead life's state must not
        # pass for converged (it did, and the check then read a new life's engine holding nothing yet)
        self.nodes.pop(name, None)
        spec = self.topo.node(name)
        t = self.net.transport(name, bind=spec.listen)
        self.transports[name] = t

        def seen(node: Node) -> None:
            self.nodes[name] = node
            self.lives.append({"event": "life", "node": name})
            if node.pool is not None:
                self.pools.append(node.pool)

        self.tasks[name] = asyncio.create_task(
            run_node(self.topo, self.tree, name, asyncio.Event(), store=self.store / name, transport=t, observe=seen)
        )

    async def kill(self, name: str) -> None:
        task = self.tasks.pop(name, None)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await self.transports[name].close()  # the OS closes a dead process's sockets

    def restart_dead(self) -> None:
        for n in NODES:
            if n not in self.tasks or self.tasks[n].done():
                if n in self.tasks and not self.tasks[n].cancelled() and self.tasks[n].exception():
                    raise self.tasks[n].exception()  # type: ignore[misc]
                self.start(n)

    def converged(self) -> bool:
        t = self.nodes.get("trainer")
        if t is None or t.flow.version != STEPS:
            return False
        for n in NODES[1:]:
            node = self.nodes.get(n)
            if node is None or node.flow.version != STEPS or node.flow.digest != t.flow.digest:
                return False
            if node.engine is not None and node.engine.version != STEPS:
                return False
        return True


async def _scenario(tmp: Path, schedule: list[tuple[Op, float]]) -> None:
    h = Harness(tmp)
    with capture_logs() as cap:
        h.lives = cap
        try:
            for n in NODES:
                h.start(n)
            await asyncio.sleep(0.3)
            for op, pause in schedule:
                if op[0] == "kill":
                    await h.kill(op[1])
                elif op[0] == "partition":
                    h.net.partition(*op[1])
                elif op[0] == "heal":
                    h.net.heal_all()
                else:
                    h.restart_dead()
                await asyncio.sleep(pause)
            h.net.heal_all()
            h.restart_dead()
            async with asyncio.timeout(60):
                while not h.converged():
                    await asyncio.sleep(0.05)
                    h.restart_dead()  # also raises a node's own error, if one ended with one
        finally:
            for n in list(h.tasks):
                await h.kill(n)
        events = list(cap)

    trainer = h.nodes["trainer"]
    digest = trainer.flow.digest
    assert digest is not None
    for n in NODES[1:]:
        node = h.nodes[n]
        assert node.flow.weights is not None
        assert node.flow.weights.digest() == digest, n
        if node.engine is not None:
            assert node.engine.weights().digest() == digest, n

    published: dict[int, str] = {}
    for e in events:
        if e["event"] == VERSION_PUBLISHED:
            assert published.setdefault(e["version"], e["digest"]) == e["digest"], "a version number reused"
    last: dict[str, int] = {}
    for e in events:
        if e["event"] == "life":
            last.pop(e["node"], None)
        elif e["event"] == VERSION_COMMITTED:
            n, v = e["node"], e["version"]
            assert v > last.get(n, -1), f"{n} committed {v} after {last.get(n)}"
            last[n] = v
            assert e["digest"] == published.get(v, e["digest"]), (n, v)

    k = h.topo.staleness.max_versions
    for pool in h.pools:
        items = [item for item, _, _, _ in pool.log]
        assert len(items) == len(set(items)), "a prompt's result was accepted twice"
        assert all(current - version <= k for _, _, version, current in pool.log)
    assert sum(len(p.log) for p in h.pools) >= 6  # work was done


def _faults(n: int) -> settings:
    return settings(
        deadline=None,
        derandomize=True,
        max_examples=n,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@_faults(5)
@given(schedule=ops)
def test_the_tree_converges_after_any_fault_schedule(
    tmp_path_factory: pytest.TempPathFactory, schedule: list[tuple[Op, float]]
) -> None:
    asyncio.run(_scenario(tmp_path_factory.mktemp("faults"), schedule))


@pytest.mark.slow
@_faults(30)
@given(schedule=ops)
def test_the_tree_converges_after_any_fault_schedule_many(
    tmp_path_factory: pytest.TempPathFactory, schedule: list[tuple[Op, float]]
) -> None:
    asyncio.run(_scenario(tmp_path_factory.mktemp("faults"), schedule))


async def test_an_actor_crash_loop_stops_the_node_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose engine fails every batch is restarted with backoff, then the node gives up."""
    from aurora.errors import RestartIntensityExceeded
    from aurora.rl.engines.synthetic import SyntheticEngine

    def broken(self: SyntheticEngine, prompts: Any, version: int, n: int = 1) -> Any:
        raise RuntimeError("the engine's device is gone")

    monkeypatch.setattr(SyntheticEngine, "generate", broken)
    monkeypatch.setattr("aurora.node.RESTART_WINDOW_S", 60.0)
    h = Harness(tmp_path)
    for n in ("trainer", "relay-a", "relay-b", "r1"):
        h.start(n)
    try:
        with pytest.raises(
            RestartIntensityExceeded, match=r"child 'worker' exited \(crash: RuntimeError\(\"the engine's"
        ):
            async with asyncio.timeout(60):
                await h.tasks["r1"]
        assert not h.tasks["trainer"].done()  # one node's failure is its own
    finally:
        for n in list(h.tasks):
            await h.kill(n)


async def test_a_node_far_behind_gets_one_composed_delta_and_a_restarted_relay_resumes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    with capture_logs() as logs:
        h.lives = logs
        try:
            for n in ("trainer", "relay-a", "relay-b", "r1", "r2"):
                h.start(n)

            # both have a version in their stores to resume from (logged once stored): a node that
            # attached late starts from a snapshot, and one killed before storing it has nothing
            def stored(n: str) -> bool:
                return any(e["event"] == VERSION_COMMITTED and e["node"] == n and e["version"] >= 2 for e in logs)

            async with asyncio.timeout(30):
                while not (stored("r1") and stored("relay-b")):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            await h.kill("r1")
            await h.kill("relay-b")
            behind = h.nodes["r1"].flow.version
            async with asyncio.timeout(30):  # the trainer moves on with r2's results
                while (h.nodes["trainer"].flow.version or 0) < (behind or 0) + 3:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            h.start("r1")
            h.start("relay-b")
            async with asyncio.timeout(30):
                # (a restarted node is in `h.nodes` once it has opened: the others may be done before then)
                caught_up = ("relay-a", "relay-b", "r1")
                while not all(n in h.nodes and h.nodes[n].flow.version == STEPS for n in caught_up):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            for n in list(h.tasks):
                await h.kill(n)
    assert len([e for e in logs if e["event"] == NODE_RESUMED]) == 2  # r1 and relay-b, from their stores
    composed = [e for e in logs if e["event"] == CATCH_UP_SENT and e.get("composed")]
    # (r1 may have been killed after committing its last version and before storing it)
    assert any(e["child"] == "r1" and (behind or 0) - 1 <= e["base"] <= (behind or 0) for e in composed), composed
    digest = h.nodes["trainer"].flow.digest
    assert all(h.nodes[n].flow.digest == digest for n in ("relay-a", "relay-b", "r1"))
