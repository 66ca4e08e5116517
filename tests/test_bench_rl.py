"""`aurora bench rl` end to end, small: both runs (sync and the sync-free ideal) finish and their
figures are printed and written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import rl_topology

pytestmark = pytest.mark.slow


def test_bench_rl_prints_sync_next_to_the_ideal(tmp_path: Path) -> None:
    topo = rl_topology(tmp_path, steps=1)  # the bench sets the steps
    out = tmp_path / "rl.json"
    r = subprocess.run([sys.executable, "-m", "aurora", "bench", "rl", str(topo), "--steps", "8", "--warmup", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "sync / ideal tokens/s:" in r.stdout
    assert "channel_closed" not in r.stdout + r.stderr  # the bench's own connections stay quiet
    got = json.loads(out.read_text())
    for mode in ("sync", "ideal"):
        m = got[mode]
        assert m["tokens_s"] > 0
        assert 0 <= m["paused"] < 1
    assert got["sync"]["paused"] > 0  # engines switched versions during the timed window
    assert got["ideal"]["paused"] == 0  # nothing to switch to
    assert got["sync"]["delta_kb"] > 0
    assert got["ideal"]["delta_kb"] == 0
    assert got["ratio"] == pytest.approx(got["sync"]["tokens_s"] / got["ideal"]["tokens_s"])
