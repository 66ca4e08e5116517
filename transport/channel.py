"""`ChannelBase`: the bookkeeping every `Channel` shares — close state, inbox, flow control.

Flow control is credit-based with *cumulative* counts, so a lost or late
credit report never leaks credit: the sender counts messages sent, the
receiver counts messages the application has read and reports that total
(every ``window // 2`` reads, and again with each heartbeat where the
transport has them). A sender may have at most ``window`` messages that the
peer has not reported read; the receiver's inbox therefore never holds more
than ``window`` messages, and a peer that sends more is cut off.

A transport subclass supplies `_transmit` (put one data message on the wire:
its encoded header and buffers), `_report_read` (best-effort, never blocks),
`_send_close` and `_notify_close` (best effort, never blocks); its receive path
decodes every message (`aurora.protocol.messages`) and calls `_deliver`,
`_peer_read`, `_shut`, or `fault` for what does not decode.

Faults: a peer's malformed or out-of-place messages are counted and logged (at
most a line per peer every few seconds, with the count); `FAULTS_TO_CLOSE`
within `FAULT_WINDOW_S` close the channel, so a peer that keeps at it is cut
off (it may reconnect; its new channel starts with a clean slate). A transport whose peer must answer
before anything is sent (so that nothing goes to an incarnation that was never
heard) calls `_await_peer` at creation and `_peer_heard` when the peer answers.
"""

from __future__ import annotations

import asyncio
from collections import deque

import structlog
from aurora.transport.base import Message, check_frame

from aurora.errors import TransportClosed
from aurora.events import BAD_MESSAGE, CHANNEL_CLOSED
from aurora.logs import Throttle
from aurora.protocol.messages import AppMessage, encode_app

log = structlog.get_logger("aurora.transport")

FAULTS_TO_CLOSE = 16
FAULT_WINDOW_S = 10.0
"""A peer may send this many bad messages in this many seconds before its channel is closed: a
slip (one message of a kind this build does not know) is forgiven, a stream of garbage is not."""
_quiet = Throttle(every_s=5.0)


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
        self.faults = 0
        """Bad messages this peer sent on this channel."""
        self.cut_off = False
        """Closed because the peer kept sending bad messages (its transport may ban it a while)."""
        self._fault_times: deque[float] = deque(maxlen=FAULTS_TO_CLOSE)

    @property
    def closed(self) -> bool:
        return self._reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._reason

    def _check_open(self, what: str = "to") -> None:
        if self._reason is not None:
            raise TransportClosed(f"channel {what} {self.peer!r} is closed ({self._reason})")

    async def send(self, msg: AppMessage, *buffers: bytes | memoryview) -> None:
        """Send one message; waits for credit. Cancellation-safe until the message is on the wire."""
        self._check_open()
        header = encode_app(msg)
        check_frame((header, *buffers), self.max_frame_bytes, self.peer)
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

    def fault(self, reason: str) -> None:
        """See the module docstring: count, log (throttled), and close the channel past the limit."""
        now = asyncio.get_running_loop().time()
        self.faults += 1
        self._fault_times.append(now)
        suppressed = _quiet.allow(self.peer, now)
        if suppressed is not None:
            log.warning(BAD_MESSAGE, peer=self.peer, reason=reason[:300], suppressed=suppressed, faults=self.faults)
        if len(self._fault_times) == FAULTS_TO_CLOSE and now - self._fault_times[0] < FAULT_WINDOW_S:
            why = f"peer {self.peer!r} sent {FAULTS_TO_CLOSE} bad messages within {FAULT_WINDOW_S:g} s (last: {reason[:200]})"
            self.cut_off = True
            self.abort(why)

    async def wait_closed(self) -> None:
        await self._closed_ev.wait()

    def abort(self, reason: str) -> None:
        """Close now, telling the peer if that can be done without waiting."""
        if self._reason is None:
            self._notify_close(reason)
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
            log.info(CHANNEL_CLOSED, peer=self.peer, reason=reason)

    # -- for subclasses
    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...]) -> None:
        raise NotImplementedError

    def _notify_close(self, reason: str) -> None:
        """Best effort, never blocks: tell the peer the channel closes."""

    def _report_read(self, total: int) -> None:
        raise NotImplementedError

    async def _send_close(self, reason: str) -> None:
        raise NotImplementedError

    def _on_shut(self) -> None:
        """Hook: the channel has just closed (any cause)."""
