"""Order-preserving parallel map over chunk jobs, for the GIL-free numba kernels.

Invariant: results come out in job order, at most ``2 * threads`` jobs are in
flight (bounded memory), and ``threads <= 1`` runs inline with no pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def pairs_pay(ranked_chunks: int, threads: int) -> bool:
    """Whether to rank chunks two at a time (the pair kernels: two count chains per loop): always on
    one thread; on several, only where the pairs still give every thread work."""
    return threads <= 1 or ranked_chunks >= 2 * threads


def ordered_map(fn: Callable[[J], R], jobs: Iterable[J], threads: int) -> Iterator[R]:
    if threads <= 1:
        for j in jobs:
            yield fn(j)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="aurora-codec") as pool:
        window: deque[Future[R]] = deque()
        for j in jobs:
            window.append(pool.submit(fn, j))
            if len(window) >= 2 * threads:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
