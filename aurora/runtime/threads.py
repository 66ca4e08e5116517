"""Work in a thread that never outlives the coroutine that started it.

A thread cannot be stopped. `asyncio.to_thread` hands a cancelled caller its `CancelledError` at
once while the thread goes on, so a supervisor could restart an actor while the old actor's thread
still changes what the new one reads: a learner stepping (not thread-safe), an engine applying the
host weights that the next commit changes in place, a store writing. Every `to_thread` in the
drivers that changes shared state goes through here instead (`tests/test_layout.py` holds
`actors/` to it).

Invariants (tests/test_runtime.py):

* `in_thread(fn, ...)` returns or raises only after ``fn`` has returned or raised in its thread;
* a cancellation that arrives meanwhile (however many times) is raised once the thread has ended,
  never swallowed: if ``fn`` raised meanwhile, that error is chained to the `CancelledError`;
* `to_the_end(fn, ...)` gives the caller the result and whether it was cancelled, for a caller that
  must label what the thread changed before it lets the cancellation go on.

Cancellation-safe in that sense: cancelling the caller cancels nothing half-done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


async def to_the_end(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> tuple[_T, bool]:
    """Run ``fn`` in a thread and await it to its end even if the caller is cancelled meanwhile.
    Returns its result and whether a cancellation came in (the caller then labels what changed and
    raises `asyncio.CancelledError`); if ``fn`` raised and the caller was cancelled, raises
    `asyncio.CancelledError` from that error."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait((fut,))  # never cancels ``fut``; raises nothing of its
        except asyncio.CancelledError:
            cancelled = True  # the thread runs on: wait for it, then say so
    error = fut.exception()
    if error is not None:
        if cancelled:
            raise asyncio.CancelledError from error
        raise error
    return fut.result(), cancelled


async def in_thread(fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`asyncio.to_thread` that a cancelled caller leaves only once the thread has ended (the
    module's invariants)."""
    result, cancelled = await to_the_end(fn, *args, **kwargs)
    if cancelled:
        raise asyncio.CancelledError
    return result
