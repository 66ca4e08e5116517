"""The clock the drivers wait on (`aurora.runtime.clock`): sleeping until a deadline, waiting for an
event or a deadline, timeouts — on real time and on the virtual clock, where every deadline is met
at its instant and nothing else moves time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aurora.runtime import Actor, ChildSpec, LoopClock, Supervisor, VirtualClock


def _no_leaks(before: set[asyncio.Task[Any]]) -> None:
    leaked = {t for t in asyncio.all_tasks() if t not in before and not t.done()} - {asyncio.current_task()}
    assert not leaked, leaked


async def test_the_loop_clock_sleeps_until_the_deadline_and_never_returns_before_it() -> None:
    clock = LoopClock()
    deadline = clock.now() + 0.02
    assert await clock.sleep_until(deadline) >= deadline
    assert clock.now() >= deadline
    assert await clock.sleep_until(deadline - 1.0) >= deadline  # a deadline passed: at once


async def test_the_loop_clock_waits_for_an_event_or_a_deadline() -> None:
    clock, ev = LoopClock(), asyncio.Event()
    start = clock.now()
    assert not await clock.wait_until(ev, start + 0.02)
    assert clock.now() >= start + 0.02
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await clock.wait_until(ev, clock.now() + 5.0)
    assert await clock.wait_until(ev, None)  # set already: at once
    with pytest.raises(TimeoutError):
        async with clock.timeout(0.01):
            await asyncio.Event().wait()


async def test_virtual_sleepers_wake_at_their_deadlines_in_order() -> None:
    clock = VirtualClock(start=100.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, deadline: float) -> None:
        woke.append((name, await clock.sleep_until(deadline)))

    async with asyncio.TaskGroup() as tg:
        for name, d in [("c", 103.0), ("a", 101.0), ("b", 102.5)]:
            tg.create_task(sleeper(name, d))
        await clock.advance(0.5)
        assert woke == []
        await clock.advance(2.0)  # to 102.5: a, then b, each at its own deadline
        assert woke == [("a", 101.0), ("b", 102.5)]
        assert clock.now() == 102.5
        await clock.advance_to(200.0)
    assert woke[-1] == ("c", 103.0)
    assert clock.now() == 200.0
    assert await clock.sleep_until(150.0) == 200.0  # a deadline passed: at once, no timer


async def test_virtual_wait_until_ends_at_the_event_or_exactly_at_the_deadline() -> None:
    clock, ev = VirtualClock(), asyncio.Event()
    before = set(asyncio.all_tasks())
    waiting = asyncio.ensure_future(clock.wait_until(ev, 5.0))
    await clock.advance(4.999)
    assert not waiting.done()
    await clock.advance(0.001)
    assert waiting.done() and waiting.result() is False  # noqa: PT018
    assert clock.now() == 5.0
    waiting = asyncio.ensure_future(clock.wait_until(ev, None))
    await clock.advance(1e6)
    assert not waiting.done()  # no deadline: only the event
    ev.set()
    assert await waiting is True
    ev.clear()
    waiting = asyncio.ensure_future(clock.wait_until(ev, clock.now() + 1.0))
    await clock.advance(0.0)
    waiting.cancel()  # cancellation-safe: goes on as itself, leaves no task or timer behind
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert clock.next_timer() is None
    _no_leaks(before)


async def test_a_virtual_timeout_behaves_as_asyncios() -> None:
    clock = VirtualClock()

    async def blocked(deadline: float | None) -> str:
        try:
            async with clock.timeout_at(deadline):
                await asyncio.Event().wait()
        except TimeoutError:
            return f"timed out at {clock.now()}"
        return "done"

    t = asyncio.ensure_future(blocked(3.0))
    await clock.advance(2.5)
    assert not t.done()
    await clock.advance(1.0)
    assert await t == "timed out at 3.0"

    passed = asyncio.ensure_future(blocked(1.0))  # a deadline already passed: on the next loop round
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await passed == "timed out at 3.5"

    async def finishes() -> str:
        async with clock.timeout(10.0):
            await clock.sleep(1.0)
        return "done"

    t = asyncio.ensure_future(finishes())
    await clock.advance(20.0)
    assert await t == "done"  # its timer went with the block: nothing fires later
    assert clock.next_timer() is None

    outer = asyncio.ensure_future(blocked(None))  # no deadline: a cancellation from outside stays one
    await clock.advance(1.0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer

    async def nested() -> str:
        async with clock.timeout(10.0):
            try:
                async with clock.timeout(1.0):
                    await asyncio.Event().wait()
            except TimeoutError:
                pass
            await clock.sleep(2.0)  # the outer one still runs
        return f"inner timed out, outer not: {clock.now()}"

    start = clock.now()
    t = asyncio.ensure_future(nested())
    await clock.advance(5.0)
    assert await t == f"inner timed out, outer not: {start + 3.0}"


@given(
    deadlines=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=12),
    steps=st.lists(st.floats(0.0, 30.0, allow_nan=False), min_size=1, max_size=12),
)
def test_what_a_deadline_sets_off_happens_at_the_deadline(deadlines: list[float], steps: list[float]) -> None:
    """Each sleeper, and what it sets off (another sleeper half a second on), wakes with `now` exactly
    at its deadline, in deadline order, once time has passed it and never before."""

    async def run() -> None:
        clock = VirtualClock()
        woke: list[tuple[float, float]] = []
        first: list[float] = []

        async def sleeper(d: float, chain: bool, origin: bool = True) -> None:
            woke.append((d, await clock.sleep_until(d)))
            if origin:
                first.append(d)
            if chain:
                await sleeper(d + 0.5, False, False)

        async with asyncio.TaskGroup() as tg:
            for i, d in enumerate(deadlines):
                tg.create_task(sleeper(d, i % 2 == 0))
            for s in steps:
                await clock.advance(s)
                assert all(now == d for d, now in woke)
                assert [d for d, _ in woke] == sorted(d for d, _ in woke)
                assert sorted(first) == sorted(d for d in deadlines if d <= clock.now())
            await clock.advance_to(200.0)
        assert len(woke) == len(deadlines) + len(deadlines[::2])

    asyncio.run(run())


class _Ticker(Actor):
    def __init__(self, seen: list[float]) -> None:
        self.seen = seen

    async def main(self) -> None:
        while True:
            await self.clock.sleep(2.0)
            self.seen.append(self.clock.now())


async def test_an_actor_reads_its_supervisors_clock() -> None:
    clock, seen = VirtualClock(), []
    sup = Supervisor("root", [ChildSpec("t", actor=lambda: _Ticker(seen))], clock=clock)
    async with asyncio.TaskGroup() as tg:
        await sup.start_in(tg)
        await clock.advance(7.0)
        assert seen == [2.0, 4.0, 6.0]
        sup.stop()
        await clock.advance(10.0)  # the shutdown's timeout runs on it too
