"""`aurora bench rl` end to end, small: both runs (sync and the sync-free ideal) finish and their
figures are printed and written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aurora.bench.rl import cpu_per_step, measure
from aurora.events import BATCH_GENERATED, CHANNEL_CLOSED, ENGINE_SWITCHED, STEP
from tests.helpers import rl_topology


def _log(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_paused_counts_version_switches_not_an_engines_first_load(tmp_path: Path) -> None:
    """A rollout that attaches (or restarts) inside the timed window loads its first version
    there: that is start-up, not generation paused for a switch (the ideal run's CI flake)."""
    at = lambda s: f"2026-12-03T08:00:{s:02d}.000000Z"  # noqa: E731
    _log(
        tmp_path / "trainer.log",
        [{"event": STEP, "version": v, "tokens": 100, "timestamp": at(2 * v)} for v in range(1, 7)],
    )
    _log(
        tmp_path / "r0.log",
        [
            {"event": ENGINE_SWITCHED, "version": 0, "from_version": None, "switch_ms": 500.0, "timestamp": at(5)},
            {"event": BATCH_GENERATED, "prompts": 3, "timestamp": at(7)},
            {"event": BATCH_GENERATED, "prompts": 8, "timestamp": at(1)},  # before the window
        ],
    )
    _log(
        tmp_path / "r1.log",
        [
            {"event": ENGINE_SWITCHED, "version": 3, "from_version": 2, "switch_ms": 400.0, "timestamp": at(6)},
            # before the window:
            {"event": ENGINE_SWITCHED, "version": 1, "from_version": 0, "switch_ms": 900.0, "timestamp": at(1)},
            {"event": BATCH_GENERATED, "prompts": 1, "timestamp": at(9)},
        ],
    )
    m = measure(tmp_path, "trainer", ["r0", "r1"], warmup=1)  # window: step 2 (4 s) to step 6 (12 s)
    assert m["window_s"] == pytest.approx(8.0)
    assert m["tokens_s"] == pytest.approx(400 / 8.0)
    assert m["paused"] == pytest.approx((0.0 + 0.4 / 8.0) / 2)
    assert m["cpu_ms_per_step"] is None  # no cpu.jsonl
    assert m["shares"] == pytest.approx({"r0": 0.75, "r1": 0.25})  # prompts generated in the window


def test_cpu_per_step_is_each_roles_mean_over_the_timed_steps(tmp_path: Path) -> None:
    samples = [
        {"version": 2, "cpu_s": {"t": 10.0, "r0": 1.0, "r1": 2.0}},
        {"version": 6, "cpu_s": {"t": 12.0, "r0": 1.4, "r1": 3.2}},
    ]
    (tmp_path / "cpu.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    got = cpu_per_step(tmp_path / "cpu.jsonl", 2, 6, {"t": "trainer", "r0": "rollout", "r1": "rollout"})
    assert got == pytest.approx({"trainer": 500.0, "rollout": 200.0, "all": 900.0})
    assert cpu_per_step(tmp_path / "cpu.jsonl", 2, 7, {"t": "trainer"}) is None  # no sample at the window's end


@pytest.mark.slow
def test_bench_rl_prints_sync_next_to_the_ideal(tmp_path: Path) -> None:
    topo = rl_topology(tmp_path, steps=1)  # the bench sets the steps
    out = tmp_path / "rl.json"
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "bench", "rl", str(topo), "--steps", "8", "--warmup", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "sync / ideal tokens/s:" in r.stdout
    assert CHANNEL_CLOSED not in r.stdout + r.stderr  # the bench's own connections stay quiet
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
    for mode in ("sync", "ideal"):  # every node's CPU over the window, by role (this machine has /proc)
        assert set(got[mode]["cpu_ms_per_step"]) == {"trainer", "relay", "rollout", "all"}
        assert all(v > 0 for v in got[mode]["cpu_ms_per_step"].values())
    assert "CPU ms per step" in r.stdout
    assert got["sync"]["score_us"] > 0  # the trainer's scoring, per sample
    assert "scoring:" in r.stdout
    for mode in ("sync", "ideal"):  # each rollout's part of the work
        assert sum(got[mode]["shares"].values()) == pytest.approx(1.0)
        assert f"work shares ({mode}" in r.stdout
