"""`aurora bench leases`: every case runs, and its shares are of all the results."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aurora.bench.leases import CASES, ENGINES, TRAIN_S, bench, render
from aurora.cli import main


def test_bench_leases_prints_every_case_with_shares_that_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    rows = bench(seconds=60.0)
    assert len(rows) == len(CASES) * len(TRAIN_S) * len(ENGINES)
    for r in rows:
        assert sum(r.shares.values()) == pytest.approx(1.0)
        assert sum(r.speed.values()) == pytest.approx(1.0)
        assert r.steps > 0
    assert "worst gap" in render(rows, 60.0)
    assert main(["bench", "leases", "--seconds", "30"]) == 0
    assert "2x" in capsys.readouterr().out
    assert main(["bench", "leases", "--seconds", "0"]) != 0


def test_the_cluster_benchs_topology_gives_each_rollout_its_own_speed(tmp_path: Path) -> None:
    """`aurora bench leases --cluster` runs a topology that loads, with each rollout's own engine speed."""
    from aurora.bench.leases_cluster import topology
    from aurora.config.topology import load_topology

    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(topology({"rollout-a": 0.05, "rollout-b": 0.1}, 1.5, 20, 47399)))
    topo = load_topology(f)
    speeds = {n.name: n.engine.token_s for n in topo.nodes if n.engine is not None}
    assert speeds == {"rollout-a": 0.05, "rollout-b": 0.1}
