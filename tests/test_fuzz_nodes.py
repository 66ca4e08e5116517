"""Hostile peers against live nodes: malformed and out-of-place messages of every kind, derived from the
wire schemas (`aurora.testing.fuzz`), sent over real ZeroMQ sockets (CurveZMQ on, with a compromised
rollout's key) to a running trainer and relay — including the WebRTC signalling path.

Invariants: every node stays up and no actor crashes; the legitimate rollout keeps committing the
trainer's versions, bit-identical; memory stays bounded. 10,000 cases in CI's profile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from aurora.actors.node import Node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from aurora.auth.keys import generate_topology_keys, load_node_keys
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import BAD_FRAME, BAD_MESSAGE, CHILD_EXITED
from aurora.node import run_node
from aurora.protocol.messages import Hello, LinkBeat, LinkData, SignalHello, StatusQuery, encode_app, encode_link
from aurora.testing.fuzz import hostile_frames
from tests.helpers import free_ports

CASES = 10_000 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else 400
RUNNING = ("trainer", "relay", "rollout")


def _topology(tmp: Path) -> Path:
    p0, p1 = free_ports(2)
    path = tmp / "fuzz.yaml"
    path.write_text(f"""
name: fuzz
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p0}"}}
  - {{name: relay, role: relay, region: local, listen: "tcp://127.0.0.1:{p1}", parent: trainer}}
  - {{name: rollout, role: rollout, region: local, parent: relay}}
  - {{name: mallory, role: rollout, region: local, parent: relay}}
  - {{name: mallory-rtc, role: rollout, region: local, parent: relay, transport: {{kind: webrtc}}}}
keys: {{dir: keys}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
leases: {{ttl_s: 5.0, prompts_per_lease: 4}}
learner: {{kind: synthetic, params: 20000, tensors: 2, density: 0.05, samples_per_step: 4}}
engine: {{kind: synthetic, max_new_tokens: 4}}
run: {{steps: 100000}}
""")
    list(generate_topology_keys(load_topology(path), str(path)))
    return path


class Cluster:
    """trainer, relay and a legitimate rollout, in one event loop on a thread of their own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.topo = load_topology(path)
        self.nodes: dict[str, Node] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        tree = plan(self.topo, str(self.path))
        for n in RUNNING:
            self.tasks[n] = asyncio.create_task(
                run_node(
                    self.topo,
                    tree,
                    n,
                    self.stop,
                    file=str(self.path),
                    observe=lambda node, n=n: self.nodes.__setitem__(n, node),
                )
            )
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def version(self, name: str) -> int:
        node = self.nodes.get(name)
        return -1 if node is None or node.flow.version is None else node.flow.version

    def wait(self, cond: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert not any(t.done() for t in self.tasks.values()), "a node exited"
            time.sleep(0.05)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.loop.close()


class Attacker:
    """Raw DEALER sockets with mallory's key: whatever bytes it likes, to the trainer and the relay."""

    def __init__(self, cluster: Cluster) -> None:
        topo = cluster.topo
        keys = {n: load_node_keys(topo, n, str(cluster.path)) for n in ("mallory", "mallory-rtc")}
        self.ctx = zmq.Context()
        self.socks: dict[tuple[str, str], zmq.Socket[bytes]] = {}
        for who, k in keys.items():
            assert k.curve is not None
            for target in ("trainer", "relay"):
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDTIMEO, 2000)
                s.curve_secretkey, s.curve_publickey = k.curve.secret, k.curve.public
                s.curve_serverkey = k.public[target]
                s.connect(topo.node(target).listen or "")
                self.socks[(who, target)] = s
        self.seq = 0
        self.incarnation = time.time_ns() // 1000

    def send(
        self, who: str, target: str, frames: list[bytes], opener: str | None, claim: str | None, reincarnate: bool
    ) -> None:
        s = self.socks[(who, target)]
        self.seq += 1
        if reincarnate:
            self.incarnation += 1
        msgs = [[encode_link(LinkBeat(i=self.incarnation, s=self.seq, r=10**6, n=claim))]]
        if opener is not None:
            first = {"hello": Hello(v=None), "signal": SignalHello(), "status": StatusQuery()}[opener]
            msgs.append([encode_link(LinkData()), encode_app(first)])
        msgs.append(frames)
        for m in msgs:
            with contextlib.suppress(zmq.Again):  # the node reads at its pace; a dropped attack is fine
                s.send_multipart(m)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(_topology(tmp_path_factory.mktemp("fuzz")))
    c.thread.start()
    try:
        c.wait(lambda: c.version("rollout") >= 1, 120, "the legitimate rollout's first version")
        yield c
    finally:
        c.close()


CASE = st.tuples(
    st.sampled_from(["mallory", "mallory-rtc"]),
    st.sampled_from(["trainer", "relay"]),
    hostile_frames(),
    st.sampled_from([None, "hello", "hello", "signal", "status"]),
    st.sampled_from([None, "mallory", "relay", "rollout", "trainer"]),
    st.booleans(),
)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_hostile_frames_never_stop_a_node_nor_the_legitimate_stream(cluster: Cluster) -> None:
    attacker = Attacker(cluster)
    start_version, start_rss = cluster.version("rollout"), _rss_mb()
    sent = [0]

    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(CASE)
    def attack(case: tuple[str, str, list[bytes], str | None, str | None, bool]) -> None:
        who, target, frames, opener, claim, reincarnate = case
        attacker.send(who, target, frames, opener, claim, reincarnate and sent[0] % 7 == 0)
        sent[0] += 1
        if sent[0] % 500 == 0:
            assert not any(t.done() for t in cluster.tasks.values()), f"a node exited after {sent[0]} cases"

    with capture_logs() as logs:
        try:
            attack()
        finally:
            attacker.close()
        # the legitimate rollout still follows the trainer: new versions, bit-identical
        goal = max(start_version, cluster.version("trainer")) + 2
        cluster.wait(
            lambda: cluster.version("rollout") >= goal, 90, "the rollout to commit new versions after the attack"
        )
        trainer, rollout = cluster.nodes["trainer"], cluster.nodes["rollout"]
        cluster.wait(
            lambda: (rollout.flow.version, rollout.flow.digest) == (trainer.flow.version, trainer.flow.digest),
            30,
            "the rollout to hold the trainer's version, bit-identical",
        )
    assert sent[0] == CASES
    assert not any(t.done() for t in cluster.tasks.values()), "a node exited"
    crashes = [e for e in logs if e["event"] == CHILD_EXITED and e.get("exit") == "crash"]
    assert not crashes, crashes[:3]
    assert any(e["event"] in (BAD_MESSAGE, BAD_FRAME) for e in logs)  # the attack did reach the nodes
    assert _rss_mb() - start_rss < 400, f"memory grew by {_rss_mb() - start_rss:.0f} MB"
