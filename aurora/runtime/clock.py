"""`Clock`: the one place the drivers read time and wait for it.

Every timer and deadline of a node — its actors (`Actor.clock`), its supervisor, the flow, the
work coordinator and worker, the uplink, the status schedule, the transports' link drivers and
the in-memory links of `aurora.testing` — reads `Clock.now()` and waits through the clock:
`sleep_until` a machine's `next_deadline()`, `wait_until` an event or a deadline (whichever
comes first), `timeout_at` / `timeout` around a block. `LoopClock` is real time (the running
event loop's monotonic clock, the one `asyncio` timers use); `VirtualClock` (tests) moves only
when told to, waking sleepers in deadline order, so a whole node runs under it: time passes
exactly as a test says, and every deadline is met at its instant, never polled for.

Guarantees both clocks keep: `sleep_until(d)` returns a time ``>= d`` (a machine that acts at
``now >= deadline`` has something to do then: no driver spins on an early wake-up); `wait_until`
and the timeouts are cancellation-safe and start no task (nothing outlives the call); a deadline
of None never expires.

What does not go through a clock, on purpose:

* **stopwatches** — how long real work took, for logs and statistics (``encode_s``,
  ``publish_s``, ``switch_ms``, ``verify_s``, CPU per step, the codings' measured speed) and the
  CPU slice `actors/flow.py` encodes for before it yields (`ENCODE_SLICE_S`): they read
  `time.perf_counter`, because work takes real time whatever the clock says (under a virtual clock
  it takes none). They are data: none of them is compared with a deadline or starts a timer
  (the coding choice reads the measured speeds as numbers, never as time to wait);
* **incarnations** — `aurora.transport.base.new_incarnation` is wall-clock microseconds, so it
  grows across restarts of a process, which no monotonic clock does.

`tests/test_layout.py` fails if ``actors/`` or ``transport/`` read time or wait for it any other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

SETTLE_ROUNDS = 10_000
"""`VirtualClock.advance` lets woken tasks run after each deadline until nothing else is ready, at
most this many loop rounds (a task that never waits would otherwise hold time still for good)."""


class Timer(Protocol):
    def cancel(self) -> None: ...


class Timeout(Protocol):
    """What `Clock.timeout_at` returns: an async context manager that raises `TimeoutError` out of
    its block once the deadline passes (the block is cancelled), as `asyncio.timeout_at` does."""

    async def __aenter__(self) -> object: ...

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None, /
    ) -> bool | None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once after ``delay_s``; the returned timer can cancel it."""
        ...

    async def sleep(self, delay_s: float) -> None: ...

    async def sleep_until(self, deadline: float | None) -> float:
        """Sleep until `now` reaches ``deadline`` (None: until cancelled); returns `now` then, never
        less than ``deadline``. Cancellation-safe."""
        ...

    async def wait_until(self, event: asyncio.Event, deadline: float | None) -> bool:
        """Until ``event`` is set (True) or `now` reaches ``deadline`` (False; None: no deadline).
        Cancellation-safe; starts no task."""
        ...

    def timeout_at(self, deadline: float | None) -> Timeout:
        """An `asyncio.timeout_at` on this clock: the block is cancelled at ``deadline`` and
        `TimeoutError` raised out of it (None: never)."""
        ...

    def timeout(self, delay_s: float | None) -> Timeout:
        """`timeout_at` ``delay_s`` from now (None: never)."""
        ...


async def _wait_until(clock: Clock, event: asyncio.Event, deadline: float | None) -> bool:
    """`Clock.wait_until` for any clock with `now` and `timeout_at`."""
    while not event.is_set():
        if deadline is not None and clock.now() >= deadline:
            return False
        with contextlib.suppress(TimeoutError):
            async with clock.timeout_at(deadline):
                await event.wait()
    return True


class LoopClock:
    """Real time: the event loop's monotonic clock (the one `asyncio`'s own timers use)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

    async def sleep(self, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))

    async def sleep_until(self, deadline: float | None) -> float:
        if deadline is None:
            await asyncio.Event().wait()  # nothing is due: only the caller's cancellation ends this
        assert deadline is not None
        while (now := self.now()) < deadline:  # noqa: ASYNC110  (a loop timer may fire a clock tick early: sleep the rest)
            await asyncio.sleep(deadline - now)
        return now

    async def wait_until(self, event: asyncio.Event, deadline: float | None) -> bool:
        return await _wait_until(self, event, deadline)

    def timeout_at(self, deadline: float | None) -> Timeout:
        return asyncio.timeout_at(deadline)

    def timeout(self, delay_s: float | None) -> Timeout:
        return asyncio.timeout(delay_s)


class VirtualClock:
    """Time that advances only through `advance`; for deterministic tests, of a runtime or of whole
    nodes. A deadline already reached is met at once (a timeout on the next loop round, as asyncio's)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once when `advance` reaches ``when`` (a time passed: at the next `advance`)."""
        t = _VirtualTimer(callback)
        heapq.heappush(self._timers, (when, next(self._seq), t))
        return t

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self._now + max(0.0, delay_s), callback)

    async def sleep(self, delay_s: float) -> None:
        await self.sleep_until(self._now + max(0.0, delay_s))

    async def sleep_until(self, deadline: float | None) -> float:
        if deadline is None:
            await asyncio.Event().wait()  # nothing is due: only the caller's cancellation ends this
        assert deadline is not None
        if self._now >= deadline:
            return self._now
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t = self.call_at(deadline, lambda: _settle(fut))
        try:
            await fut
        finally:
            t.cancel()
        return self._now

    async def wait_until(self, event: asyncio.Event, deadline: float | None) -> bool:
        return await _wait_until(self, event, deadline)

    def timeout_at(self, deadline: float | None) -> Timeout:
        return _VirtualTimeout(self, deadline)

    def timeout(self, delay_s: float | None) -> Timeout:
        return _VirtualTimeout(self, None if delay_s is None else self._now + delay_s)

    def next_timer(self) -> float | None:
        """When the earliest pending timer is due (None: none is)."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    async def advance(self, delta_s: float) -> None:
        """Move time forward by ``delta_s``, waking every sleeper whose deadline passes, in deadline
        order; after each, `now` stays at that deadline until the tasks it woke have run as far as
        they can (`settle`): what a deadline sets off happens at the deadline."""
        await self.advance_to(self._now + delta_s)

    async def advance_to(self, target: float) -> None:
        """`advance` to time ``target`` (never backwards)."""
        await settle()
        while self._timers and self._timers[0][0] <= target:
            when, _, t = heapq.heappop(self._timers)
            if t.cancelled:
                continue
            self._now = max(self._now, when)
            t.fire()
            await settle()
        self._now = max(self._now, target)
        await settle()


async def settle() -> None:
    """Let every other task that is ready run, until none is (at most `SETTLE_ROUNDS` loop rounds):
    what is left waits on something — a timer, an event, a thread, a socket. (Reads the loop's ready
    queue where the loop has one, as the default loop does; elsewhere, yields a fixed 50 rounds.)"""
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    for _ in range(SETTLE_ROUNDS if ready is not None else 50):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _VirtualTimer:
    __slots__ = ("_callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback: Callable[[], None] | None = callback

    @property
    def cancelled(self) -> bool:
        return self._callback is None

    def cancel(self) -> None:
        self._callback = None

    def fire(self) -> None:
        cb, self._callback = self._callback, None
        if cb is not None:
            cb()


class _VirtualTimeout:
    """`asyncio.Timeout`'s rules on a `VirtualClock`: at the deadline the task is cancelled, and
    the cancellation that the timeout made (none other) leaves the block as `TimeoutError`."""

    def __init__(self, clock: VirtualClock, deadline: float | None) -> None:
        self._clock = clock
        self._deadline = deadline
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._timer: Timer | None = None
        self._expired = False

    async def __aenter__(self) -> _VirtualTimeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a timeout works inside a task")
        self._task, self._cancelling = task, task.cancelling()
        if self._deadline is not None:
            if self._deadline <= self._clock.now():
                self._timer = asyncio.get_running_loop().call_soon(self._expire)
            else:
                self._timer = self._clock.call_at(self._deadline, self._expire)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._expired:
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and et is asyncio.CancelledError:
                raise TimeoutError from e
        return None

    def _expire(self) -> None:
        assert self._task is not None
        self._timer = None
        self._expired = True
        self._task.cancel()
