"""`ChannelBase`: the bookkeeping every `Channel` shares — close state, inbox, flow control.

Flow control is credit-based with *cumulative* counts, so a lost or late
credit report never leaks credit: the sender counts messages sent, the
receiver counts messages the application has read and reports that total
(every ``window // 2`` reads, and again with each heartbeat where the
transport has them). A sender may have at most ``window`` messages that the
peer has not reported read; the receiver's inbox therefore never holds more
than ``window`` messages, and a peer that sends more is cut off.

A transport subclass supplies `_transmit` (put one data message on the wire),
`_report_read` (best-effort, never blocks) and `_send_close`; its receive path
calls `_deliver`, `_peer_read` and `_shut`. A transport whose peer must answer
before anything is sent (so that nothing goes to an incarnation that was never
heard) calls `_await_peer` at creation and `_peer_heard` when the peer answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog
from aurora.transport.base import Message, check_frame

from aurora.errors import TransportClosed

log = structlog.get_logger("aurora.transport")


class ChannelBase:
    def __init__(self, peer: str, window: int, max_frame_bytes: int) -> None:
        self.peer = peer
        self.window = window
        self.max_frame_bytes = max_frame_bytes
        self._inbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self._reason: str | None = None
        self._sent = 0
        self._acked = 0  # the peer's reported read total
        self._read = 0
        self._reported = 0
        self._credit_ev = asyncio.Event()
        self._credit_ev.set()
        self._closed_ev = asyncio.Event()
        self._open_ev = asyncio.Event()
        self._open_ev.set()

    @property
    def closed(self) -> bool:
        return self._reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._reason

    def _check_open(self, what: str = "to") -> None:
        if self._reason is not None:
            raise TransportClosed(f"channel {what} {self.peer!r} is closed ({self._reason})")

    async def send(self, header: Mapping[str, Any], *buffers: bytes | memoryview) -> None:
        """Send one message; waits for credit. Cancellation-safe until the message is on the wire."""
        self._check_open()
        check_frame(buffers, self.max_frame_bytes, self.peer)
        if not self._open_ev.is_set():
            await self._open_ev.wait()
            self._check_open()
        while self._sent - self._acked >= self.window:
            self._credit_ev.clear()
            await self._credit_ev.wait()
            self._check_open()
        self._sent += 1
        try:
            await self._transmit(header, buffers)
        except asyncio.CancelledError:
            # Half-sent is indistinguishable from sent for the peer's accounting: end the channel.
            self._shut("send cancelled mid-message")
            raise

    async def recv(self) -> Message:
        """The next message in order; raises `TransportClosed` (with the reason) once closed."""
        msg = await self._inbox.get()
        if msg is None:
            self._inbox.put_nowait(None)  # keep waking other receivers
            self._check_open("from")
            raise TransportClosed(f"channel from {self.peer!r} is closed")
        self._read += 1
        if self._read - self._reported >= max(1, self.window // 2):
            self._reported = self._read
            self._report_read(self._read)
        return msg

    async def close(self, reason: str = "closed") -> None:
        if self._reason is None:
            try:
                await self._send_close(reason)
            finally:
                self._shut(reason)

    # -- for the transport's receive path
    def _deliver(self, msg: Message) -> None:
        if self._reason is not None:
            return
        if self._inbox.qsize() >= self.window:
            self._shut(f"peer {self.peer!r} overran the flow-control window")
            return
        self._inbox.put_nowait(msg)

    def _peer_read(self, total: int) -> None:
        if total > self._acked:
            self._acked = min(total, self._sent)
            self._credit_ev.set()

    def _await_peer(self) -> None:
        self._open_ev.clear()

    def _peer_heard(self) -> None:
        self._open_ev.set()

    def _shut(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
            self._credit_ev.set()
            self._open_ev.set()
            self._closed_ev.set()
            self._inbox.put_nowait(None)
            self._on_shut()
            log.info("channel_closed", peer=self.peer, reason=reason)

    # -- for subclasses
    async def _transmit(self, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> None:
        raise NotImplementedError

    def _report_read(self, total: int) -> None:
        raise NotImplementedError

    async def _send_close(self, reason: str) -> None:
        raise NotImplementedError

    def _on_shut(self) -> None:
        """Hook: the channel has just closed (any cause)."""
