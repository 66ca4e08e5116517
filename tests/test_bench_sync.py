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
    r = subprocess.run([sys.executable, "-m", "aurora", "bench", "sync", "--params", "1M", "--densities", "0.05",
                        "--versions", "1"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"\s+1M ", line)]
    assert [" ".join(x.split()[2:4]) for x in rows] == ["full star", "full relay", "delta star", "delta relay"]
    for x in rows:
        time_ms, bound_ms = (float(v) for v in x.split()[-8:-6])  # counted from the right: names have spaces
        assert time_ms >= 0.9 * bound_ms > 0  # nothing beats the bound (it includes the WAN round trips)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert after == before
