"""Real `aurora node` processes over ZeroMQ on loopback: a relay killed with SIGKILL mid-run.

Its children re-attach to their fallback parent, catch up, and every rollout ends on the
trainer's last version, bit-exact (the version's digest, as each node logs it)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aurora.events import PARENT_ATTACHED, PARENT_LOST, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.runtime.processes import node_argv
from tests.helpers import free_ports, log_events, wait_until

STEPS = 60


def _topology(path: Path) -> Path:
    p = free_ports(3)
    path.write_text(f"""
name: kill-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p[0]}"}}
  - {{name: relay-a, role: relay, region: local, listen: "tcp://127.0.0.1:{p[1]}", parent: trainer}}
  - {{name: relay-b, role: relay, region: local, listen: "tcp://127.0.0.1:{p[2]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: local, parent: relay-a, fallback_parents: [trainer]}}
  - {{name: rollout-2, role: rollout, region: local, parent: relay-a, fallback_parents: [relay-b]}}
  - {{name: rollout-3, role: rollout, region: local, parent: relay-b}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
learner: {{kind: synthetic, params: 200000, density: 0.02, interval_s: 0.3}}
run: {{steps: {STEPS}}}
""")
    return path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]]]:
    topo = _topology(tmp_path / "t.yaml")
    names = ["trainer", "relay-a", "relay-b", "rollout-1", "rollout-2", "rollout-3"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {n: tmp_path / f"{n}.log" for n in names}
    try:
        for n in names:
            if n.startswith("rollout") and not all(_attached(logs[r]) for r in ("relay-a", "relay-b")):
                # parents first, as `aurora run` will do: a child that finds its parent not yet
                # attached is refused and takes its fallback (where it would then stay)
                wait_until(lambda: all(_attached(logs[r]) for r in ("relay-a", "relay-b")), 180, "the relays to attach")
            with logs[n].open("wb") as err:
                procs[n] = subprocess.Popen(
                    node_argv(topo, n), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
                )
        yield procs, logs
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _attached(log: Path) -> str | None:
    """The parent this node last attached to, if any."""
    if not log.exists():
        return None
    parents = [e["parent"] for e in log_events(log) if e["event"] == PARENT_ATTACHED]
    return parents[-1] if parents else None


def _version(log: Path) -> int:
    vs = [e["version"] for e in log_events(log) if e["event"] == VERSION_COMMITTED]
    return max(vs, default=-1)


def test_killing_a_relay_mid_run_children_reattach_and_converge(
    cluster: tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]],
) -> None:
    procs, logs = cluster
    rollouts = ["rollout-1", "rollout-2", "rollout-3"]
    # generous: on a clean checkout six processes may compile the numba kernels at once on two cores
    wait_until(lambda: all(_version(logs[r]) >= 2 for r in rollouts), 180, "version 2 on every rollout")
    assert [_attached(logs[r]) for r in rollouts] == ["relay-a", "relay-a", "relay-b"]
    assert max(_version(logs[r]) for r in rollouts) < STEPS - 5, "the run ended before the kill"
    os.killpg(procs["relay-a"].pid, signal.SIGKILL)
    wait_until(lambda: all(_version(logs[r]) >= STEPS for r in rollouts), 60, f"version {STEPS} everywhere")

    published = {e["version"]: e["digest"] for e in log_events(logs["trainer"]) if e["event"] == VERSION_PUBLISHED}
    for r in rollouts:
        committed = {e["version"]: e["digest"] for e in log_events(logs[r]) if e["event"] == VERSION_COMMITTED}
        assert committed[STEPS] == published[STEPS], r
        versions = [e["version"] for e in log_events(logs[r]) if e["event"] == VERSION_COMMITTED]
        assert versions == sorted(versions), f"{r} applied versions out of order: {versions}"
    attached = {(r, e["parent"]) for r in rollouts for e in log_events(logs[r]) if e["event"] == PARENT_ATTACHED}
    assert ("rollout-1", "trainer") in attached
    assert ("rollout-2", "relay-b") in attached
    assert any(e["event"] == PARENT_LOST for e in log_events(logs["rollout-1"]))

    for n, p in procs.items():  # SIGTERM: a clean stop, exit code 0
        if n != "relay-a":
            p.send_signal(signal.SIGTERM)
    for n, p in procs.items():
        if n != "relay-a":
            assert p.wait(timeout=15) == 0, (n, logs[n].read_text()[-2000:])
