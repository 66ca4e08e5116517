"""`Fanout`: a node's versions going out to its children — the one table of them, the router's
commands queued per child, and each child's sender.

The driver of `aurora.protocol.routing.VersionRouter`: what the node holds (`HeldVersions`) and what it
is receiving are told to the router by the other parts of the flow; `dispatch` queues each command
the router returns on its child's outbox, and each child's own task (`serve_child`) sends them, so a
slow or stuck child holds up nobody else. A child behind gets what `aurora.actors.catchup` makes.

Invariants: a child is in `children` from `add_child` to `remove_child`, and only its own task sends
to it; an outbox never grows past `MAX_QUEUED` messages nor waits on a streamed delta the history no
longer holds — such a child is cut off (its channel closed: it reconnects and catches up); a
streamed delta that is abandoned (`forget`) leaves every outbox at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from aurora.actors.catchup import CatchUps
from aurora.actors.held import GoneFromHistory, HeldVersions
from aurora.transport.base import Channel

from aurora.errors import TransportClosed
from aurora.protocol.messages import DeltaChunk, DeltaManifest, DeltaSeal
from aurora.protocol.routing import Command, SendCatchUp, SendChunk, SendManifest, SendSeal, VersionRouter
from aurora.runtime.groups import wait_first

MAX_QUEUED = 8192
"""Messages that may wait for one child (a version is its chunks plus two): past it the child is cut off."""

Streamed = SendManifest | SendChunk | SendSeal
"""The commands that send part of a streamed delta (which the history must still hold)."""


def target_of(cmd: SendManifest | SendChunk | SendSeal) -> int:
    return cmd.delta.target if isinstance(cmd, SendManifest) else cmd.target


@dataclass
class Outbox:
    ch: Channel
    queue: deque[Command] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Fanout:
    def __init__(self, held: HeldVersions, catch_ups: CatchUps) -> None:
        self.held = held
        self.catch_ups = catch_ups
        self.router = VersionRouter(held.version)
        self.children: dict[str, Outbox] = {}
        """The attached children — the node's one table of them: each one's channel and what the router
        asked to send it, in order, drained by that child's own task (`serve_child`)."""

    # -- the children
    def add_child(self, ch: Channel, version: int | None) -> None:
        """Attach a child; what it is to be sent goes to its outbox, which `serve_child` drains."""
        self.children[ch.peer] = Outbox(ch)
        self.router.child_attached(ch.peer, version)
        self.dispatch()

    def remove_child(self, peer: str) -> None:
        self.children.pop(peer, None)
        self.router.child_detached(peer)

    def channel(self, peer: str) -> Channel | None:
        """The channel of attached child ``peer`` (None: not attached)."""
        box = self.children.get(peer)
        return None if box is None else box.ch

    def channels(self) -> list[Channel]:
        """Every attached child's channel."""
        return [box.ch for box in self.children.values()]

    def on_child_version(self, peer: str, version: int) -> None:
        self.router.child_version(peer, version)
        self.dispatch()

    def queued_versions(self) -> set[int]:
        """The versions some child's outbox still has a streamed part of."""
        return {target_of(c) for box in self.children.values() for c in box.queue if isinstance(c, Streamed)}

    def forget(self, target: int) -> None:
        """A streamed delta was abandoned: its routing, and what is queued of it, go."""
        self.router.delta_abandoned(target)
        for box in self.children.values():
            box.queue = deque(c for c in box.queue if not (isinstance(c, Streamed) and target_of(c) == target))

    # -- sending
    def dispatch(self) -> None:
        """Queue each of the router's commands on its child's outbox (never waits). A child that is not
        keeping up — what waits for it is of a version the history no longer holds, or past `MAX_QUEUED`
        messages — has its channel closed (it reconnects and catches up)."""
        for cmd in self.router.commands():
            box = self.children.get(cmd.child)
            if box is None:
                continue
            head = box.queue[0] if box.queue else None
            stale = isinstance(head, Streamed) and target_of(head) not in self.held.history
            if stale or len(box.queue) >= MAX_QUEUED:
                box.ch.abort(
                    f"{cmd.child!r} is not reading: it fell {len(box.queue)} messages behind, past the "
                    "versions this node keeps; reconnect to catch up"
                )
                self.remove_child(cmd.child)
                continue
            box.queue.append(cmd)
            box.wake.set()

    async def serve_child(self, ch: Channel) -> None:
        """Send ``ch``'s outbox until the channel closes (then returns). Run by the task that serves
        that child, so what the child does (stop reading, vanish) stalls only this coroutine."""
        box = self.children.get(ch.peer)
        while box is not None and self.children.get(ch.peer) is box and not ch.closed:
            if not box.queue:
                box.wake.clear()
                await wait_first(box.wake.wait(), ch.wait_closed())
                continue
            cmd = box.queue.popleft()
            try:
                await self._send_one(ch, cmd)
            except TransportClosed:
                return
            except GoneFromHistory:
                ch.abort(f"{ch.peer!r} fell behind the versions this node keeps; reconnect to catch up")
                return

    async def _send_one(self, ch: Channel, cmd: Command) -> None:
        if isinstance(cmd, SendManifest):
            stored = self.held.stored(cmd.delta.target)
            await ch.send(
                DeltaManifest(
                    base=cmd.delta.base if not stored.snapshot else None,
                    target=cmd.delta.target,
                    n=cmd.delta.chunks,
                ),
                stored.manifest,
            )
        elif isinstance(cmd, SendChunk):
            chunk = self.held.stored(cmd.target).chunks[cmd.index]
            assert chunk is not None
            await ch.send(DeltaChunk(target=cmd.target, i=cmd.index), chunk)
        elif isinstance(cmd, SendSeal):
            seal = self.held.stored(cmd.target).seal
            assert seal is not None
            await ch.send(DeltaSeal(target=cmd.target, seal=seal))
        elif isinstance(cmd, SendCatchUp):
            await self.catch_ups.send(ch, cmd)
