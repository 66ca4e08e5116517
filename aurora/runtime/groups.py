"""Task groups raise `ExceptionGroup`s; callers mostly want the one error that happened.

`unwrap_group()` is the one place that turns a group back into its first error (depth first),
so an error raised inside a task group reads, and is caught, as itself. A group of several
real errors is still reported by its first; the others are chained nowhere (they are usually
the consequences of the first, cancelled siblings excepted, which never appear in a group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
