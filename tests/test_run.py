"""`aurora run`: a whole topology as processes, to the end, then a clean stop."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_ports


def test_aurora_run_brings_every_node_to_the_last_version_and_stops(tmp_path: Path) -> None:
    p = free_ports(2)
    topo = tmp_path / "t.yaml"
    topo.write_text(f"""
name: run-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p[0]}"}}
  - {{name: relay, role: relay, region: local, listen: "tcp://127.0.0.1:{p[1]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: local, parent: relay}}
  - {{name: rollout-2, role: rollout, region: local, parent: auto}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
leases: {{ttl_s: 5.0, prompts_per_lease: 4}}
learner: {{kind: synthetic, model: {{preset: tiny}}, density: 0.02, samples_per_step: 8}}
engine: {{kind: torch, model: {{preset: tiny}}, max_new_tokens: 8}}
run: {{steps: 4}}
""")
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "run", str(topo), "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "done: every node holds version 4"
    final = lines[lines.index(next(x for x in reversed(lines) if x.startswith("trainer v"))) : -1]
    m = re.match(r"trainer v4 +results accepted (\d+)", final[0])
    assert m is not None, final
    assert int(m.group(1)) >= 4 * 8  # every step was made of accepted rollout results
    nodes = {x.split()[0]: x.split()[1] for x in final[1:]}
    assert nodes == {"relay": "v4", "rollout-1": "v4", "rollout-2": "v4"}, final
    assert all("tok/s" in x for x in final[1:] if x.startswith("rollout"))
    assert (tmp_path / "state" / "trainer.log").stat().st_size > 0


def test_aurora_run_names_a_node_that_cannot_start(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        topo = tmp_path / "t.yaml"
        topo.write_text(f"""
name: busy
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{port}"}}
  - {{name: rollout-1, role: rollout, region: local, parent: trainer}}
""")
        r = subprocess.run(
            [sys.executable, "-m", "aurora", "run", str(topo)], capture_output=True, text=True, timeout=240
        )
    assert r.returncode == 2
    assert "node 'trainer' exited" in r.stderr


def test_aurora_run_shares_the_cores_among_the_computing_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    from aurora.config.topology import load_topology
    from aurora.run import compute_threads

    topo = load_topology(Path(__file__).parent.parent / "topologies" / "tiny.yaml")  # trainer + 4 rollouts compute
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert compute_threads(topo) == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert compute_threads(topo) == 1  # never below one
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert compute_threads(topo) is None  # the user's setting stands
