"""`LinkNet`: in-process node transports for whole-tree tests, with kills and partitions.

`LinkTransport` has the shape `aurora.actors.node` needs from a transport
(listen, connect by address, accept, disconnect, close), over `MemoryChannel`
pairs, so the node code under test is the code that runs over ZeroMQ. Faults:

* `partition(a, b)`: every channel between nodes a and b ends at both sides
  with "peer lost" — what heartbeats report after ``lost_after_s`` on a real
  link, without the wait — and new connections between them fail until
  `heal(a, b)`;
* a node that stops (its task cancelled: a crash) closes its transport, and
  its peers see each channel end as "peer lost", as after a process death.

Channels are ordered and lossless while up (ZeroMQ's contract over TCP).
"""

from __future__ import annotations

import asyncio

from aurora.errors import TransportClosed
from aurora.testing.memory import MemoryChannel, memory_channel_pair


class LinkNet:
    def __init__(self, *, window: int = 64) -> None:
        self.window = window
        self.listeners: dict[str, LinkTransport] = {}
        self.live: list[LinkTransport] = []
        self.cut: set[frozenset[str]] = set()

    def partition(self, a: str, b: str) -> None:
        self.cut.add(frozenset((a, b)))
        for t in list(self.live):
            if t.node_id in (a, b):
                t.lose(b if t.node_id == a else a, f"peer lost (partition {a} | {b})")

    def heal(self, a: str, b: str) -> None:
        self.cut.discard(frozenset((a, b)))

    def heal_all(self) -> None:
        self.cut.clear()

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut

    def transport(self, node_id: str, *, bind: str | None = None) -> LinkTransport:
        t = LinkTransport(self, node_id, bind)
        self.live.append(t)
        return t


class LinkTransport:
    def __init__(self, net: LinkNet, node_id: str, bind: str | None) -> None:
        self.net = net
        self.node_id = node_id
        self.bind = bind
        self.address = ""
        self.channels: dict[str, MemoryChannel] = {}
        """This node's end of each channel, by peer."""
        self._accepted: asyncio.Queue[MemoryChannel] = asyncio.Queue()
        self.closed = False

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        """Nothing to run: deliveries are direct."""

    async def listen_in(self, tg: asyncio.TaskGroup) -> str:
        if self.bind is not None:
            old = self.net.listeners.get(self.bind)
            if old is not None and not old.closed:
                raise TransportClosed(f"{self.node_id}: address {self.bind} is in use by {old.node_id!r}")
            self.net.listeners[self.bind] = self
            self.address = self.bind
        return self.address

    async def connect(self, peer: str, address: str) -> MemoryChannel:
        mine, theirs = memory_channel_pair(self.node_id, peer, window=self.net.window)
        server = self.net.listeners.get(address)
        if self.closed or server is None or server.closed or server.node_id != peer or \
                not self.net.reachable(self.node_id, peer):  # fmt: skip
            mine._shut(f"cannot reach {peer!r} at {address}")
            return mine
        self._replace(peer, mine)
        server._replace(self.node_id, theirs)
        server._accepted.put_nowait(theirs)
        return mine

    def _replace(self, peer: str, ch: MemoryChannel) -> None:
        old = self.channels.get(peer)
        if old is not None and not old.closed:
            old._shut("replaced by a new connection")
        self.channels[peer] = ch

    async def accept(self) -> MemoryChannel:
        return await self._accepted.get()

    def lose(self, peer: str, reason: str) -> None:
        """The link to ``peer`` is gone: both ends see ``reason``."""
        ch = self.channels.pop(peer, None)
        if ch is not None:
            ch._shut(reason)
            if ch.other is not None:
                ch.other._shut(reason)

    async def disconnect(self, peer: str) -> None:
        self.lose(peer, "disconnected")

    async def close(self) -> None:
        self.closed = True
        for peer in list(self.channels):
            self.lose(peer, f"peer lost ({self.node_id} stopped)")
        if self.bind is not None and self.net.listeners.get(self.bind) is self:
            del self.net.listeners[self.bind]
        if self in self.net.live:
            self.net.live.remove(self)
