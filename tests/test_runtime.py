"""Layer 2: real asyncio actors and supervisors that crash on purpose."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from aurora.errors import ActorDead, RestartIntensityExceeded
from aurora.events import CHILD_RESTARTING, CHILD_SHUTDOWN_TIMEOUT, RESTART_INTENSITY_EXCEEDED
from aurora.runtime import Actor, ActorRef, ChildSpec, Supervisor

EVENTS: list[str] = []


class Echo(Actor):
    mailbox_size = 4

    def __init__(self, tag: str = "echo", fail_start: bool = False, slow_stop_s: float = 0.0) -> None:
        self.tag = tag
        self.fail_start = fail_start
        self.slow_stop_s = slow_stop_s
        self.seen = 0

    async def on_start(self) -> None:
        if self.fail_start:
            raise RuntimeError(f"{self.tag} cannot start")
        EVENTS.append(f"start {self.tag}")

    async def receive(self, msg: Any) -> Any:
        self.seen += 1
        if msg == "crash":
            raise RuntimeError(f"{self.tag} crashed on purpose")
        if isinstance(msg, tuple) and msg[0] == "sleep":
            await asyncio.sleep(msg[1])
        return (self.tag, msg, self.seen)

    async def on_stop(self) -> None:
        EVENTS.append(f"stop {self.tag}")
        if self.slow_stop_s:
            await asyncio.sleep(self.slow_stop_s)


async def _running(sup: Supervisor) -> asyncio.Task[None]:
    # A loose task on purpose: tests cancel or await it themselves.
    sup.ready = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(sup.run())
    await asyncio.shield(sup.ready)
    return task


async def _settle(cond: Any, timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110  # polling a predicate over several objects
            await asyncio.sleep(0.005)


@pytest.fixture(autouse=True)
def _clear() -> None:
    EVENTS.clear()


def _no_leaks(before: set[asyncio.Task[Any]]) -> None:
    leaked = {t for t in asyncio.all_tasks() if t not in before and not t.done()} - {asyncio.current_task()}
    assert not leaked, leaked


async def test_tell_ask_and_restart_one_for_one() -> None:
    before = set(asyncio.all_tasks())
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a")), ChildSpec("b", actor=lambda: Echo("b"))])
    task = await _running(sup)
    a, b = sup.ref("a"), sup.ref("b")
    assert await a.ask("hi") == ("a", "hi", 1)
    await b.tell("x")
    assert await b.ask("y") == ("b", "y", 2)
    with pytest.raises(RuntimeError, match="crashed on purpose"):
        await a.ask("crash")
    await _settle(lambda: sup.restarts == 1 and a.alive)
    assert await a.ask("again") == ("a", "again", 1)  # a fresh incarnation
    assert await b.ask("z") == ("b", "z", 3)  # b untouched by one_for_one
    sup.stop()
    await task
    assert EVENTS[-2:] == ["stop b", "stop a"]  # reverse order
    _no_leaks(before)


@pytest.mark.parametrize(
    ("strategy", "restarted"),
    [("one_for_one", ["b"]), ("one_for_all", ["a", "b", "c"]), ("rest_for_one", ["b", "c"])],
)
async def test_strategies_restart_the_right_children(strategy: str, restarted: list[str]) -> None:
    sup = Supervisor("root", [ChildSpec(n, actor=lambda n=n: Echo(n)) for n in "abc"], strategy=strategy)  # type: ignore[arg-type]
    task = await _running(sup)
    EVENTS.clear()
    with pytest.raises(RuntimeError):
        await sup.ref("b").ask("crash")
    await _settle(lambda: all(sup.ref(n).alive for n in "abc") and sup.restarts == 1)
    starts = [e.split()[1] for e in EVENTS if e.startswith("start")]
    assert starts == restarted
    stops = [e.split()[1] for e in EVENTS if e.startswith("stop")]
    assert stops == ["b", *[n for n in reversed(restarted) if n != "b"]]
    sup.stop()
    await task


async def test_intensity_escalates_through_nested_supervisors() -> None:
    before = set(asyncio.all_tasks())
    inner = lambda: Supervisor("inner", [ChildSpec("w", actor=lambda: Echo("w"))], max_restarts=2, within_s=10)  # noqa: E731
    root = Supervisor("root", [ChildSpec("inner", supervisor=inner)], max_restarts=0, within_s=10)
    with capture_logs() as logs:
        task = await _running(root)
        for _ in range(3):
            ref = root.child("inner").ref("w")
            await _settle(lambda ref=ref: ref.alive)
            with pytest.raises(RuntimeError):
                await ref.ask("crash")
        with pytest.raises(RestartIntensityExceeded, match="root"):
            await asyncio.wait_for(task, 5)
    names = [e["event"] for e in logs]
    assert names.count(RESTART_INTENSITY_EXCEEDED) == 2  # inner, then root
    inner_exceeded = next(e for e in logs if e["event"] == RESTART_INTENSITY_EXCEEDED)
    assert inner_exceeded["supervisor"] == "inner"
    assert names.count(CHILD_RESTARTING) == 2  # exactly the budget, never more
    _no_leaks(before)


async def test_start_error_is_raised_to_the_starter() -> None:
    sup = Supervisor(
        "root",
        [ChildSpec("ok", actor=lambda: Echo("ok")), ChildSpec("bad", actor=lambda: Echo("bad", fail_start=True))],
    )
    with pytest.raises(RuntimeError, match="cannot start"):
        await asyncio.wait_for(sup.run(), 5)
    assert "stop ok" in EVENTS  # what had started was shut down


async def test_pending_asks_get_actor_dead_on_stop() -> None:
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a"), shutdown_timeout_s=0.2)])
    task = await _running(sup)
    a = sup.ref("a")
    busy = asyncio.create_task(a.ask(("sleep", 5.0), timeout_s=10))
    queued = asyncio.create_task(a.ask("later", timeout_s=10))
    await asyncio.sleep(0.05)
    sup.stop()
    await task
    with pytest.raises(ActorDead):
        await queued
    with pytest.raises((ActorDead, asyncio.CancelledError)):
        await busy
    with pytest.raises(ActorDead):
        await a.tell("x")


async def test_shutdown_timeout_cancels_a_stuck_child() -> None:
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a"), shutdown_timeout_s=0.1)])
    task = await _running(sup)
    stuck = asyncio.create_task(sup.ref("a").ask(("sleep", 60), timeout_s=120))
    await asyncio.sleep(0.02)
    with capture_logs() as logs:
        sup.stop()
        await asyncio.wait_for(task, 3)
    assert any(e["event"] == CHILD_SHUTDOWN_TIMEOUT for e in logs)
    stuck.cancel()


async def _fill(a: ActorRef, busy_s: float) -> asyncio.Task[Any]:
    """Keep actor ``a`` busy for ``busy_s`` (an ask, returned) and fill its mailbox behind it."""
    busy = asyncio.create_task(a.ask(("sleep", busy_s)))
    await asyncio.sleep(0.02)
    for i in range(Echo.mailbox_size):
        assert a.try_tell(i)
    assert not a.try_tell("overflow")
    return busy


async def test_mailbox_is_bounded_and_tell_waits() -> None:
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a"))])
    task = await _running(sup)
    a = sup.ref("a")
    first = await _fill(a, busy_s=0.3)
    blocked = asyncio.create_task(a.tell("waits"))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # backpressure
    await first
    await asyncio.wait_for(blocked, 2)
    sup.stop()
    await task


async def test_ask_times_out() -> None:
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a"), shutdown_timeout_s=0.1)])
    task = await _running(sup)
    with pytest.raises(TimeoutError, match="timed out"):
        await sup.ref("a").ask(("sleep", 1.0), timeout_s=0.05)
    sup.stop()
    await task


async def test_ask_into_a_full_mailbox_times_out_while_waiting_for_room() -> None:
    sup = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a"), shutdown_timeout_s=0.1)])
    task = await _running(sup)
    a = sup.ref("a")
    busy = await _fill(a, busy_s=0.5)  # the next ask waits for room, under its timeout
    with pytest.raises(TimeoutError, match=r"ask to actor 'a' timed out after 0\.05 s"):
        await a.ask("late", timeout_s=0.05)
    await busy
    sup.stop()
    await task


async def test_transient_and_temporary_children() -> None:
    sup = Supervisor(
        "root",
        [
            ChildSpec("t", actor=lambda: Echo("t"), restart="transient"),
            ChildSpec("tmp", actor=lambda: Echo("tmp"), restart="temporary"),
        ],
    )
    task = await _running(sup)
    with pytest.raises(RuntimeError):
        await sup.ref("tmp").ask("crash")
    await asyncio.sleep(0.05)
    assert not sup.ref("tmp").alive
    assert sup.restarts == 0
    with pytest.raises(RuntimeError):
        await sup.ref("t").ask("crash")
    await _settle(lambda: sup.ref("t").alive)
    assert sup.restarts == 1
    sup.stop()
    await task


async def test_cancelling_the_root_shuts_everything_down() -> None:
    before = set(asyncio.all_tasks())
    inner = lambda: Supervisor("inner", [ChildSpec("w", actor=lambda: Echo("w"))])  # noqa: E731
    root = Supervisor("root", [ChildSpec("a", actor=lambda: Echo("a")), ChildSpec("inner", supervisor=inner)])
    task = await _running(root)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert set(EVENTS) >= {"stop a", "stop w"}
    _no_leaks(before)


async def test_backoff_runs_on_the_supervisors_clock() -> None:
    from aurora.runtime import VirtualClock

    clock = VirtualClock()
    sup = Supervisor(
        "root",
        [ChildSpec("a", actor=lambda: Echo("a"))],
        backoff_s=10.0,
        max_backoff_s=60.0,
        max_restarts=5,
        within_s=1000,
        clock=clock,
    )
    task = await _running(sup)
    with pytest.raises(RuntimeError):
        await sup.ref("a").ask("crash")
    await asyncio.sleep(0.05)
    assert not sup.ref("a").alive  # waiting out 10 s of virtual backoff
    await clock.advance(9.0)
    assert not sup.ref("a").alive
    await clock.advance(1.5)
    await _settle(lambda: sup.ref("a").alive)
    sup.stop()
    await task


class Looper(Actor):
    """An actor with a `main` body: counts ticks, crashes on request, answers asks meanwhile."""

    def __init__(self, crash_after: int | None = None, finish_after: int | None = None) -> None:
        self.ticks = 0
        self.crash_after = crash_after
        self.finish_after = finish_after

    async def main(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1
            if self.crash_after is not None and self.ticks >= self.crash_after:
                raise RuntimeError("main crashed on purpose")
            if self.finish_after is not None and self.ticks >= self.finish_after:
                EVENTS.append("main finished")
                return

    async def receive(self, msg: Any) -> Any:
        return self.ticks

    async def on_stop(self) -> None:
        EVENTS.append("looper stopped")


async def test_main_runs_beside_the_mailbox_and_a_crash_in_it_restarts_the_actor() -> None:
    made: list[Looper] = []

    def make() -> Looper:
        made.append(Looper(crash_after=5 if not made else None))
        return made[-1]

    sup = Supervisor("root", [ChildSpec("loop", actor=make)], max_restarts=3, within_s=10)
    task = await _running(sup)
    await _settle(lambda: len(made) == 2)
    ref = sup.ref("loop")
    await _settle(lambda: made[1].ticks >= 3)
    assert await ref.ask("ticks") >= 3  # the mailbox is served while main runs
    assert sup.restarts == 1
    sup.stop()
    await task
    assert made[1].ticks < 1000
    assert EVENTS.count("looper stopped") == 2


async def test_main_returning_ends_a_transient_actor_normally() -> None:
    sup = Supervisor("root", [ChildSpec("loop", actor=lambda: Looper(finish_after=3), restart="transient")])
    task = await _running(sup)
    await _settle(lambda: "looper stopped" in EVENTS)
    assert EVENTS == ["main finished", "looper stopped"]
    assert sup.restarts == 0
    assert not sup.ref("loop").alive
    sup.stop()
    await task


async def test_a_cancelled_caller_leaves_in_thread_only_once_its_thread_has_ended() -> None:
    """The publisher's learner step, a worker's engine apply: a supervisor that restarts the actor must
    not find the old thread still changing what the new actor reads."""
    import threading
    import time

    from aurora.runtime import in_thread

    started, ended = threading.Event(), threading.Event()

    def work() -> str:
        started.set()
        time.sleep(0.3)
        ended.set()
        return "done"

    task = asyncio.ensure_future(in_thread(work))
    while not started.is_set():  # noqa: ASYNC110 (a thread's event, not the loop's)
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()  # twice: still waits
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set(), "the caller was let go while its thread still ran"


async def test_to_the_end_says_whether_the_caller_was_cancelled_and_chains_the_threads_error() -> None:
    import threading
    import time

    from aurora.runtime import to_the_end

    assert await to_the_end(lambda: 7) == (7, False)
    with pytest.raises(ValueError, match="boom"):
        await to_the_end(_raise_later, 0.0)
    started = threading.Event()

    def slow_then_fail() -> None:
        started.set()
        time.sleep(0.2)
        raise ValueError("late boom")

    task = asyncio.ensure_future(to_the_end(slow_then_fail))
    while not started.is_set():  # noqa: ASYNC110 (a thread's event, not the loop's)
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as got:
        await task
    assert isinstance(got.value.__cause__, ValueError)


def _raise_later(delay_s: float) -> None:
    import time

    time.sleep(delay_s)
    raise ValueError("boom")
