"""The one process launcher (`aurora.runtime.processes`): a process group started, sampled and
ended as a whole — TERM, then KILL for what ignores it — and nothing else signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from aurora.runtime.processes import (
    cpu_s,
    end_group,
    end_groups,
    group_cpu_s,
    peak_rss_bytes,
    pss_bytes,
    start_group,
)

SPIN_AND_FORK = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a helper in the same group
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("ready", flush=True)
time.sleep(60)
"""


def _start(kind: str) -> subprocess.Popen[bytes]:
    p = start_group([sys.executable, "-c", SPIN_AND_FORK, kind], stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    return p


def _members(pgid: int) -> list[int]:
    out = []
    for q in psutil.process_iter():
        try:
            if os.getpgid(q.pid) == pgid and q.status() != psutil.STATUS_ZOMBIE:
                out.append(q.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def test_a_group_is_sampled_and_ended_whole_term_first_then_kill() -> None:
    polite, stubborn = _start("polite"), _start("stubborn")
    try:
        assert os.getpgid(polite.pid) == polite.pid != os.getpgid(0)  # its own group, not ours
        assert len(_members(polite.pid)) == 2
        own = cpu_s(polite.pid)
        assert own is not None
        assert own >= 0.25
        assert group_cpu_s({polite.pid, stubborn.pid}) >= 0.5
        t0 = time.monotonic()
        end_groups([polite, stubborn], grace_s=1.0)
        took = time.monotonic() - t0
    finally:
        end_groups([polite, stubborn])
    assert polite.returncode == -15  # TERM was enough
    assert stubborn.returncode == -9  # it ignored TERM: KILLed once the grace period was over
    assert 0.9 <= took < 10
    for p in (polite, stubborn):
        deadline = time.monotonic() + 10  # a helper that got TERM may take a moment to be gone
        while _members(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _members(p.pid) == []  # its helper went with it
        assert p.stdout is not None
        assert p.stdout.closed
    assert cpu_s(polite.pid) is None


def test_ending_a_group_that_already_ended_signals_nothing() -> None:
    p = start_group([sys.executable, "-c", "pass"])
    p.wait()
    end_group(p, grace_s=5.0)  # reaped already: its id may belong to someone else now
    assert p.returncode == 0


def test_memory_now_and_at_its_peak() -> None:
    p = start_group(
        [
            sys.executable,
            "-c",
            "import sys, time; b = bytearray(64 << 20); del b; print(1, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == b"1\n"  # it has held 64 MB and let them go
        now, peak = pss_bytes(p.pid), peak_rss_bytes(p.pid)
        assert now is not None
        assert peak is not None
        assert 0 < now < peak
        assert peak >= 64 << 20
    finally:
        end_group(p)
    assert pss_bytes(p.pid) is None
    assert peak_rss_bytes(p.pid) is None
