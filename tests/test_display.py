"""The live view: piped, one line per learner step (never the whole block again); on a terminal,
one table redrawn in place with a progress line for the whole run."""

from __future__ import annotations

import io

from aurora.display import RunView
from aurora.protocol.messages import NodeReport, Snapshot, TrainerStats


def _snap(version: int, reward: float) -> Snapshot:
    return Snapshot(
        trainer=TrainerStats(
            version=version,
            accepted=10 * version,
            rejected={"stale": 1},
            in_flight=2,
            pending=0,
            dropped_stale=0,
            parked=0,
        ),
        nodes={
            "relay-a": NodeReport(version=version, parent="trainer"),
            "rollout-1": NodeReport(
                version=version,
                parent="relay-b",
                planned=False,
                completions=4,
                accepted=4,
                rejected=0,
                tok_s=120.0,
                switches=2,
                switch_ms=3.5,
            ),
        },
        sync_s={str(version): 0.21},
        step={"version": version, "reward": reward, "accuracy": 0.5, "bytes": 123_000, "density": 0.012},
        planned={"relay-a": "trainer", "rollout-1": "relay-a"},
    )


def test_piped_one_line_per_step() -> None:
    out = io.StringIO()
    view = RunView(10, out=out, live=False)
    view.message("starting")
    for v in (1, 1, 1, 2, 2, 3):  # polled every second, three steps
        view.status(_snap(v, 0.1 * v))
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting"
    assert len(lines) == 4
    assert lines[1].startswith("step 1/10  reward 0.100  accuracy 0.500  delta 123.0 kB (1.20 % changed)")
    assert "ETA" in lines[3]


def test_on_a_terminal_one_table_with_the_run_s_progress() -> None:
    out = io.StringIO()
    view = RunView(10, out=out, live=True)
    view.status(None, "trainer v- | relay-a v-")
    view.status(_snap(3, 0.3))
    view.message("a message above the table")
    view.status(_snap(4, 0.4))
    view.close()
    text = out.getvalue()
    assert "rollout-1" in text
    assert "(planned" in text  # a node on a fallback parent says so, and which is its planned one
    assert "relay-a)" in text
    assert "step 4 of 10" in text
    assert "a message above the table" in text
