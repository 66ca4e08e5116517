"""`Timeline`: whole nodes under a `aurora.runtime.VirtualClock`, time moving only when nothing else can.

A node hands blocking work to threads (`asyncio.to_thread`: the codec, the learner, the engine) and
waits for time only through its clock (`tests/test_layout.py` holds the drivers to that). A
`Timeline` counts the thread jobs in flight (while `running`, `asyncio.to_thread` is its counting
wrapper) and moves the clock to its next timer only when the loop is idle: no task ready to run, no
thread job in flight (trio's autojump clock, for a loop that also uses threads). So each deadline is
met at its virtual instant, what it sets off runs before time moves on, blocking work takes no
virtual time, and a test of timeouts of minutes runs in the seconds the work itself takes.

Rules: `run_until` fails if an asyncio timer of the real loop is pending while it would move time
(something under test waits behind the clock's back), and when the virtual time it may run to
passes. Work a test wants to hold back (an engine generating for as long as the test says) is
named with `hold`: its calls wait for the returned event, before their thread starts, and do not
count as work in flight while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

from aurora.runtime.clock import VirtualClock, settle

P = ParamSpec("P")
R = TypeVar("R")


class Timeline:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.busy = 0
        """Thread jobs in flight (`asyncio.to_thread` calls not yet returned, held ones excepted)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._held: dict[Any, asyncio.Event] = {}
        self._to_thread = asyncio.to_thread

    @contextlib.contextmanager
    def running(self) -> Iterator[Timeline]:
        """While inside, `asyncio.to_thread` counts its jobs here (restored on the way out)."""
        real, self._to_thread = asyncio.to_thread, asyncio.to_thread
        asyncio.to_thread = self.to_thread  # type: ignore[assignment]
        try:
            yield self
        finally:
            asyncio.to_thread = real

    def hold(self, func: Callable[..., Any]) -> asyncio.Event:
        """Calls of ``func`` through `asyncio.to_thread` wait, uncounted, until the event is set."""
        return self._held.setdefault(func, asyncio.Event())

    async def to_thread(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """`asyncio.to_thread`, counted (see the module docstring)."""
        gate = self._held.get(func)
        if gate is not None:
            await gate.wait()
        self.busy += 1
        self._idle.clear()
        try:
            return await self._to_thread(func, *args, **kwargs)
        finally:
            self.busy -= 1
            if not self.busy:
                self._idle.set()

    async def idle(self) -> None:
        """Until no task is ready to run and no thread job is in flight."""
        while True:
            await settle()
            if not self.busy:
                return
            await self._idle.wait()

    async def run_until(self, cond: Callable[[], bool], *, within_s: float, what: str = "the condition") -> None:
        """Move time deadline by deadline, letting everything run in between, until ``cond()`` holds;
        fails if it does not within ``within_s`` of virtual time."""
        limit = self.clock.now() + within_s
        loop = asyncio.get_running_loop()
        while True:
            await self.idle()
            if cond():
                return
            due = self.clock.next_timer()
            if due is None or due > limit:
                raise AssertionError(
                    f"{what}: not by virtual time {limit:g} (now {self.clock.now():g}, next timer {due})"
                )
            real = [h for h in getattr(loop, "_scheduled", ()) if not h.cancelled()]
            if real:
                raise AssertionError(f"a real-time timer is pending under the virtual clock: {real[0]!r}")
            await self.clock.advance_to(due)

    async def run_for(self, delta_s: float) -> None:
        """Let ``delta_s`` of virtual time pass, every deadline in it met with everything run between."""
        end = self.clock.now() + delta_s
        await self.run_until(lambda: (t := self.clock.next_timer()) is None or t > end, within_s=delta_s)
        await self.clock.advance_to(end)
        await self.idle()
