"""`SpeedMeter`: each rollout worker's generation speed, as the coordinator sees it (no clock, no I/O).

What it measures: a worker's *speed* is the prompts per second it would deliver with a full lease
(``full`` prompts) — the share of the work it should get when several wait for work
(`aurora.protocol.workpool.WorkPool._split`). It cannot be read off the results' rate: a worker
given less work delivers less, and where the learner sets the pace every worker is given less than
it could do. So the meter times whole leases instead:

* a *sample* is one grant that its worker starts on at once (it held nothing else, or it runs each
  prompt as a request of its own and asked for these: its clock starts at the grant, not behind a
  batch already running): ``n`` prompts, and the time from the grant to the last of them accepted.
  A grant whose prompts are not all accepted (one expired, refused or given back) gives no sample
  (and a lease that lapses unanswered makes the pool `forget` the worker: it is unmeasured until it
  delivers again);
* a worker's time for ``n`` prompts is fitted as ``a + b·n`` (``a, b ≥ 0``: least squares over the
  average times of the last `SAMPLES` lease sizes it was timed at, one point per size, clamped): a
  batched engine, whose batch takes the same time whatever its size, fits ``b ≈ 0``; an engine that
  takes a time per prompt fits ``a ≈ 0``. Until it was timed at two sizes the fit cannot tell the two
  apart and takes it as batched (``P / t``): that overrates a per-prompt worker given less than a full
  lease, which gets it more work and so a time at another size;
* its speed is ``full / (a + b·full)``; a worker with no sample yet is unmeasured (None).

Bounds: at most `SAMPLES` sizes and `SAMPLES` grants being timed per worker; `forget` drops a worker.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

SAMPLES = 8
"""Lease sizes whose times are kept per worker (the size seen longest ago falls out)."""
EMA_ALPHA = 0.3
"""The weight of a new sample in its size's average time (a worker's speed may change)."""


@dataclass(slots=True)
class _Open:
    granted_at: float
    n: int
    left: set[Hashable]


@dataclass
class SpeedMeter:
    """Leases timed per worker (see the module docstring)."""

    full: int
    """A full lease's prompts (the pool's ``prompts_per_lease``): the size a speed is quoted at."""
    samples: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per worker and lease size (the `SAMPLES` sizes seen last), the seconds from a grant of that size
    to its last result (an exponential average of its samples)."""
    _open: dict[str, list[_Open]] = field(default_factory=dict)
    """Per worker, the grants being timed (at most `SAMPLES`: the oldest is dropped)."""

    def granted(self, worker: str, items: Iterable[Hashable], now: float, at_once: bool) -> None:
        """``worker`` was granted ``items`` at ``now``; ``at_once``: it starts on them now (it holds nothing
        else, or runs each prompt as a request of its own and asked for these), so their time is theirs;
        otherwise they wait behind other work and are not timed."""
        items = set(items)
        if items and at_once:
            grants = self._open.setdefault(worker, [])
            grants.append(_Open(now, len(items), items))
            del grants[:-SAMPLES]

    def accepted(self, worker: str, item: Hashable, now: float) -> None:
        """One of ``worker``'s prompts was accepted at ``now``."""
        o = self._grant(worker, item)
        if o is None:
            return
        o.left.discard(item)
        if not o.left:
            self._open[worker].remove(o)
            if now > o.granted_at:
                sizes = self.samples.setdefault(worker, {})
                t = now - o.granted_at
                old = sizes.pop(o.n, None)  # (re)inserted last: the most recently seen size
                sizes[o.n] = t if old is None else (1 - EMA_ALPHA) * old + EMA_ALPHA * t
                if len(sizes) > SAMPLES:
                    del sizes[next(iter(sizes))]

    def lost(self, worker: str, item: Hashable) -> None:
        """One of ``worker``'s prompts will not be accepted from it (expired, refused, given back)."""
        o = self._grant(worker, item)
        if o is not None:
            self._open[worker].remove(o)  # its grant is not timed

    def _grant(self, worker: str, item: Hashable) -> _Open | None:
        return next((o for o in self._open.get(worker, ()) if item in o.left), None)

    def forget(self, worker: str) -> None:
        self.samples.pop(worker, None)
        self._open.pop(worker, None)

    def time_for(self, worker: str, n: int) -> float | None:
        """Seconds ``worker`` takes for a lease of ``n`` prompts (None: not measured yet)."""
        got = self.samples.get(worker)
        if not got:
            return None
        a, b = fit(got.items())
        return a + b * n

    def speed(self, worker: str) -> float | None:
        """Prompts per second with a full lease (None: not measured yet)."""
        t = self.time_for(worker, self.full)
        return None if t is None or t <= 0 else self.full / t


def fit(samples: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` with ``a, b ≥ 0`` minimising the squared error of ``t ≈ a + b·n`` (all of one size:
    ``b = 0``)."""
    pts = list(samples)
    k = len(pts)
    mn = sum(n for n, _ in pts) / k
    mt = sum(t for _, t in pts) / k
    var = sum((n - mn) ** 2 for n, _ in pts)
    if var == 0:
        return mt, 0.0
    b = sum((n - mn) * (t - mt) for n, t in pts) / var
    a = mt - b * mn
    if b < 0:  # slower with fewer prompts: noise; the mean time
        return mt, 0.0
    if a < 0:  # through the origin
        return 0.0, sum(n * t for n, t in pts) / sum(n * n for n, _ in pts)
    return a, b
