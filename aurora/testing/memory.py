"""`MemoryNetwork` / `MemoryTransport`: in-process message passing with fault hooks.

For layer-2 tests (many actors in one event loop): every endpoint has a
bounded inbox (a sender waits while the destination holds ``capacity``
undelivered messages: backpressure), and the network applies the same
`Faults` as `SimNetwork` — drop, duplicate, delay with jitter (which
reorders), partitions between endpoints, crashed endpoints — from one seeded
RNG. Delayed deliveries are loop callbacks, not tasks.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aurora.errors import TransportClosed
from aurora.runtime.actor import Credits
from aurora.testing.simnet import Faults


class MemoryTransport:
    def __init__(self, net: MemoryNetwork, name: str, capacity: int) -> None:
        self.net = net
        self.name = name
        self._inbox: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self._room = Credits(capacity)
        self.closed_reason: str | None = None

    async def send(self, dst: str, msg: Any) -> None:
        """Send ``msg`` to endpoint ``dst``; waits while ``dst``'s inbox is full."""
        if self.closed_reason is not None:
            raise TransportClosed(f"{self.name}: transport closed ({self.closed_reason})")
        peer = self.net.endpoints.get(dst)
        if peer is None:
            raise TransportClosed(f"{self.name}: no endpoint named {dst!r}")
        await self.net.deliver(self.name, peer, msg)

    async def recv(self) -> tuple[str, Any]:
        """The next (sender, message). Raises `TransportClosed` once closed."""
        item = await self._inbox.get()
        if item is None:
            self._inbox.put_nowait(None)  # keep waking other receivers
            raise TransportClosed(f"{self.name}: transport closed ({self.closed_reason})")
        self._room.give()
        return item

    def _put(self, src: str, msg: Any) -> None:
        if self.closed_reason is None:
            self._inbox.put_nowait((src, msg))

    def close(self, reason: str = "closed") -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            self._room.close()
            self._inbox.put_nowait(None)


class MemoryNetwork:
    def __init__(self, *, seed: int = 0, faults: Faults | None = None) -> None:
        self.rng = random.Random(seed)
        self.faults = faults or Faults(delay_s=0.0)
        self.endpoints: dict[str, MemoryTransport] = {}
        self.dropped = 0

    def endpoint(self, name: str, *, capacity: int = 256) -> MemoryTransport:
        if name in self.endpoints:
            raise ValueError(f"endpoint {name!r} exists")
        ep = MemoryTransport(self, name, capacity)
        self.endpoints[name] = ep
        return ep

    async def deliver(self, src: str, dst: MemoryTransport, msg: Any) -> None:
        f = self.faults
        if f.cut(src, dst.name) or self.rng.random() < f.drop:
            self.dropped += 1
            return
        copies = 2 if self.rng.random() < f.duplicate else 1
        loop = asyncio.get_running_loop()
        for _ in range(copies):
            await dst._room.take()
            delay = f.delay_s + (self.rng.uniform(0, f.jitter_s) if f.jitter_s else 0.0)
            if delay <= 0:
                dst._put(src, msg)
            else:
                loop.call_later(delay, self._arrive, src, dst, msg)

    def _arrive(self, src: str, dst: MemoryTransport, msg: Any) -> None:
        if self.faults.cut(src, dst.name):  # cut while in flight
            self.dropped += 1
            dst._room.give()
            return
        dst._put(src, msg)


class MemoryChannel:
    """An in-process `Channel` (aurora.transport.base) with the same flow control rules."""

    def __init__(self, peer: str, window: int, max_frame_bytes: int) -> None:
        self.peer = peer
        self.window = window
        self.max_frame_bytes = max_frame_bytes
        self.other: MemoryChannel | None = None
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._credit = Credits(window)
        self._reason: str | None = None

    @property
    def closed(self) -> bool:
        return self._reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._reason

    async def send(self, header: Any, *buffers: bytes | memoryview) -> None:
        from aurora.transport.base import Message, check_frame

        if self._reason is not None:
            raise TransportClosed(f"channel to {self.peer!r} is closed ({self._reason})")
        check_frame(buffers, self.max_frame_bytes, self.peer)
        await self._credit.take()
        other = self.other
        if self._reason is not None or other is None:
            raise TransportClosed(f"channel to {self.peer!r} is closed ({self._reason})")
        other._inbox.put_nowait(Message(dict(header), tuple(memoryview(bytes(b)) for b in buffers)))

    async def recv(self) -> Any:
        msg = await self._inbox.get()
        if isinstance(msg, _CloseAfter):
            self._shut(msg.reason)
            msg = None
        if msg is None:
            self._inbox.put_nowait(None)
            raise TransportClosed(f"channel from {self.peer!r} is closed ({self._reason})")
        if self.other is not None:
            self.other._credit.give()
        return msg

    async def close(self, reason: str = "closed") -> None:
        if self.other is not None and self.other._reason is None:
            self.other._inbox.put_nowait(_CloseAfter(reason))
        self._shut(reason)

    def _shut(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
            self._credit.close()
            self._inbox.put_nowait(None)


class _CloseAfter:
    """Queued behind the messages sent before a close, so they are still delivered."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def memory_channel_pair(a: str = "a", b: str = "b", *, window: int = 64,
                        max_frame_bytes: int = 64 * 1024 * 1024) -> tuple[MemoryChannel, MemoryChannel]:  # fmt: skip
    ca, cb = MemoryChannel(b, window, max_frame_bytes), MemoryChannel(a, window, max_frame_bytes)
    ca.other, cb.other = cb, ca
    return ca, cb
