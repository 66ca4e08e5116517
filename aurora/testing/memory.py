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
from aurora.protocol.messages import BadMessage, decode_app
from aurora.runtime.actor import Credits
from aurora.testing.simnet import Faults
from aurora.transport.base import Message
from aurora.transport.channel import ChannelBase


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


class MemoryChannel(ChannelBase):
    """An in-process `Channel` (aurora.transport.base) with the same flow-control rules.

    Every message is encoded and decoded as on a real link (a message the receiver's
    decoder refuses is its peer's fault there too), and buffers are copied on send, as a
    real link would, so a sender may reuse its buffers.
    """

    def __init__(self, peer: str, window: int, max_frame_bytes: int) -> None:
        super().__init__(peer, window, max_frame_bytes)
        self.other: MemoryChannel | None = None

    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...]) -> None:
        other = self.other
        if other is None:
            raise TransportClosed(f"channel to {self.peer!r} has no peer")
        other.arrive(header, tuple(memoryview(bytes(b)) for b in buffers))

    def arrive(self, header: bytes | memoryview, buffers: tuple[memoryview, ...]) -> None:
        """Bytes from the peer, as a real link's receive path gets them: decoded, or the peer's fault."""
        try:
            msg = decode_app(header, buffers)
        except BadMessage as e:
            self.fault(e.reason)
            return
        self._deliver(Message(msg, buffers))

    def _report_read(self, total: int) -> None:
        if self.other is not None:
            self.other._peer_read(total)

    async def _send_close(self, reason: str) -> None:
        self._notify_close(reason)

    def _notify_close(self, reason: str) -> None:
        if self.other is not None:
            self.other._shut(reason)


def memory_channel_pair(a: str = "a", b: str = "b", *, window: int = 64,
                        max_frame_bytes: int = 64 * 1024 * 1024) -> tuple[MemoryChannel, MemoryChannel]:  # fmt: skip
    """Two connected channels: the first is ``a``'s end (its peer is ``b``), the second ``b``'s."""
    ca, cb = MemoryChannel(b, window, max_frame_bytes), MemoryChannel(a, window, max_frame_bytes)
    ca.other, cb.other = cb, ca
    return ca, cb
