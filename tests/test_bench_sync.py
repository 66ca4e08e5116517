"""`aurora bench sync` end to end on the WAN emulator, small: every configuration is timed and
printed next to its bound, and the emulator leaves nothing behind."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from aurora.testing.wan import unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


def test_bench_sync_times_all_four_configurations() -> None:
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "bench", "sync", "--params", "1M", "--densities", "0.05", "--versions", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"\s+1M ", line)]
    assert [" ".join(x.split()[2:4]) for x in rows] == ["full star", "full relay", "delta star", "delta relay"]
    for x in rows:
        cols = x.split()  # counted from the right: names have spaces
        time_ms, bound_ms, floor_ms = float(cols[-12]), float(cols[-11]), float(cols[-9])
        peak_mb, all_mb = float(cols[-4]), float(cols[-3])
        renew_p50, renew_p99 = float(cols[-2]), float(cols[-1])  # measured: a number, not '-'
        assert peak_mb > 100  # a node's resident memory: Python, torch and numba at least
        assert all_mb > 100 * int(cols[-14])  # every node's share (cols[-14]: the nodes, the trainer too)
        # renewals cross the WAN beside the versions, in their own lane: back well within the lease TTL (4 s)
        assert 0 < renew_p50 <= renew_p99 < 4000
        assert bound_ms >= floor_ms > 0
        # nothing beats the floor (the bytes at the link rate plus one one-way WAN delay); the bound
        # allows a round trip per tree level, which cut-through forwarding can beat
        assert time_ms >= 0.9 * floor_ms
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert after == before
