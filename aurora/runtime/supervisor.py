"""OTP-style supervisors on `asyncio.TaskGroup`.

A `Supervisor` starts its children in order (each must become ready before the
next starts), watches them, restarts them by its strategy, and shuts them down
in reverse order. A child is an actor (`ChildSpec.actor`) or a nested
supervisor (`ChildSpec.supervisor`).

Semantics (Erlang/OTP ``supervisor``):

* strategy ``one_for_one`` restarts only the child that exited; ``one_for_all``
  stops all others (reverse order) and restarts all (in order);
  ``rest_for_one`` does that for the exited child and the children after it.
* restart ``permanent`` always restarts; ``transient`` only after a crash;
  ``temporary`` never (the child is dropped).
* restart intensity: more than ``max_restarts`` restarts within ``within_s``
  makes the supervisor stop every child and raise `RestartIntensityExceeded`
  (`RestartBudget` decides; it is pure). A nested supervisor's escalation is a
  crash in its parent.
* backoff: restart *n* in the current window waits ``backoff_s * 2**(n-1)``,
  capped at ``max_backoff_s``.
* shutdown: a child first gets a stop request and ``shutdown_timeout_s`` to
  exit; then its task is cancelled.

Every task lives in the supervisor's TaskGroup; child failures never reach the
group (they are caught in the child's wrapper and reported as exits), so one
crash cannot cancel its siblings behind the strategy's back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from aurora.errors import ActorDead, RestartIntensityExceeded
from aurora.events import CHILD_EXITED, CHILD_RESTARTING, CHILD_SHUTDOWN_TIMEOUT, RESTART_INTENSITY_EXCEEDED
from aurora.protocol.restart import RestartBudget
from aurora.runtime.actor import Actor, ActorCell, ActorRef, Exit
from aurora.runtime.clock import Clock, LoopClock
from aurora.runtime.groups import first_error, wait_first

log = structlog.get_logger("aurora.runtime")

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]
Restart = Literal["permanent", "transient", "temporary"]


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to start one child and what to do when it exits."""

    name: str
    actor: Callable[[], Actor] | None = None
    """Factory for a fresh actor instance (one per incarnation)."""
    supervisor: Callable[[], Supervisor] | None = None
    """Factory for a nested supervisor."""
    restart: Restart = "permanent"
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if (self.actor is None) == (self.supervisor is None):
            raise ValueError(f"child {self.name!r}: give exactly one of actor= or supervisor=")


@dataclass(slots=True)
class _Child:
    spec: ChildSpec
    ref: ActorRef
    task: asyncio.Task[None] | None = None
    cell: ActorCell | None = None
    sup: Supervisor | None = None
    generation: int = 0
    exit_seen: asyncio.Event = field(default_factory=asyncio.Event)


class Supervisor:
    """See the module docstring. Run with ``await sup.run()`` or as a nested child."""

    def __init__(
        self,
        name: str,
        children: list[ChildSpec],
        *,
        strategy: Strategy = "one_for_one",
        max_restarts: int = 3,
        within_s: float = 5.0,
        backoff_s: float = 0.0,
        max_backoff_s: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        names = [c.name for c in children]
        if len(set(names)) != len(names):
            raise ValueError(f"supervisor {name!r}: duplicate child names {names}")
        self.name = name
        self.strategy: Strategy = strategy
        self.clock: Clock = clock or LoopClock()
        self.budget = RestartBudget(max_restarts=max_restarts, within_s=within_s)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._children = [_Child(spec, ActorRef(spec.name, self.clock)) for spec in children]
        self._exits: asyncio.Queue[tuple[_Child, int, Exit, BaseException | None]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self.ready: asyncio.Future[None] | None = None
        self.restarts = 0
        """Restarts performed so far (for tests and status)."""

    # ------------------------------------------------------------------ public
    def ref(self, name: str) -> ActorRef:
        """The stable ref of actor child ``name``."""
        for c in self._children:
            if c.spec.name == name:
                return c.ref
        raise KeyError(f"supervisor {self.name!r} has no child {name!r}")

    def child(self, name: str) -> Supervisor:
        """The running nested supervisor ``name``."""
        for c in self._children:
            if c.spec.name == name and c.sup is not None:
                return c.sup
        raise KeyError(f"supervisor {self.name!r} has no running supervisor child {name!r}")

    async def start_in(self, tg: asyncio.TaskGroup) -> asyncio.Task[None]:
        """Run this supervisor as a task of ``tg``; return once every child is ready.

        Raises the start error if a child fails to start (the task then ends too).
        """
        if self.ready is None:
            self.ready = asyncio.get_running_loop().create_future()
        task = tg.create_task(self.run(), name=f"supervisor/{self.name}")
        await asyncio.shield(self.ready)
        return task

    def stop(self) -> None:
        """Request an orderly shutdown (children in reverse order); `run` then returns."""
        self._stop.set()

    async def run(self) -> None:
        """Start children in order, supervise until stopped, shut down in reverse order.

        Raises the first child's start error, or `RestartIntensityExceeded`.
        Cancellation-safe: cancelling it shuts the children down.
        """
        loop = asyncio.get_running_loop()
        if self.ready is None:
            self.ready = loop.create_future()
        log.info("supervisor_starting", supervisor=self.name, children=[c.spec.name for c in self._children])
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    try:
                        for c in self._children:
                            await self._start(c)
                        self.ready.set_result(None)
                        await self._supervise()
                    finally:
                        await self._shutdown(self._children)
            except BaseExceptionGroup as eg:
                # TaskGroup wraps an error raised in its body; children never raise into it.
                raise first_error(eg) from None
        except BaseException as e:
            if not self.ready.done():
                self.ready.set_exception(e if isinstance(e, Exception) else ActorDead(f"{self.name} cancelled"))
                self.ready.exception()
            raise
        finally:
            self._tg = None
            log.info("supervisor_stopped", supervisor=self.name)

    # ------------------------------------------------------------------ internals
    async def _start(self, c: _Child) -> None:
        assert self._tg is not None
        c.generation += 1
        gen = c.generation
        c.exit_seen = asyncio.Event()
        if c.spec.actor is not None:
            actor = c.spec.actor()
            actor.ref = c.ref
            cell = ActorCell(c.spec.name, actor, self.clock)
            c.cell, c.sup = cell, None
            c.ref._bind(cell)
            c.task = self._tg.create_task(self._watch(c, gen, cell.run()), name=f"{self.name}/{c.spec.name}")
            ready: asyncio.Future[None] = cell.ready
        else:
            assert c.spec.supervisor is not None
            sup = c.spec.supervisor()
            sup.ready = asyncio.get_running_loop().create_future()
            c.sup, c.cell = sup, None
            c.ref._bind(None)
            c.task = self._tg.create_task(self._watch(c, gen, sup.run()), name=f"{self.name}/{c.spec.name}")
            ready = sup.ready
        try:
            await asyncio.shield(ready)
        except Exception as e:
            log.error("child_start_failed", supervisor=self.name, child=c.spec.name, error=repr(e))
            # Its wrapper has reported (or will report) the exit; consume it so it is not "restarted".
            await c.exit_seen.wait()
            self._drain_exit(c)
            raise
        log.info("child_started", supervisor=self.name, child=c.spec.name, generation=gen)

    def _drain_exit(self, c: _Child) -> None:
        keep = []
        while not self._exits.empty():
            item = self._exits.get_nowait()
            if item[0] is not c:
                keep.append(item)
        for item in keep:
            self._exits.put_nowait(item)

    async def _watch(self, c: _Child, gen: int, body: Coroutine[Any, Any, None]) -> None:
        """Run a child; turn its end into an exit report (a crash never reaches the TaskGroup)."""
        try:
            await body
        except asyncio.CancelledError:
            self._exits.put_nowait((c, gen, Exit.KILLED, None))
            raise  # a cancelled task does not abort its TaskGroup
        except Exception as e:  # noqa: BLE001  # a supervisor must see every crash
            self._exits.put_nowait((c, gen, Exit.CRASH, e))
        else:
            self._exits.put_nowait((c, gen, Exit.NORMAL, None))
        finally:
            c.exit_seen.set()

    async def _supervise(self) -> None:
        while True:
            stopped, get = await wait_first(self._stop.wait(), self._exits.get())
            if not stopped.cancelled():
                return
            c, gen, how, err = get.result()
            if gen != c.generation:
                continue  # an old incarnation we already replaced
            await self._on_exit(c, how, err)

    async def _on_exit(self, c: _Child, how: Exit, err: BaseException | None) -> None:
        spec = c.spec
        log.warning(
            CHILD_EXITED,
            supervisor=self.name,
            child=spec.name,
            exit=how.value,
            error=repr(err) if err else None,
        )
        c.task = None
        if spec.restart == "temporary" or (spec.restart == "transient" and how is Exit.NORMAL):
            c.ref._bind(None)
            return
        now = self.clock.now()
        if not self.budget.allow(now):
            log.error(
                RESTART_INTENSITY_EXCEEDED,
                supervisor=self.name,
                child=spec.name,
                max_restarts=self.budget.max_restarts,
                within_s=self.budget.within_s,
            )
            raise RestartIntensityExceeded(
                f"supervisor {self.name!r}: child {spec.name!r} exited ({how.value}: {err!r}) and more than "
                f"{self.budget.max_restarts} restarts happened within {self.budget.within_s} s"
            )
        self.restarts += 1
        idx = self._children.index(c)
        group = {
            "one_for_one": [c],
            "one_for_all": self._children,
            "rest_for_one": self._children[idx:],
        }[self.strategy]
        others = [g for g in group if g is not c and g.task is not None]
        await self._shutdown(others)
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.budget.recent(now) - 1)) if self.backoff_s else 0
        log.info(
            CHILD_RESTARTING,
            supervisor=self.name,
            child=spec.name,
            strategy=self.strategy,
            group=[g.spec.name for g in group],
            backoff_s=delay,
        )
        if delay:
            await self.clock.sleep(delay)
        for g in group:
            if g.task is None and (g is c or g.spec.restart != "temporary"):
                try:
                    await self._start(g)
                except Exception as e:  # noqa: BLE001  # a failed restart is one more exit, same budget
                    self._exits.put_nowait((g, g.generation, Exit.CRASH, e))
                    return

    async def _shutdown(self, children: list[_Child]) -> None:
        for c in reversed(children):
            task = c.task
            if task is None or task.done():
                continue
            log.info("child_stopping", supervisor=self.name, child=c.spec.name)
            if c.cell is not None:
                c.cell.request_stop()
            elif c.sup is not None:
                c.sup.stop()
            try:
                async with self.clock.timeout(c.spec.shutdown_timeout_s):
                    await c.exit_seen.wait()
            except TimeoutError:
                log.warning(
                    CHILD_SHUTDOWN_TIMEOUT, supervisor=self.name, child=c.spec.name, timeout_s=c.spec.shutdown_timeout_s
                )
                task.cancel()
                await c.exit_seen.wait()
            self._drain_exit(c)
            c.task = None
            c.ref._bind(None)
