"""`aurora bench leases`: every case runs, and its shares are of all the results."""

from __future__ import annotations

import pytest

from aurora.bench.leases import CASES, TRAIN_S, bench, render
from aurora.cli import main


def test_bench_leases_prints_every_case_with_shares_that_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    rows = bench(seconds=60.0)
    assert len(rows) == len(CASES) * len(TRAIN_S) * 2
    for r in rows:
        assert sum(r.shares.values()) == pytest.approx(1.0)
        assert sum(r.speed.values()) == pytest.approx(1.0)
        assert r.steps > 0
    assert "worst gap" in render(rows, 60.0)
    assert main(["bench", "leases", "--seconds", "30"]) == 0
    assert "2x" in capsys.readouterr().out
    assert main(["bench", "leases", "--seconds", "0"]) != 0
