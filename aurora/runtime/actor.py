"""Actors: a bounded mailbox, a message loop, lifecycle hooks, tell and ask.

An `Actor` subclass implements `receive` (and optionally `on_start`, `on_stop`,
`on_failure`). It runs inside an `ActorCell` (one incarnation: its mailbox and
its task), which a `Supervisor` owns. Callers hold an `ActorRef`, which stays
valid across restarts: the supervisor points it at each new incarnation.

Rules:

* The mailbox is bounded: `ActorRef.tell` waits for room (backpressure);
  `ActorRef.try_tell` returns False instead of waiting.
* `ask` returns `receive`'s return value, re-raises its exception, or raises
  `TimeoutError` after ``timeout_s``. When an incarnation stops for any reason,
  every message still queued and every pending ask is answered with `ActorDead`.
* An exception from `receive` crashes the actor (after `on_failure`), which its
  supervisor sees; `on_stop` runs on every exit, normal or not.
* A cell is *ready* only when `on_start` has returned; a start error is raised
  to whoever started it.
* An actor reads time and waits for it through `Actor.clock` (its supervisor's `Clock`), never
  the event loop's, so a virtual clock drives it.
* An actor that overrides `main` runs it beside its message loop: an actor that
  owns a connection or a work loop. `main` raising crashes the actor; `main`
  returning ends it normally; a stop request (or a crash) cancels `main`.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog

from aurora.errors import ActorDead
from aurora.runtime.clock import Clock, LoopClock
from aurora.runtime.groups import cancel_and_wait

log = structlog.get_logger("aurora.runtime")


class _Stop:
    """Mailbox sentinel: finish the messages before it, then exit normally."""


_STOP = _Stop()


class Credits:
    """A counting bound with a non-blocking take (asyncio.Semaphore has none)."""

    __slots__ = ("_closed", "_free", "_waiters")

    def __init__(self, n: int) -> None:
        self._free = n
        self._closed = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def close(self) -> None:
        """Release every waiter (their owner re-checks whether the mailbox is closed)."""
        self._closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def try_take(self) -> bool:
        if self._closed:
            return True
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        """Cancellation-safe: a cancelled waiter gives its wake-up to the next one."""
        if self.try_take():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give()  # we were woken and then cancelled: pass the credit on
            else:
                self._waiters.remove(fut)
            raise
        # give() handed us its credit directly.

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


@dataclass(slots=True)
class Envelope:
    msg: Any
    reply: asyncio.Future[Any] | None = None


class Exit(enum.Enum):
    NORMAL = "normal"  # stopped on request, or receive returned StopActor
    CRASH = "crash"  # raised from on_start / receive / on_stop
    KILLED = "killed"  # cancelled (shutdown timeout or parent going down)


class Actor:
    """Base class for actors. Subclasses override `receive` and the hooks they need."""

    mailbox_size: ClassVar[int] = 64
    ref: ActorRef
    clock: Clock = LoopClock()
    """The clock of the cell it runs in (its supervisor's): every timer and deadline of an actor reads
    it (an actor used outside a supervisor, as some tests do, has real time)."""

    async def on_start(self) -> None:
        """Runs before the first message; the actor is ready when it returns."""

    async def receive(self, msg: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not handle {type(msg).__name__}")

    async def main(self) -> None:
        """Optional body that runs beside the message loop (see the module docstring)."""

    async def on_failure(self, exc: BaseException) -> None:
        """Runs when `receive` raised, before the crash is reported."""

    async def on_stop(self) -> None:
        """Runs on every exit (normal, crash or cancellation)."""


@dataclass(slots=True)
class ActorCell:
    """One incarnation of an actor: its instance, mailbox and lifecycle state."""

    name: str
    actor: Actor
    clock: Clock
    mailbox: asyncio.Queue[Envelope | _Stop] = field(init=False)
    """Unbounded queue; the bound is `room`, so a stop request always gets in."""
    room: Credits = field(init=False)
    ready: asyncio.Future[None] = field(init=False)
    closed: bool = False
    current: Envelope | None = None
    """The message being handled (its asker must hear back even if we are cancelled)."""

    def __post_init__(self) -> None:
        self.actor.clock = self.clock
        self.mailbox = asyncio.Queue()
        self.room = Credits(self.actor.mailbox_size)
        self.ready = asyncio.get_running_loop().create_future()

    async def put(self, env: Envelope) -> None:
        await self.room.take()
        self.mailbox.put_nowait(env)

    def try_put(self, env: Envelope) -> bool:
        if not self.room.try_take():
            return False
        self.mailbox.put_nowait(env)
        return True

    async def run(self) -> None:
        """The actor's task body. Cancellation-safe: pending asks get `ActorDead`."""
        a = self.actor
        structlog.contextvars.bind_contextvars(actor=self.name)
        try:
            try:
                await a.on_start()
            except Exception as e:
                if not self.ready.done():
                    self.ready.set_exception(e)
                raise
            self.ready.set_result(None)
            if type(a).main is Actor.main:
                await self._loop()
            else:
                await self._loop_and_main()
        finally:
            self.closed = True
            self.room.close()
            if not self.ready.done():
                self.ready.set_exception(ActorDead(f"actor {self.name!r} stopped before it was ready"))
                self.ready.exception()  # retrieved: nobody may be waiting
            self._fail_pending()
            await a.on_stop()

    async def _loop_and_main(self) -> None:
        """The message loop and `Actor.main` together; the first to end ends both (its error wins)."""
        tasks = [asyncio.ensure_future(self._loop()), asyncio.ensure_future(self.actor.main())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*tasks)
        for t in done:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                raise exc

    async def _loop(self) -> None:
        a = self.actor
        while True:
            env = await self.mailbox.get()
            if isinstance(env, _Stop):
                return
            self.room.give()
            self.current = env
            try:
                result = await a.receive(env.msg)
            except Exception as e:
                if env.reply is not None and not env.reply.done():
                    env.reply.set_exception(e)
                await a.on_failure(e)
                raise
            if env.reply is not None and not env.reply.done():
                env.reply.set_result(result)
            self.current = None

    def _fail_pending(self) -> None:
        cur = self.current
        if cur is not None and cur.reply is not None and not cur.reply.done():
            cur.reply.set_exception(ActorDead(f"actor {self.name!r} stopped while handling this request"))
        while not self.mailbox.empty():
            env = self.mailbox.get_nowait()
            if isinstance(env, Envelope) and env.reply is not None and not env.reply.done():
                env.reply.set_exception(ActorDead(f"actor {self.name!r} stopped"))

    def request_stop(self) -> None:
        """Ask the loop to exit after what is queued; never blocks (it bypasses the bound)."""
        if not self.closed:
            self.mailbox.put_nowait(_STOP)


class ActorRef:
    """A stable handle to an actor; survives restarts (see module docstring)."""

    __slots__ = ("_cell", "clock", "name")

    def __init__(self, name: str, clock: Clock | None = None) -> None:
        self.name = name
        self.clock: Clock = clock or LoopClock()
        self._cell: ActorCell | None = None

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        return self._cell is not None and not self._cell.closed

    def _bind(self, cell: ActorCell | None) -> None:
        self._cell = cell

    def _live_cell(self) -> ActorCell:
        cell = self._cell
        if cell is None or cell.closed:
            raise ActorDead(f"actor {self.name!r} is not running")
        return cell

    async def tell(self, msg: Any) -> None:
        """Queue ``msg``; waits while the mailbox is full. Raises `ActorDead` if not running."""
        cell = self._live_cell()
        env = Envelope(msg)
        if cell.try_put(env):
            return
        await cell.put(env)
        if cell.closed:  # stopped while we waited: the message will never be read
            raise ActorDead(f"actor {self.name!r} stopped")

    def try_tell(self, msg: Any) -> bool:
        """Queue ``msg`` if there is room now; False when full or not running."""
        cell = self._cell
        if cell is None or cell.closed:
            return False
        return cell.try_put(Envelope(msg))

    async def ask(self, msg: Any, timeout_s: float = 10.0) -> Any:
        """Request/reply. Cancellation-safe (the reply is dropped)."""
        cell = self._live_cell()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        env = Envelope(msg, fut)

        async def exchange() -> Any:
            await cell.put(env)
            if cell.closed and not fut.done():
                raise ActorDead(f"actor {self.name!r} stopped")
            return await fut

        if not cell.try_put(env):
            try:
                async with self.clock.timeout(timeout_s):
                    return await exchange()
            except TimeoutError:
                raise TimeoutError(f"ask to actor {self.name!r} timed out after {timeout_s} s") from None

        # Fast path (room in the mailbox): a timer on the reply future, no extra coroutine or task.
        def expire() -> None:
            if not fut.done():
                fut.set_exception(TimeoutError(f"ask to actor {self.name!r} timed out after {timeout_s} s"))

        timer = self.clock.call_later(timeout_s, expire)
        try:
            return await fut
        finally:
            timer.cancel()
