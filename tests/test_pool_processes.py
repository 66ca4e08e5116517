"""An elastic pool with real `aurora node` processes over CurveZMQ on loopback.

Two members join mid-run; a third finds the pool full and is refused; one member is killed with
SIGKILL, its place frees and the third, with its fresh credential, takes it and gets work. A key
with no certificate, one whose certificate another key signed, and an expired credential are
refused at the hello by the running parent, and so is a member revoked while it works (after the
trainer takes its place); a compromised relay (the test plays one) cannot make a
member of a forged certificate nor get work for a member without a place, and a channel that says
nothing is closed. `aurora status` lists the members. The run completes:
no prompt accepted twice, versions in order, and every node that stayed — the members too — ends
on the trainer's last version, bit-identical (`aurora.chaos.check` over every log).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.auth
from aurora.actors.node import HELLO_WAIT_S
from aurora.transport.zmq import CurveKeys, LinkConfig, ZmqTransport

from aurora.auth.keys import NodeKeys, generate_topology_keys
from aurora.auth.pool import Credential, enroll, member_name, write_credential
from aurora.chaos.check import check
from aurora.config.topology import load_topology
from aurora.errors import TransportClosed
from aurora.events import (
    NODE_STARTED,
    PARENT_ATTACHED,
    POOL_MEMBER_JOINED,
    POOL_MEMBER_LEFT,
    POOL_MEMBER_REFUSED,
    RESULT_ACCEPTED,
    WORK_STARTED,
)
from aurora.protocol.messages import Admitted, Hello, Join, Lane, MemberCert, PathUpdate, Refused, Want
from aurora.runtime.processes import node_argv
from tests.helpers import events_in, free_ports, log_events, version_in, wait_until

pytestmark = pytest.mark.slow  # about 90 s of real processes: CI runs it (make test with CI=true)

STEPS = 150
NAMED = ["trainer", "relay", "rollout-1"]
"""The named nodes that run; relay-2 is a compromised relay the test plays (with its key)."""


def _topology(path: Path) -> Path:
    p = free_ports(3)
    path.write_text(f"""
name: pool-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p[0]}"}}
  - {{name: relay, role: relay, region: local, listen: "tcp://127.0.0.1:{p[1]}", parent: trainer}}
  - {{name: relay-2, role: relay, region: local, listen: "tcp://127.0.0.1:{p[2]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: local, parent: relay}}
pools:
  - {{name: spot, parents: [relay, relay-2], max_size: 2}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
leases: {{ttl_s: 2.0, prompts_per_lease: 4, batch_s: 0.5}}
staleness: {{max_versions: 1}}
learner: {{kind: synthetic, model: {{preset: tiny}}, density: 0.02, samples_per_step: 16, step_s: 0.5}}
engine: {{kind: torch, model: {{preset: tiny}}, max_new_tokens: 8}}
run: {{steps: {STEPS}}}
keys: {{dir: keys}}
""")
    return path


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.topo_path = _topology(tmp / "t.yaml")
        self.topo = load_topology(self.topo_path)
        list(generate_topology_keys(self.topo, str(self.topo_path)))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def credential(self, label: str, ttl_s: float = 3600, now: float | None = None) -> tuple[Path, Credential]:
        cred = enroll(self.topo, str(self.topo_path), "spot", ttl_s, time.time() if now is None else now)
        path = self.tmp / f"{label}.json"
        write_credential(path, cred)
        return path, cred

    def start(self, name: str, argv: list[str] | None = None) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        argv = argv or node_argv(self.topo_path, name, log_level="debug" if name == "trainer" else "info")
        with self.logs[name].open("ab") as err:
            self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def start_member(self, cred_path: Path, cred: Credential) -> str:
        argv = [sys.executable, "-m", "aurora", "node", "--topology", str(self.topo_path)]
        self.start(cred.name, [*argv, "--pool", "spot", "--credential", str(cred_path)])
        return cred.name

    def ev(self, name: str, event: str) -> list[dict[str, Any]]:
        return events_in(self.logs[name], event) if name in self.logs else []

    def version(self, name: str) -> int:
        return version_in(self.logs[name], name == "trainer") if name in self.logs else -1


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for p in c.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


async def _as_relay_2(c: Cluster, forged: MemberCert) -> tuple[object, object, str]:
    """Play a compromised relay-2 at the trainer: the trainer's answers to a `Join` of a member with a
    forged certificate, and to a `Want` of a member that never joined; and how a channel that says
    nothing ends."""
    trainer_pub, _ = zmq.auth.load_certificate(str(c.tmp / "keys" / "trainer.key"))
    pub, sec = zmq.auth.load_certificate(str(c.tmp / "keys" / "relay-2.key_secret"))
    assert sec is not None
    cfg = LinkConfig(heartbeat_s=0.2, suspect_after_s=0.6, lost_after_s=1.2)
    addr = c.topo.node("trainer").listen or ""
    out: list[object] = []
    for first in (True, False):
        zt = ZmqTransport("relay-2", cfg=cfg, keys=NodeKeys(CurveKeys(pub, sec), {"trainer": trainer_pub}))
        async with asyncio.TaskGroup() as tg:
            await zt.start_in(tg)
            try:
                ch = await zt.connect("trainer", addr)
                if first:
                    await ch.send(Hello(v=None))
                    assert isinstance((await asyncio.wait_for(ch.recv(Lane.CONTROL), 15)).msg, PathUpdate)
                    await ch.send(Join(w=member_name("spot", forged.key), parent="relay-2", cert=forged))
                    await ch.send(Want(w=member_name("spot", CurveKeys.generate().public), n=4))
                    got = []
                    while len(got) < 2:
                        m = (await asyncio.wait_for(ch.recv(Lane.CONTROL), 15)).msg
                        if isinstance(m, Admitted):
                            got.append(m)
                    out += got
                else:  # says nothing: closed after the hello's deadline
                    with pytest.raises(TransportClosed) as closed:
                        await asyncio.wait_for(ch.recv(), HELLO_WAIT_S + 10)
                    out.append(str(closed.value))
            finally:
                await zt.close()
    return out[0], out[1], str(out[2])


async def _hello_answer(c: Cluster, key: CurveKeys, cert: MemberCert | None) -> object:
    """What the running relay answers a hello from ``key`` (claiming its member name) with ``cert``."""
    relay_pub, _ = zmq.auth.load_certificate(str(c.tmp / "keys" / "relay.key"))
    name = member_name("spot", key.public)
    cfg = LinkConfig(heartbeat_s=0.2, suspect_after_s=0.6, lost_after_s=1.2)
    zt = ZmqTransport(name, cfg=cfg, keys=NodeKeys(key, {"relay": relay_pub}))
    async with asyncio.TaskGroup() as tg:
        await zt.start_in(tg)
        try:
            ch = await zt.connect("relay", c.topo.node("relay").listen or "")
            await ch.send(Hello(v=None, cert=cert))
            return (await asyncio.wait_for(ch.recv(), 15)).msg
        finally:
            await zt.close()


def test_members_join_leave_and_are_refused_and_the_run_completes(cluster: Cluster) -> None:
    c = cluster
    c.start("trainer")
    c.start("relay")
    wait_until(lambda: c.ev("relay", PARENT_ATTACHED), 180, "the relay to attach")
    c.start("rollout-1")
    wait_until(lambda: c.version("trainer") >= 3, 180, "work under way")

    # two members join mid-run and get work
    m1 = c.start_member(*c.credential("m1"))
    m2 = c.start_member(*c.credential("m2"))
    joined = lambda: {e["member"] for e in c.ev("trainer", POOL_MEMBER_JOINED)}  # noqa: E731
    wait_until(lambda: {m1, m2} <= joined(), 120, "two members to join")
    wait_until(lambda: c.ev(m1, WORK_STARTED) and c.ev(m2, WORK_STARTED), 60, "the members to get work")

    # the pool is full: a third is refused (and keeps asking)
    m3_path, m3_cred = c.credential("m3")
    m3 = c.start_member(m3_path, m3_cred)
    wait_until(lambda: any(e["member"] == m3 for e in c.ev("trainer", POOL_MEMBER_REFUSED)), 60, "the full pool")
    assert any("is full (2 of 2" in e["reason"] for e in c.ev(m3, "parent_refused"))

    # refused at the hello by the running parent: no certificate, a forged one, an expired one
    stranger = CurveKeys.generate()
    answer = asyncio.run(_hello_answer(c, stranger, None))
    assert isinstance(answer, Refused)
    assert "shows its certificate" in answer.reason
    _, good = c.credential("m4")
    forged = MemberCert(pool="spot", key=stranger.public, expires=good.cert.expires, sig=good.cert.sig)
    answer = asyncio.run(_hello_answer(c, stranger, forged))
    assert isinstance(answer, Refused)
    assert "not signed by pool 'spot'" in answer.reason
    _, old = c.credential("m5", ttl_s=60, now=time.time() - 120)
    answer = asyncio.run(_hello_answer(c, old.curve, old.cert))
    assert isinstance(answer, Refused)
    assert "expired" in answer.reason

    # a compromised relay cannot make a member: the trainer checks the certificate itself, and gives
    # work to no member without a place; a channel that says nothing is closed
    joined_answer, want_answer, silent = asyncio.run(_as_relay_2(c, forged))
    assert isinstance(joined_answer, Admitted)
    assert not joined_answer.ok
    assert "not signed by pool 'spot'" in (joined_answer.reason or "")
    assert isinstance(want_answer, Admitted)
    assert not want_answer.ok
    assert "no place" in (want_answer.reason or "")
    assert "no first message" in silent

    # status lists the members
    out = subprocess.run(
        [sys.executable, "-m", "aurora", "status", str(c.topo_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"pool spot: 2 members  {' '.join(sorted([m1, m2]))}" in out.stdout, out.stdout

    # a member dies without a word: its place frees, and the third takes it and gets work
    assert c.version("trainer") < STEPS - 20, "the run ended before a member could be killed"
    os.killpg(c.procs[m1].pid, signal.SIGKILL)
    c.procs[m1].wait()
    wait_until(lambda: any(e["member"] == m1 for e in c.ev("trainer", POOL_MEMBER_LEFT)), 30, "m1's place to free")
    wait_until(lambda: m3 in joined() and c.ev(m3, WORK_STARTED), 60, "the third member to join and get work")

    # an operator revokes m2 while it works: it loses its place at its next work message, and is
    # refused at its next hello
    out = subprocess.run(
        [sys.executable, "-m", "aurora", "keys", "revoke", "--topology", str(c.topo_path), "--pool", "spot", m2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    wait_until(
        lambda: any(e["member"] == m2 and "revoked" in e["reason"] for e in c.ev("trainer", POOL_MEMBER_LEFT)),
        30,
        "m2 to lose its place",
    )
    wait_until(lambda: any("revoked" in e["reason"] for e in c.ev(m2, "parent_refused")), 30, "m2 to be refused")
    assert c.procs[m2].wait(30) != 0  # a member whose credential ended stops, saying why
    assert any("revoked" in e["reason"] for e in c.ev(m2, "node_failed"))

    stayed = [*NAMED[1:], m3]
    wait_until(lambda: all(c.version(n) >= STEPS for n in stayed), 240, f"version {STEPS} everywhere")
    lives = {n: [log_events(c.logs[n])] for n in ["trainer", *stayed]}
    for n in ["trainer", *stayed]:
        assert sum(e["event"] == NODE_STARTED for e in lives[n][0]) == 1, n
    report = check(lives, "trainer", c.topo.staleness.max_versions, STEPS)
    assert not report.violations, report.violations[:5]
    accepted_by = {e.get("worker") for e in c.ev("trainer", RESULT_ACCEPTED)}
    assert {m1, m2, m3, "rollout-1"} <= accepted_by


def test_a_member_stops_when_its_credential_expires(cluster: Cluster) -> None:
    """A member whose credential runs out while it works is cut off by its parent and stops by itself,
    its `aurora node` exiting non-zero with the reason."""
    c = cluster
    c.start("trainer")
    c.start("relay")
    wait_until(lambda: c.ev("relay", PARENT_ATTACHED), 180, "the relay to attach")
    path, cred = c.credential("short", ttl_s=25)
    m = c.start_member(path, cred)
    wait_until(lambda: c.ev(m, PARENT_ATTACHED), 60, "the member to attach")
    assert c.procs[m].wait(60) != 0
    assert any("expired" in e["reason"] for e in c.ev(m, "node_failed"))
