"""Metrics where people look (`aurora.tracking`) and in the run's files (`aurora.metrics`): TensorBoard
event files hold each figure at its version, read back with TensorBoard's own reader; a failing
backend goes quiet instead of failing the trainer; the held-out accuracy reaches metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from aurora.events import EVALUATED, STEP, VERSION_PUBLISHED, VERSION_SYNCED
from aurora.metrics import collect, plot, smooth
from aurora.tracking import TensorBoard, open_trackers, scalars


def _read(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_each_figure_at_its_version(tmp_path: Path) -> None:
    t = open_trackers(tmp_path, "run", {})
    t.record(0, {"eval_accuracy": 0.25, "eval_s": 1.5})
    t.record(1, {"reward": 0.5, "accuracy": 0.375, "bytes": 1000, "density": 0.01, "note": "x", "skipped": True})
    t.record(1, {"sync_s": 0.125, "rollout_tok_s": 640.0, "switch_ms": None})
    t.record(2, {"reward": 0.75, "eval_accuracy": 0.5})
    t.close()
    got = _read(tmp_path / "tensorboard")
    assert got["train/reward"] == [(1, 0.5), (2, 0.75)]
    assert got["eval/accuracy"] == [(0, 0.25), (2, 0.5)]
    assert got["delta/bytes"] == [(1, 1000.0)]
    assert got["sync/seconds"] == [(1, 0.125)]
    assert got["rollouts/tokens_per_s"] == [(1, 640.0)]
    assert "rollouts/switch_ms" not in got  # None: not a figure
    assert scalars({"reward": True, "staleness": 1}) == {"train/staleness": 1.0}  # bools are not figures


def test_a_failing_backend_goes_quiet_after_one_line(tmp_path: Path) -> None:
    tb = TensorBoard(tmp_path)
    tb.writer.close()
    calls = []

    class Broken:
        def add_scalar(self, *a: Any, **k: Any) -> None:
            calls.append(a)
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    tb.writer = Broken()  # type: ignore[assignment]
    with capture_logs() as logs:
        tb.record(1, {"reward": 1.0})
        tb.record(2, {"reward": 1.0})
        tb.close()
    assert tb.failed
    assert len(calls) == 1  # the second record never reached the writer
    assert [e["event"] for e in logs] == ["tracking_failed"]


def test_no_store_no_tensorboard() -> None:
    assert open_trackers(None, "run", {}).trackers == []


def test_the_eval_accuracy_reaches_the_metrics_rows_and_the_plot(tmp_path: Path) -> None:
    events = [
        {"event": EVALUATED, "version": 0, "eval_accuracy": 0.1, "eval_s": 2.0},
        {"event": STEP, "version": 1, "reward": 0.2, "accuracy": 0.1},
        {"event": VERSION_PUBLISHED, "version": 1, "bytes": 10, "density": 0.01},
        {"event": VERSION_SYNCED, "version": 1, "sync_s": 0.3},
        {"event": STEP, "version": 2, "reward": 0.4, "accuracy": 0.3},
        {"event": EVALUATED, "version": 2, "eval_accuracy": 0.3, "eval_s": 2.0},
        {"event": EVALUATED, "version": 3, "error": "RuntimeError()"},  # a failed evaluation: no figure
    ]
    rows = collect(events)
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert rows[0] == {"version": 0, "eval_accuracy": 0.1, "eval_s": 2.0}
    assert rows[2]["eval_accuracy"] == 0.3
    assert rows[1]["sync_s"] == 0.3
    assert plot(rows, tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert smooth([1.0] * 5 + [0.0] * 15) == [1.0] * 5 + [0.5, 0.0] + [0.0] * 13


def test_wandb_offline_when_installed_and_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B is not one of Aurora's dependencies: this runs where a user installed it (it did here, by hand)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "aurora-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = open_trackers(tmp_path, "run", {"learner": {"lr": 1e-5}})
    assert [type(x).__name__ for x in t.trackers] == ["TensorBoard", "WandB"]
    t.record(1, {"reward": 0.5, "eval_accuracy": 0.25})
    t.close()
    assert not any(getattr(x, "failed", False) for x in t.trackers)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    assert runs[0].stat().st_size > 0
