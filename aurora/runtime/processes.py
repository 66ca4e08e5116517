"""OS processes that a composition root starts — `aurora run`'s nodes, the benches' nodes and peers,
the WAN emulator's helpers: started each in its own process group, ended by that group, and their
CPU time sampled; and a node's own helpers (`start_child`: a rollout's ``vllm serve``). The one place ``aurora`` starts, signals and measures processes.

Invariants: a process started with `start_group` leads its own process group (a new session), so
ending it ends what it started too (a node's own helpers, the command ``ip netns exec`` runs), and
nothing else is ever signalled (never a match on a name). A group is signalled only while its
leader has not been reaped, so its id cannot have been reused. `end_groups` is TERM to every group,
then KILL to those still running once the grace period is over, then each leader reaped: no zombie
is left. CPU time is user + system seconds of live processes, all their threads (psutil); a process
that is gone counts nothing. Blocking; not for the event loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import psutil

Process = subprocess.Popen[bytes]


def node_argv(topology: str | os.PathLike[str], name: str, *extra: str, log_level: str | None = None) -> list[str]:
    """The command that runs node ``name`` of ``topology`` with this interpreter, logging JSON lines to
    stderr (``extra``: more `aurora node` options, e.g. ``--store DIR``)."""
    level = [] if log_level is None else ["--log-level", log_level]
    head = [sys.executable, "-m", "aurora", "--log-format", "json", *level, "node"]
    return [*head, "--topology", str(topology), "--name", name, *extra]


def start_group(argv: Sequence[str], **popen: Any) -> Process:
    """Start ``argv`` as the leader of a new process group (``popen``: `subprocess.Popen`'s other arguments)."""
    p: Process = subprocess.Popen(list(argv), start_new_session=True, **popen)
    return p


def start_child(argv: Sequence[str], **popen: Any) -> Process:
    """Start ``argv`` as a helper of this process (a node's ``vllm serve``), the leader of a process group
    of its own (so that `end_child` ends what it starts too), sent SIGTERM by the kernel if this process
    dies first (a SIGKILL included; on Linux). Start it from the event loop's thread: the signal follows
    the thread that started it."""
    parent = os.getpid()
    prctl = None
    if sys.platform == "linux":
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing is loaded after the fork

    def die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before that took effect
                os._exit(1)

    return start_group(argv, preexec_fn=die_with_parent, **popen)


def end_child(p: Process, *, grace_s: float = 0.0) -> None:
    """End a helper `start_child` started, and what it started: SIGTERM to its group, SIGKILL to the group
    if it still runs ``grace_s`` later; reaped."""
    end_group(p, grace_s=grace_s, close_pipes=False)


def _signal_group(p: Process, sig: signal.Signals) -> None:
    if p.poll() is None:  # not reaped: its pid, the group's id, is still its own
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)


def end_groups(procs: Iterable[Process], *, grace_s: float = 0.0, close_pipes: bool = True) -> None:
    """End the process groups ``procs`` lead, in the order given: SIGTERM to each, then SIGKILL to
    the groups still running ``grace_s`` later (``grace_s`` 0: SIGKILL at once); each leader is
    reaped. ``close_pipes``: close the parent's ends of their pipes too (False where a reader
    thread owns one until it ends)."""
    procs = list(procs)
    if grace_s > 0:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        _signal_group(p, signal.SIGKILL)
        p.wait()
        if close_pipes:
            for s in (p.stdout, p.stderr, p.stdin):
                if s is not None:
                    s.close()


def end_group(p: Process, *, grace_s: float = 0.0, close_pipes: bool = True) -> None:
    """`end_groups` for one process."""
    end_groups([p], grace_s=grace_s, close_pipes=close_pipes)


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads (None once it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def group_cpu_s(groups: Collection[int]) -> float:
    """User + system CPU seconds so far of every live process in the process groups ``groups``."""
    total = 0.0
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups:
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.Error, ProcessLookupError):
            continue  # gone meanwhile
    return total


def peak_rss_bytes(pid: int) -> int | None:
    """The most resident memory process ``pid`` has held so far (Linux's VmHWM; None once it is gone
    or where the kernel does not say)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pss_bytes(pid: int) -> int | None:
    """Process ``pid``'s proportional share of memory now (Linux's Pss: its private pages, and each shared
    page divided among the processes that map it — so the Pss of several processes adds up to what they
    hold together, where their resident sizes would count the shared libraries once each). None once it
    is gone or where the kernel does not say."""
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.Error, AttributeError):  # AttributeError: a platform without Pss
        return None
