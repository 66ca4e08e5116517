"""`aurora run` trains for real: GRPO on the trainer, torch rollout engines as processes, deltas down
a relay; with a fixed seed the reward at the end of a short run is above its start, and the run
leaves its metrics (JSONL, PNG) and checkpoints behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import rl_topology


def test_a_short_grpo_run_raises_the_reward(tmp_path: Path) -> None:
    steps = 40
    topo = rl_topology(tmp_path, steps)
    state = tmp_path / "state"
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "run", str(topo), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"done: every node holds version {steps}" in r.stdout.splitlines()
    assert (tmp_path / "model" / "config.json").exists()  # `aurora run` made the model directory
    rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [row["version"] for row in rows] == list(range(1, steps + 1))
    rewards = [row["reward"] for row in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}", [round(x, 2) for x in rewards])
    assert first > 0.1  # the warm start put the reward above zero
    assert last > first + 0.05, (first, last, rewards)
    assert all(row["bytes"] > 0 and 0 < row["density"] <= 1 for row in rows)  # real deltas went out
    # every node held every version from when the last one attached (a rollout attaching after
    # the first steps starts from a snapshot and never holds the versions before it: no sync time)
    synced = [row.get("sync_s") is not None for row in rows]
    assert all(synced[synced.index(True) :]), synced
    assert all(row["staleness"] <= 1 for row in rows)  # the coordinator held the bound
    assert (state / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    checkpoints = sorted(p.name for p in (state / "trainer" / "checkpoints").iterdir())
    assert checkpoints == ["v00000010", "v00000020", "v00000030", "v00000040"]
    assert "reward: first" in r.stdout
