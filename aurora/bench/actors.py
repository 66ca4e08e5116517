"""`aurora bench actors`: message throughput of in-process actors vs a bare asyncio.Queue.

Measured in one run: (1) one-way messages per second through `ActorRef.tell`
into an actor's mailbox, next to a producer/consumer pair on a bare bounded
`asyncio.Queue` of the same size; (2) request/reply round trips per second with
`ActorRef.ask`, next to a bare queue carrying (request, future) pairs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aurora.runtime import Actor, ChildSpec, Supervisor
from aurora.store.atomic import write_bytes


class _Counter(Actor):
    def __init__(self) -> None:
        self.n = 0

    async def receive(self, msg: Any) -> Any:
        self.n += 1
        return msg


async def _bare_oneway(n: int, size: int) -> None:
    q: asyncio.Queue[int] = asyncio.Queue(maxsize=size)

    async def consume() -> None:
        for _ in range(n):
            await q.get()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(consume())
        for i in range(n):
            await q.put(i)


async def _bare_roundtrip(n: int, size: int) -> None:
    q: asyncio.Queue[tuple[int, asyncio.Future[int]]] = asyncio.Queue(maxsize=size)
    loop = asyncio.get_running_loop()

    async def serve() -> None:
        for _ in range(n):
            msg, fut = await q.get()
            fut.set_result(msg)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve())
        for i in range(n):
            fut = loop.create_future()
            await q.put((i, fut))
            await fut


async def _best(f: Callable[[], Awaitable[None]], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        await f()
        best = min(best, time.perf_counter() - t0)
    return best


async def _measure(n: int, reps: int) -> dict[str, float]:
    size = _Counter.mailbox_size
    sup = Supervisor("bench", [ChildSpec("counter", actor=_Counter)])
    async with asyncio.TaskGroup() as tg:
        await sup.start_in(tg)
        ref = sup.ref("counter")

        async def tells() -> None:
            for i in range(n):
                await ref.tell(i)
            await ref.ask("sync")

        async def asks() -> None:
            for i in range(n // 4):
                await ref.ask(i)

        t_bare = await _best(lambda: _bare_oneway(n, size), reps)
        t_tell = await _best(tells, reps)
        t_bare_rt = await _best(lambda: _bare_roundtrip(n // 4, size), reps)
        t_ask = await _best(asks, reps)
        sup.stop()
    return {
        "bare_queue_msgs_per_s": n / t_bare,
        "tell_msgs_per_s": n / t_tell,
        "tell_cost_vs_bare": t_tell / t_bare,
        "bare_roundtrips_per_s": (n // 4) / t_bare_rt,
        "ask_roundtrips_per_s": (n // 4) / t_ask,
        "ask_cost_vs_bare": t_ask / t_bare_rt,
    }


def run(*, n: int = 200_000, reps: int = 3, json_path: str | None = None) -> dict[str, float]:
    r = asyncio.run(_measure(n, reps))
    if json_path:
        write_bytes(Path(json_path), json.dumps(r, indent=2).encode())
    print(f"in-process actor messaging, {n} messages, best of {reps}:")
    print(f"  bare asyncio.Queue put/get   {r['bare_queue_msgs_per_s']:>12,.0f} msg/s")
    print(
        f"  ActorRef.tell                {r['tell_msgs_per_s']:>12,.0f} msg/s   ({r['tell_cost_vs_bare']:.2f}x the bare queue's cost)"
    )
    print(f"  bare queue request/reply     {r['bare_roundtrips_per_s']:>12,.0f} round trips/s")
    print(
        f"  ActorRef.ask                 {r['ask_roundtrips_per_s']:>12,.0f} round trips/s   ({r['ask_cost_vs_bare']:.2f}x)"
    )
    return r
