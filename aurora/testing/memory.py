"""`MemoryChannel`: an in-process `Channel` pair, for tests of what runs over one link.

A `memory_channel_pair` is two connected channels with the real channels' link machine
(`aurora.transport.channel.ChannelBase` over `aurora.protocol.link.Link`: a window of unread
messages, credit, close, fault counting; no heartbeats: nothing is lost in process); every
message is encoded and decoded as on a real link, control frames are handed over as values. Ordered and lossless, as
ZeroMQ over TCP is; whole-tree tests build node transports from these pairs
(`aurora.testing.links`), and a lost link is a closed channel there, as heartbeats report it.
"""

from __future__ import annotations

from aurora.errors import TransportClosed
from aurora.protocol.messages import BadMessage, LinkBeat, LinkClose, LinkCredit, LinkData, decode_app
from aurora.transport.base import Message
from aurora.transport.channel import ChannelBase


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
        self._received(LinkData(), Message(msg, buffers))

    def _send_control(self, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        if self.other is not None:
            self.other._received(frame)


def memory_channel_pair(a: str = "a", b: str = "b", *, window: int = 64,
                        max_frame_bytes: int = 64 * 1024 * 1024) -> tuple[MemoryChannel, MemoryChannel]:  # fmt: skip
    """Two connected channels: the first is ``a``'s end (its peer is ``b``), the second ``b``'s."""
    ca, cb = MemoryChannel(b, window, max_frame_bytes), MemoryChannel(a, window, max_frame_bytes)
    ca.other, cb.other = cb, ca
    return ca, cb
