"""A worker's speed as the coordinator times it (`aurora.protocol.speed.SpeedMeter`): whole leases from a
grant to a worker that held nothing to the last of its prompts accepted, fitted as ``a + b·n``."""

from __future__ import annotations

import pytest

from aurora.protocol.speed import SAMPLES, SpeedMeter, fit


def _timed(meter: SpeedMeter, worker: str, n: int, start: float, took: float) -> None:
    items = [(worker, start, i) for i in range(n)]
    meter.granted(worker, items, start, at_once=True)
    for it in items:
        meter.accepted(worker, it, start + took)


def test_a_batched_worker_is_quoted_at_a_full_lease_whatever_size_it_was_timed_at() -> None:
    """A batch takes 2 s whatever its size: 4 prompts per 2 s, though it was only ever given 2."""
    meter = SpeedMeter(full=4)
    assert meter.speed("w") is None  # unmeasured
    _timed(meter, "w", 2, 0.0, 2.0)
    assert meter.speed("w") == pytest.approx(2.0)
    _timed(meter, "w", 4, 10.0, 2.0)
    assert meter.speed("w") == pytest.approx(2.0)
    assert meter.time_for("w", 1) == pytest.approx(2.0)


def test_a_per_prompt_worker_is_told_apart_once_timed_at_two_sizes() -> None:
    meter = SpeedMeter(full=4)
    _timed(meter, "w", 1, 0.0, 1.0)
    assert meter.speed("w") == pytest.approx(4.0)  # one size: taken as batched (it overrates)
    _timed(meter, "w", 3, 5.0, 3.0)
    assert meter.speed("w") == pytest.approx(1.0)  # a + b·n: a = 0, b = 1
    assert meter.time_for("w", 2) == pytest.approx(2.0)
    for k in range(2 * SAMPLES):  # many more samples of one size do not make it forget the other
        _timed(meter, "w", 1, 10.0 + 2 * k, 1.0)
    assert meter.speed("w") == pytest.approx(1.0)


def test_only_a_whole_lease_started_at_once_is_a_sample() -> None:
    meter = SpeedMeter(full=2)
    meter.granted("w", ["a", "b"], 0.0, at_once=False)  # it waits behind other work: not timed
    meter.accepted("w", "a", 1.0)
    meter.accepted("w", "b", 1.0)
    assert meter.speed("w") is None
    meter.granted("w", ["c", "d"], 2.0, at_once=True)
    meter.lost("w", "c")  # expired, or refused as too stale
    meter.accepted("w", "d", 3.0)
    assert meter.speed("w") is None
    meter.accepted("w", "zz", 6.0)  # not its prompt: ignored
    # a continuous worker's grants overlap: each is timed on its own
    meter.granted("w", ["e", "f"], 7.0, at_once=True)
    meter.granted("w", ["g", "h"], 7.25, at_once=True)
    for item in ("e", "f", "g", "h"):
        meter.accepted("w", item, 7.25 + 0.5 if item in "gh" else 7.5)
    assert meter.speed("w") == pytest.approx(4.0)  # 2 prompts in 0.5 s, twice
    for k in range(3 * SAMPLES):  # grants never answered are bounded
        meter.granted("w", [f"x{k}"], 10.0, at_once=True)
    assert len(meter._open["w"]) == SAMPLES
    meter.forget("w")
    assert meter.speed("w") is None
    assert not meter.samples


def test_the_fit_stays_nonnegative() -> None:
    assert fit([(1, 2.0), (4, 1.0)]) == (1.5, 0.0)  # slower with fewer: noise, the mean time
    a, b = fit([(2, 1.0), (4, 3.0)])  # the line would cross zero below one prompt: through the origin
    assert a == 0.0
    assert b == pytest.approx(14 / 20)
    assert fit([(3, 1.5)]) == (1.5, 0.0)
