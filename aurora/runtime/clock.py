"""`Clock`: the one place that reads time in the runtime.

`LoopClock` reads the running event loop's monotonic time; `VirtualClock`
(tests) only moves when told to, waking sleepers in deadline order. Timeouts in
the runtime go through `Clock.wait_for`, so a virtual clock drives them too.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, cast

from aurora.runtime.groups import wait_first

T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once after ``delay_s``; the returned timer can cancel it."""
        ...

    async def sleep(self, delay_s: float) -> None: ...

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        """Await ``aw``; raise `TimeoutError` after ``timeout_s`` (``aw`` is cancelled)."""
        ...


class LoopClock:
    """Real time: the event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

    async def sleep(self, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        async with asyncio.timeout(timeout_s):
            return await aw


class VirtualClock:
    """Time that advances only through `advance`; for deterministic runtime tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        t = _VirtualTimer(callback)
        heapq.heappush(self._timers, (self._now + max(0.0, delay_s), next(self._seq), t))
        return t

    async def sleep(self, delay_s: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        t = self.call_later(delay_s, wake)
        try:
            await fut
        finally:
            t.cancel()

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        task, _ = await wait_first(aw, self.sleep(timeout_s))
        if not task.cancelled():
            return cast(T, task.result())
        raise TimeoutError(f"timed out after {timeout_s} s of virtual time")

    async def advance(self, delta_s: float) -> None:
        """Move time forward, waking every sleeper whose deadline passes, in order."""
        target = self._now + delta_s
        while self._timers and self._timers[0][0] <= target:
            when, _, t = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            t.fire()
            # Let woken tasks run (and maybe sleep again) before the next deadline.
            for _ in range(5):
                await asyncio.sleep(0)
        self._now = target


class _VirtualTimer:
    __slots__ = ("_callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self._callback = None

    def fire(self) -> None:
        cb, self._callback = self._callback, None
        if cb is not None:
            cb()
