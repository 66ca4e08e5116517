"""Owned tasks: task groups' `ExceptionGroup`s read as their first error, and local races that
leave no task behind.

`unwrap_group()` is the one place that turns a group back into its first error (depth first),
so an error raised inside a task group reads, and is caught, as itself. A group of several
real errors is still reported by its first; the others are chained nowhere (they are usually
the consequences of the first, cancelled siblings excepted, which never appear in a group).

`wait_first()` is the one local race ("a message, or the channel closes"): it runs its
awaitables as tasks, returns once the first ends, and has cancelled *and awaited* the others by
then, so no task outlives the call, the caller's cancellation included. `cancel_and_wait()` is
that ending for a task a caller started itself; neither swallows the caller's `CancelledError`.
Longer-lived tasks belong to a `TaskGroup` (an actor's, a node's), never to these helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from typing import Any


def first_error(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf exception of a (possibly nested) group."""
    first = eg.exceptions[0]
    return first_error(first) if isinstance(first, BaseExceptionGroup) else first


@contextlib.contextmanager
def unwrap_group() -> Iterator[None]:
    """Re-raise an `ExceptionGroup` escaping the block as its first error (see the module docstring)."""
    try:
        yield
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait until each has ended. Their own outcome stays on them (an error
    one raised is the caller's to read, or asyncio's to report), and a cancellation of the caller
    while it waits propagates as usual."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def wait_first(*aws: Awaitable[Any]) -> list[asyncio.Future[Any]]:
    """Run ``aws`` until the first of them ends; cancel and await the rest (a time limit is the
    caller's `Clock.timeout` around the call). Returns their futures in argument order, every one finished: one that ended by itself
    is not ``cancelled()`` (read its ``result()``). Cancellation-safe: cancelled, it ends them all
    before the `CancelledError` goes on."""
    futs: list[asyncio.Future[Any]] = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*[f for f in futs if not f.done()])
    return futs
