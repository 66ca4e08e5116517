"""A compromised relay (a real relay process that alters every delta and snapshot it sends and re-makes
every digest it can, `tests.tampering_relay`): its children refuse every altered version, leave it for
their fallback parent, do not go back to it, and end bit-identical to the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aurora.actors.node import Node
from structlog.testing import capture_logs

from aurora.auth.keys import generate_topology_keys
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import PARENT_ATTACHED, PARENT_FAILED, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.node import run_node
from tests.helpers import free_ports

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
"""Versions the trainer publishes (one every 0.3 s): the run outlasts the tampering relay's start-up on a
loaded machine (its children try it, their planned parent, until it answers), so they commit several."""


def _topology(tmp: Path) -> Path:
    p0, p1 = free_ports(2)
    path = tmp / "t.yaml"
    path.write_text(f"""
name: tamper
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p0}"}}
  - {{name: relay-bad, role: relay, region: local, listen: "tcp://127.0.0.1:{p1}", parent: trainer}}
  - {{name: r1, role: rollout, region: local, parent: relay-bad, fallback_parents: [trainer]}}
  - {{name: r2, role: rollout, region: local, parent: relay-bad, fallback_parents: [trainer]}}
keys: {{dir: keys}}
heartbeat: {{interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}}
learner: {{kind: synthetic, params: 20000, tensors: 2, density: 0.05, interval_s: 0.3}}
run: {{steps: {STEPS}}}
""")
    list(generate_topology_keys(load_topology(path), str(path)))
    return path


@pytest.fixture
def bad_relay(tmp_path: Path) -> Iterator[Path]:
    """The topology, with the tampering relay running as its own process (its log in relay.log)."""
    path = _topology(tmp_path)
    with (tmp_path / "relay.log").open("wb") as log:
        relay = subprocess.Popen(
            [sys.executable, "-m", "tests.tampering_relay", "--topology", str(path), "--name", "relay-bad"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        yield path
    finally:
        os.killpg(relay.pid, signal.SIGTERM)
        relay.wait(30)


async def test_children_of_a_tampering_relay_refuse_its_versions_and_end_bit_identical(bad_relay: Path) -> None:
    path, tmp_path = bad_relay, bad_relay.parent
    topo = load_topology(path)
    tree = plan(topo, str(path))
    nodes: dict[str, Node] = {}
    stop = asyncio.Event()
    with capture_logs() as logs:
        tasks = [
            asyncio.create_task(
                run_node(topo, tree, n, stop, file=str(path), observe=lambda node, n=n: nodes.__setitem__(n, node))
            )
            for n in ("trainer", "r1", "r2")
        ]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(120):
                while not all(n in nodes and nodes[n].flow.version == STEPS for n in ("trainer", "r1", "r2")):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
    relay_log = (tmp_path / "relay.log").read_text()
    assert '"parent_attached"' in relay_log  # the relay itself ran, attached to the trainer, and served
    for r in ("r1", "r2"):
        assert nodes[r].flow.version == STEPS, f"{r} did not reach the last version"
        assert nodes[r].flow.digest == nodes["trainer"].flow.digest
    published = {e["version"]: e["digest"] for e in logs if e["event"] == VERSION_PUBLISHED}
    commits = [e for e in logs if e["event"] == VERSION_COMMITTED and e["version"] in published]
    assert len(commits) >= 4  # a child that catches up jumps several versions in one commit
    assert all(published[e["version"]] == e["digest"] for e in commits), "a child committed a forged version"
    failed = [e for e in logs if e["event"] == PARENT_FAILED and e["parent"] == "relay-bad"]
    assert failed, "the tampering was never noticed"
    assert all("AuthError" in e["error"] for e in failed), failed
    # quarantined: after its failure no child attaches to the tampering relay again
    attached = [e for e in logs if e["event"] == PARENT_ATTACHED and e["parent"] == "relay-bad"]
    assert len(attached) <= 2  # at most once per child, before it was caught
