"""Real `aurora node` processes doing work: a rollout killed mid-lease, then the trainer killed and restarted.

* SIGKILL a rollout while it holds leases: its leases expire at the trainer, their prompts
  go to the others, the run goes on; restarted, it catches up and gets work again.
* SIGKILL the trainer mid-run and start it again on the same store: it resumes from its
  last stored version, its children re-attach, and no node skips or repeats a version.
Every node ends on the trainer's last version, bit-exact (the version digest each logs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aurora.events import (
    ENGINE_SWITCHED,
    LEASE_EXPIRED,
    LEASE_GIVEN_UP,
    LEASES_GRANTED,
    NODE_STARTED,
    PARENT_ATTACHED,
    RESULT_SENT,
    STEP,
    TRAINER_RESUMED,
    VERSION_COMMITTED,
    VERSION_PUBLISHED,
    WORK_STARTED,
)
from aurora.runtime.processes import node_argv
from tests.helpers import events_in, free_ports, log_events, version_in, wait_until

STEPS = 80
NAMES = ["trainer", "relay", "rollout-1", "rollout-2", "rollout-3"]


def _topology(path: Path) -> Path:
    p = free_ports(2)
    path.write_text(f"""
name: work-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p[0]}"}}
  - {{name: relay, role: relay, region: local, listen: "tcp://127.0.0.1:{p[1]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: local, parent: relay, fallback_parents: [trainer]}}
  - {{name: rollout-2, role: rollout, region: local, parent: relay, fallback_parents: [trainer]}}
  - {{name: rollout-3, role: rollout, region: local, parent: relay, fallback_parents: [trainer]}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
leases: {{ttl_s: 2.0, prompts_per_lease: 4, batch_s: 0.5}}
staleness: {{max_versions: 1}}
learner: {{kind: synthetic, model: {{preset: tiny}}, density: 0.02, samples_per_step: 16, step_s: 0.5}}
engine: {{kind: torch, model: {{preset: tiny}}, max_new_tokens: 8}}
run: {{steps: {STEPS}}}
""")
    return path


def _lives(log: Path) -> list[list[dict[str, Any]]]:
    """A node's log split at each start (a restarted node appends to the same file)."""
    out: list[list[dict[str, Any]]] = []
    for e in log_events(log):
        if not out or (e["event"] == NODE_STARTED and any(x["event"] == NODE_STARTED for x in out[-1])):
            out.append([])
        out[-1].append(e)
    return out


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.topo = _topology(tmp / "t.yaml")
        self.store = tmp / "store"
        self.logs = {n: tmp / f"{n}.log" for n in NAMES}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        level = "debug" if name == "rollout-1" else "info"  # its lease grants and sends: see `held_leases`
        argv = node_argv(self.topo, name, log_level=level)
        if name == "trainer":
            argv += ["--store", str(self.store)]
        with self.logs[name].open("ab") as err:
            self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait()

    def held_leases(self, name: str) -> set[tuple[int, str]]:
        """The (item, token prefix) leases a worker's log says it was granted and has neither answered
        nor given up. Exact only while the worker is stopped (its log cannot grow)."""
        held: set[tuple[int, str]] = set()
        for e in log_events(self.logs[name]):
            if e["event"] == LEASES_GRANTED:
                held |= {(int(i), str(t)) for i, t in e["leases"]}
            elif e["event"] in (RESULT_SENT, LEASE_GIVEN_UP):
                held.discard((int(e["item"]), str(e["token"])))
        return held

    def ev(self, name: str, event: str) -> list[dict[str, Any]]:
        return events_in(self.logs[name], event) if name in self.logs else []

    def version(self, name: str) -> int:
        return version_in(self.logs[name], name == "trainer") if name in self.logs else -1


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        c.start("trainer")
        c.start("relay")
        wait_until(lambda: c.ev("relay", PARENT_ATTACHED), 180, "the relay to attach")
        for r in NAMES[2:]:
            c.start(r)
        yield c
    finally:
        for p in c.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_rollout_killed_mid_lease_and_a_trainer_restarted_from_its_store(cluster: Cluster) -> None:
    c = cluster
    rollouts = NAMES[2:]
    # generous: on a clean checkout several processes compile the codec kernels at once on two cores
    wait_until(
        lambda: c.version("trainer") >= 2 and all(c.ev(r, ENGINE_SWITCHED) for r in rollouts),
        180,
        "work under way on every rollout",
    )

    # 1. a rollout dies holding leases: they expire at the trainer and the run goes on without it.
    # Leases go out only while the learner can use more results, so a worker often holds none:
    # freeze rollout-1, read from its (now still) log whether it holds any, and kill it if so.
    deadline = time.monotonic() + 60
    while True:
        c.signal("rollout-1", signal.SIGSTOP)
        held = c.held_leases("rollout-1")
        if held or time.monotonic() > deadline:
            break
        c.signal("rollout-1", signal.SIGCONT)
        time.sleep(0.02)
    c.kill("rollout-1")
    assert held, "rollout-1 never held a lease when looked at"
    killed_at = c.version("trainer")
    expired = lambda: {(e["item"], e["token"]) for e in c.ev("trainer", LEASE_EXPIRED) if e["worker"] == "rollout-1"}  # noqa: E731
    wait_until(lambda: held <= expired(), 10, f"rollout-1's leases {sorted(held)} to expire")
    wait_until(lambda: c.version("trainer") >= killed_at + 2, 60, "steps without rollout-1")

    # 2. rollout-1 comes back: it catches up and gets work again
    c.start("rollout-1")
    wait_until(
        lambda: (
            len(_lives(c.logs["rollout-1"])) == 2
            and WORK_STARTED in {e["event"] for e in _lives(c.logs["rollout-1"])[1]}
        ),
        60,
        "rollout-1 to get work again",
    )

    # 3. the trainer dies; restarted on its store it resumes from the last version it stored
    last = c.version("trainer")
    assert last < STEPS - 4, "the run ended before the trainer could be killed mid-run"
    c.kill("trainer")
    c.start("trainer")
    wait_until(lambda: c.ev("trainer", TRAINER_RESUMED), 60, "the trainer to resume")
    resumed = c.ev("trainer", TRAINER_RESUMED)[-1]["version"]
    # every version is stored before its last chunk leaves; the last one may be stored and not yet logged
    assert resumed in (last, last + 1)

    wait_until(lambda: all(c.version(n) >= STEPS for n in NAMES[1:]), 120, f"version {STEPS} everywhere")
    wait_until(lambda: c.version("trainer") >= STEPS, 10, "the trainer's last step")

    published: dict[int, str] = {}
    for e in c.ev("trainer", VERSION_PUBLISHED):
        assert published.setdefault(e["version"], e["digest"]) == e["digest"]
    assert sorted(published) == list(range(1, STEPS + 1))  # no version published twice with different weights
    for n in NAMES[1:]:
        commits = c.ev(n, VERSION_COMMITTED)
        for e in commits:
            assert e["digest"] == published.get(e["version"], e["digest"]), (n, e["version"])
        assert commits[-1]["version"] == STEPS
        assert commits[-1]["digest"] == published[STEPS], n
        for life in _lives(c.logs[n]):
            versions = [e["version"] for e in life if e["event"] == VERSION_COMMITTED]
            assert versions == sorted(set(versions)), f"{n} went back or repeated a version: {versions}"
    assert any(e["parent"] in ("relay", "trainer") for e in c.ev("relay", PARENT_ATTACHED)[1:])
    # rollout-1's second life: it caught up (a snapshot or deltas) and its results were accepted again
    lives = _lives(c.logs["rollout-1"])
    assert len(lives) == 2
    assert {ENGINE_SWITCHED, WORK_STARTED} <= {e["event"] for e in lives[1]}
    steps = c.ev("trainer", STEP)
    assert steps[-1]["accepted"] >= 12  # the resumed coordinator's own count

    for p in c.procs.values():  # SIGTERM: a clean stop, exit code 0
        p.send_signal(signal.SIGTERM)
    for n, p in c.procs.items():
        assert p.wait(timeout=15) == 0, (n, c.logs[n].read_text()[-2000:])
