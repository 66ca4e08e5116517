"""`aurora run`: a whole topology as processes, to the end, then a clean stop."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

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
learner: {{kind: synthetic, params: 100000, density: 0.02, interval_s: 0.2}}
run: {{steps: 5}}
""")
    r = subprocess.run([sys.executable, "-m", "aurora", "run", str(topo)], capture_output=True, text=True,
                       timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: every node holds version 5" in r.stdout
    assert "rollout-2 v5" in r.stdout.splitlines()[-2]


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
        r = subprocess.run([sys.executable, "-m", "aurora", "run", str(topo)], capture_output=True, text=True,
                           timeout=240)  # fmt: skip
    assert r.returncode == 2
    assert "node 'trainer' exited" in r.stderr
