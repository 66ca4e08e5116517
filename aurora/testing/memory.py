"""`MemoryChannel`: an in-process `Channel` pair, for tests of what runs over one link.

A `memory_channel_pair` is two connected channels with the real channels' link machine
(`aurora.transport.channel.ChannelBase` over `aurora.protocol.link.Link`: a window of unread
messages, credit, close, fault counting); every message is encoded and decoded as on a real
link, control frames are handed over as values. Ordered and lossless, as ZeroMQ over TCP is;
whole-tree tests build node transports from these pairs (`aurora.testing.links`).

Without ``timings`` there are no heartbeats (nothing is lost in process: a lost link is a closed
channel, as heartbeats report it). With ``timings`` each end heartbeats its peer on its ``clock``
like a real link — whoever owns the pair runs each end's `ChannelBase.run_link` — so a pair made
silent (`MemoryChannel.hold` on both ends: a partition nobody reports, where TCP keeps what was
sent) closes as "peer lost" exactly ``lost_after_s`` after each end last heard the other, on that
clock; `MemoryChannel.release` before that delivers what was held, in order, as TCP would.
"""

from __future__ import annotations

from collections.abc import Callable

from aurora.errors import TransportClosed
from aurora.protocol.link import DEFAULT_BULK_BYTES, LinkTimings
from aurora.protocol.messages import Lane, LinkBeat, LinkClose, LinkCredit, LinkData, LinkFrame
from aurora.runtime.clock import Clock
from aurora.transport.base import Message
from aurora.transport.channel import ChannelBase


class MemoryChannel(ChannelBase):
    """An in-process `Channel` (aurora.transport.base) with the same flow-control rules.

    Every message is encoded and decoded as on a real link (a message the receiver's
    decoder refuses is its peer's fault there too), and buffers are copied on send, as a
    real link would, so a sender may reuse its buffers.
    """

    def __init__(
        self,
        peer: str,
        window: int,
        max_frame_bytes: int,
        *,
        bulk_bytes: int = DEFAULT_BULK_BYTES,
        timings: LinkTimings | None = None,
        clock: Clock | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(peer, window, max_frame_bytes, bulk_bytes=bulk_bytes, timings=timings, clock=clock, seed=seed)
        self.other: MemoryChannel | None = None
        self.heard_at: float | None = None
        """When a frame from the peer last arrived (on the channel's clock; None: none yet)."""
        self._held: list[Callable[[], None]] | None = None
        """While held: what this end sent, not delivered yet."""

    def hold(self) -> None:
        """From now on what this end sends waits here, undelivered (see the module docstring)."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Deliver what was held, in order, and send directly again (a closed peer takes nothing)."""
        held, self._held = self._held, None
        for deliver in held or ():
            deliver()

    def _out(self, deliver: Callable[[], None]) -> None:
        if self._held is not None:
            if not self.closed:
                self._held.append(deliver)
        else:
            deliver()

    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...], lane: Lane) -> None:
        other = self.other
        if other is None:
            raise TransportClosed(f"channel to {self.peer!r} has no peer")
        copies = tuple(memoryview(bytes(b)) for b in buffers)
        self._out(lambda: other.arrive(header, copies))

    def arrive(self, header: bytes | memoryview, buffers: tuple[memoryview, ...]) -> None:
        """Bytes from the peer, as a real link's receive path gets them: decoded, or the peer's fault."""
        self._received_app(LinkData(), header, buffers)

    def _received(self, frame: LinkFrame, message: Message | None = None) -> None:
        self.heard_at = self.clock.now()
        super()._received(frame, message)

    def _send_control(self, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        other = self.other
        if other is not None:
            self._out(lambda: other._received(frame))

    def _on_shut(self) -> None:
        if self._held is not None:
            self._held.clear()  # a closed link's bytes never arrive


def memory_channel_pair(
    a: str = "a",
    b: str = "b",
    *,
    window: int = 64,
    max_frame_bytes: int = 64 * 1024 * 1024,
    bulk_bytes: int = DEFAULT_BULK_BYTES,
    timings: LinkTimings | None = None,
    clock: Clock | None = None,
    seed: int = 0,
) -> tuple[MemoryChannel, MemoryChannel]:
    """Two connected channels: the first is ``a``'s end (its peer is ``b``), the second ``b``'s.
    ``timings``: heartbeats and loss on ``clock`` (see the module docstring); ``seed``: the ends'
    heartbeat jitter (``seed`` and ``seed + 1``)."""
    ca = MemoryChannel(b, window, max_frame_bytes, bulk_bytes=bulk_bytes, timings=timings, clock=clock, seed=seed)
    cb = MemoryChannel(a, window, max_frame_bytes, bulk_bytes=bulk_bytes, timings=timings, clock=clock, seed=seed + 1)
    ca.other, cb.other = cb, ca
    return ca, cb
