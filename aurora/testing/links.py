"""`LinkNet`: in-process node transports for whole-tree tests, with kills and partitions.

`LinkTransport` has the shape `aurora.actors.node` needs from a transport
(listen, connect by address, accept, disconnect, close), over `MemoryChannel`
pairs, so the node code under test is the code that runs over ZeroMQ. Faults:

* `partition(a, b)`: every channel between nodes a and b ends at both sides
  with "peer lost" — what heartbeats report after ``lost_after_s`` on a real
  link, without the wait — and new connections between them fail until
  `heal(a, b)`;
* `silence(a, b)` (a net with ``timings``): nothing passes between a and b any more and nobody
  is told — the channels' heartbeats find it out, ``lost_after_s`` after each side last heard
  the other, on the net's clock (a `aurora.runtime.VirtualClock` in a test makes that instant
  exact); a connection between them opened meanwhile reaches nobody; `heal(a, b)` before the
  loss delivers what was held, as TCP would;
* a node that stops (its task cancelled: a crash) closes its transport, and
  its peers see each channel end as "peer lost", as after a process death.

Channels are ordered and lossless while up (ZeroMQ's contract over TCP). With ``timings`` each
channel end heartbeats on ``clock`` like a real link, its timer a task of its node's transport
(`LinkTransport.start_in`: the node's task group); without, there are none.
"""

from __future__ import annotations

import asyncio

from aurora.errors import TransportClosed
from aurora.protocol.link import LinkTimings
from aurora.runtime.clock import Clock, LoopClock
from aurora.testing.memory import MemoryChannel, memory_channel_pair


class LinkNet:
    def __init__(self, *, window: int = 64, timings: LinkTimings | None = None, clock: Clock | None = None) -> None:
        self.window = window
        self.timings = timings
        """Heartbeats and loss on every channel (None: none; a lost link is a closed channel)."""
        self.clock: Clock = clock or LoopClock()
        self.listeners: dict[str, LinkTransport] = {}
        self.live: list[LinkTransport] = []
        self.cut: set[frozenset[str]] = set()
        self.quiet: set[frozenset[str]] = set()
        """Pairs of nodes between which nothing passes, silently (`silence`)."""
        self._seeds = 0

    def partition(self, a: str, b: str) -> None:
        self.cut.add(frozenset((a, b)))
        for t in list(self.live):
            if t.node_id in (a, b):
                t.lose(b if t.node_id == a else a, f"peer lost (partition {a} | {b})")

    def silence(self, a: str, b: str) -> None:
        """See the module docstring (needs ``timings``: without heartbeats nothing would notice)."""
        if self.timings is None:
            raise ValueError("a silent partition needs a net with timings (heartbeats find it out)")
        self.quiet.add(frozenset((a, b)))
        for ch in self._between(a, b):
            ch.hold()

    def heal(self, a: str, b: str) -> None:
        self.cut.discard(frozenset((a, b)))
        self.quiet.discard(frozenset((a, b)))
        for ch in self._between(a, b):
            ch.release()

    def heal_all(self) -> None:
        self.cut.clear()
        for pair in list(self.quiet):
            self.heal(*pair)

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut

    def transport(self, node_id: str, *, bind: str | None = None) -> LinkTransport:
        t = LinkTransport(self, node_id, bind)
        self.live.append(t)
        return t

    def pair(self, a: str, b: str) -> tuple[MemoryChannel, MemoryChannel]:
        """A connected channel pair between ``a`` and ``b`` with the net's window, timings and clock."""
        self._seeds += 2
        return memory_channel_pair(a, b, window=self.window, timings=self.timings, clock=self.clock, seed=self._seeds)

    def _between(self, a: str, b: str) -> list[MemoryChannel]:
        out = []
        for t in self.live:
            if t.node_id in (a, b):
                ch = t.channels.get(b if t.node_id == a else a)
                if ch is not None:
                    out.append(ch)
        return out


class LinkTransport:
    def __init__(self, net: LinkNet, node_id: str, bind: str | None) -> None:
        self.net = net
        self.node_id = node_id
        self.bind = bind
        self.address = ""
        self.channels: dict[str, MemoryChannel] = {}
        """This node's end of each channel, by peer."""
        self._accepted: asyncio.Queue[MemoryChannel] = asyncio.Queue()
        self._tg: asyncio.TaskGroup | None = None
        self.closed = False

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Deliveries are direct; with the net's timings, each channel end's heartbeats are tasks of ``tg``.
        Binds its address, if any (returned; "" without one)."""
        self._tg = tg
        if self.bind is not None:
            old = self.net.listeners.get(self.bind)
            if old is not None and not old.closed:
                raise TransportClosed(f"{self.node_id}: address {self.bind} is in use by {old.node_id!r}")
            self.net.listeners[self.bind] = self
            self.address = self.bind
        return self.address

    async def connect(self, peer: str, address: str) -> MemoryChannel:
        mine, theirs = self.net.pair(self.node_id, peer)
        server = self.net.listeners.get(address)
        if (
            self.closed
            or server is None
            or server.closed
            or server.node_id != peer
            or not self.net.reachable(self.node_id, peer)
        ):
            mine._shut(f"cannot reach {peer!r} at {address}")
            return mine
        self._replace(peer, mine)
        if frozenset((self.node_id, peer)) in self.net.quiet:
            mine.hold()  # nothing reaches the server, which never hears of this connection
            return mine
        server._replace(self.node_id, theirs)
        server._accepted.put_nowait(theirs)
        return mine

    def _replace(self, peer: str, ch: MemoryChannel) -> None:
        old = self.channels.get(peer)
        if old is not None and not old.closed:
            old._shut("replaced by a new connection")
        self.channels[peer] = ch
        if self.net.timings is not None:
            assert self._tg is not None, "start_in() first"
            self._tg.create_task(ch.run_link())  # ends when the channel closes, or with the node

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
