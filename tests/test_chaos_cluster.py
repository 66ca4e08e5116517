"""`aurora chaos` as an operator runs it: the tiny topology's cluster (vLLM rollouts included) as real
processes under a short seeded schedule — the trainer SIGKILLed and resumed from its store and result
journal, another node killed, a partition (as root: a black-holed link between network namespaces), a
node that stops reading — and the history checker's verdict.
The same topology as topologies/tiny.yaml, with its model, keys and ports in the test's directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aurora.chaos.netns import NetnsNetwork
from aurora.events import RESULTS_RESTORED
from tests.helpers import free_ports

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _tiny_here(tmp: Path) -> Path:
    text = (ROOT / "topologies" / "tiny.yaml").read_text()
    text = text.replace("../runs/models/tiny-0", str(tmp / "models" / "tiny-0"))
    text = text.replace("../runs/keys/tiny", str(tmp / "keys"))
    ports = iter(free_ports(3))
    text = re.sub(r"127\.0\.0\.1:4700\d", lambda _: f"127.0.0.1:{next(ports)}", text)
    path = tmp / "tiny.yaml"
    path.write_text(text)
    return path


@pytest.mark.timeout(900)
def test_a_short_chaos_run_on_the_tiny_topology_injects_every_fault_and_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    r = subprocess.run(
        [
            *(sys.executable, "-m", "aurora", "chaos", str(_tiny_here(tmp_path))),
            *("--steps", "20", "--seed", "2", "--faults", "4", "--state", str(tmp_path / "state")),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "4 of 4 faults injected" in r.stdout, r.stdout[-3000:]
    assert "no violation: every invariant held" in r.stdout
    real = NetnsNetwork.available() is None  # as root: every node in a namespace, partitions real cuts
    assert ("links cut for real" if real else "silences its parent link itself") in r.stdout
    state = tmp_path / "state"
    assert (state / "trainer.life1.log").is_file()  # the trainer was killed and came back
    assert RESULTS_RESTORED in (state / "trainer.life1.log").read_text()
