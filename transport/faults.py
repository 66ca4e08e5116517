"""Faults a node injects into its own links when an operator signals it: `aurora node --faults`,
which `aurora chaos` drives. Off (and free, a set lookup per frame) unless armed.

* ``SIGUSR1`` toggles a **partition** from the node's planned parent: nothing passes between them
  any more, either way, heartbeats included, and nobody is told — each side's heartbeats find it
  out after ``lost_after_s``; a connection to that parent opened meanwhile reaches nobody. The next
  ``SIGUSR1`` heals it (what a lost link delivered is lost, as on a real partition).
* ``SIGUSR2`` toggles **not reading** from that parent: the channel stays up (heartbeats and credit
  frames flow) but the node takes no message from it, so the parent's credit runs out and what it
  queues for this child grows until it cuts the child off; the next ``SIGUSR2`` reads again.

One `InjectedFaults` per process (`FAULTS`): every `ChannelBase` consults it by peer name — a
silenced peer's frames are dropped in both directions at the channel's edge, where the transport
hands them over, so the link machine above sees exactly a silent network.
"""

from __future__ import annotations

import asyncio
import signal

import structlog

from aurora.runtime.groups import wait_first

log = structlog.get_logger("aurora.transport.faults")


class InjectedFaults:
    def __init__(self) -> None:
        self.silent: set[str] = set()
        """Peers nothing passes to or from (a partition)."""
        self.unread: set[str] = set()
        """Peers whose messages are left unread (a node that stops reading)."""
        self._waiters: set[asyncio.Future[None]] = set()
        """Readers waiting for a change (futures of whichever loop they run in)."""

    def silenced(self, peer: str) -> bool:
        return bool(self.silent) and peer in self.silent

    def unreadable(self, peer: str) -> bool:
        return bool(self.unread) and peer in self.unread

    async def until_readable(self, peer: str, closed: asyncio.Event) -> None:
        """Return once ``peer``'s messages may be read again, or ``closed`` is set."""
        while self.unreadable(peer) and not closed.is_set():
            changed = asyncio.get_running_loop().create_future()
            self._waiters.add(changed)
            try:
                await wait_first(changed, closed.wait())
            finally:
                self._waiters.discard(changed)

    def toggle(self, table: set[str], peer: str, what: str) -> None:
        on = peer not in table
        (table.add if on else table.discard)(peer)
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        log.warning("fault_injected" if on else "fault_healed", fault=what, peer=peer)

    def arm(self, loop: asyncio.AbstractEventLoop, parent: str) -> None:
        """Toggle the faults on ``parent`` (the node's planned parent) at ``SIGUSR1`` / ``SIGUSR2``."""
        loop.add_signal_handler(signal.SIGUSR1, self.toggle, self.silent, parent, "partition")
        loop.add_signal_handler(signal.SIGUSR2, self.toggle, self.unread, parent, "not_reading")


FAULTS = InjectedFaults()
