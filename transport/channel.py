"""`ChannelBase`: the thin driver every `Channel` shares over its link machine.

The rules — cumulative credit, the close states, heartbeats and loss, fault counting — are one
sans-IO machine, `aurora.protocol.link.Link` (its docstring states them). This class holds what
is asynchronous: the inbox the application reads, the events senders and closers wait on, and
the execution of the machine's outputs (control frames out, messages delivered, waiters woken,
logs). It reads time through its `Clock` only (`aurora.runtime.clock`: the event loop's by default,
a virtual one in tests), as every transport does.

A transport subclass supplies `_transmit` (put one data message on the wire: its encoded header
and buffers), `_send_control` (one control frame: best effort, never blocks) and, if a close must
wait for queued bytes, `_flush_close`; its receive path decodes what arrives
(`aurora.protocol.messages`) and calls `_received` with each link frame (a data frame with its
`Message`), `_heard` for bytes that are not a whole frame yet, and `fault` for what does not
decode. A transport with heartbeats passes `LinkTimings` and ticks the link when its
`next_deadline()` comes: `run_link` for a channel of its own (it sleeps until the deadline or the
close), or `_tick` from a loop that serves several (the ZeroMQ endpoint).

Faults: a peer's malformed or out-of-place messages are counted and logged (at most a line per
peer every few seconds, with the count); `FAULTS_TO_CLOSE` within `FAULT_WINDOW_S` close the
channel, so a peer that keeps at it is cut off (it may reconnect; its new channel starts with a
clean slate).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable

import structlog
from aurora.transport.base import Message, check_frame
from aurora.transport.faults import FAULTS

from aurora.errors import TransportClosed
from aurora.events import BAD_MESSAGE, CHANNEL_CLOSED
from aurora.logs import Throttle
from aurora.protocol.link import (
    DEFAULT_BULK_BYTES,
    FAULT_WINDOW_S,
    FAULTS_TO_CLOSE,
    Closed,
    Deliver,
    Faulted,
    Link,
    LinkState,
    LinkTimings,
    Output,
    SendFrame,
    Writable,
    bulk_size,
)
from aurora.protocol.liveness import PeerLost, PeerRejoined
from aurora.protocol.messages import (
    AppMessage,
    BadMessage,
    Lane,
    LinkBeat,
    LinkClose,
    LinkCredit,
    LinkData,
    LinkFrame,
    decode_app,
    encode_app,
    lane_of,
)
from aurora.runtime.clock import Clock, LoopClock

log = structlog.get_logger("aurora.transport")

_quiet = Throttle(every_s=5.0)


class ChannelBase:
    def __init__(
        self,
        peer: str,
        window: int,
        max_frame_bytes: int,
        *,
        bulk_bytes: int = DEFAULT_BULK_BYTES,
        timings: LinkTimings | None = None,
        incarnation: int = 0,
        name: str | None = None,
        await_peer: bool = False,
        seed: int = 0,
        clock: Clock | None = None,
    ) -> None:
        self.peer = peer
        self.peer_key: bytes | None = None
        """The CurveZMQ public key (Z85) the peer authenticated with (ZeroMQ with keys; else None)."""
        self.window = window
        self.max_frame_bytes = max_frame_bytes
        self.clock: Clock = clock or LoopClock()
        """What the channel's link reads ``now`` from and its timers wait on."""
        self.link: Link[Message] = Link(
            peer,
            window=window,
            bulk_bytes=bulk_bytes,
            timings=timings,
            now=self.clock.now() if timings is not None else 0.0,
            incarnation=incarnation,
            name=name,
            await_peer=await_peer,
            seed=seed,
        )
        self._inbox: dict[Lane, deque[tuple[Message, int]]] = {lane: deque() for lane in Lane}
        """Per lane, messages delivered and not yet read, each with its bulk credit."""
        self._arrived = asyncio.Event()
        """A message was delivered, or the channel closed: readers look again."""
        self._writable = asyncio.Event()
        self._closed_ev = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self.link.closed

    @property
    def close_reason(self) -> str | None:
        return self.link.reason

    @property
    def faults(self) -> int:
        """Bad messages this peer sent on this channel."""
        return self.link.faults

    @property
    def cut_off(self) -> bool:
        """Closed because the peer kept sending bad messages (its transport may ban it a while)."""
        return self.link.cut_off

    async def send(self, msg: AppMessage, *buffers: bytes | memoryview) -> None:
        """Send one message; waits for credit in its lane (`lane_of`). Cancellation-safe until the
        message is on the wire."""
        self.link.ensure_open()
        header = encode_app(msg)
        check_frame((header, *buffers), self.max_frame_bytes, self.peer)
        if FAULTS.silenced(self.peer):  # an injected partition: lost on the way, before it takes credit
            await asyncio.sleep(0)  # the peer never returns (a sender in a loop still yields)
            return
        lane = lane_of(msg)
        size = bulk_size(sum(memoryview(b).nbytes for b in buffers)) if lane is Lane.BULK else 0
        while not self.link.try_send(lane, size):  # raises TransportClosed once closed
            self._writable.clear()
            await self._writable.wait()
        try:
            await self._transmit(header, buffers, lane)
        except asyncio.CancelledError:
            # Half-sent is indistinguishable from sent for the peer's accounting: end the channel.
            self._shut("send cancelled mid-message")
            raise

    async def recv(self, lane: Lane | None = None) -> Message:
        """The next message of ``lane`` in order (None: of either lane, control first); raises
        `TransportClosed` (with the reason) once closed. Cancellation-safe."""
        lanes = (Lane.CONTROL, Lane.BULK) if lane is None else (lane,)
        while True:
            await FAULTS.until_readable(self.peer, self._closed_ev)
            for one in lanes:
                if self._inbox[one]:
                    msg, size = self._inbox[one].popleft()
                    self._do(self.link.read(one, size))
                    return msg
            if self.link.closed:
                raise TransportClosed(f"channel from {self.peer!r} is closed ({self.link.reason})")
            self._arrived.clear()
            await self._arrived.wait()

    async def close(self, reason: str = "closed") -> None:
        """Close, telling the peer; returns once closed (at once if it was)."""
        if self.link.state is LinkState.CLOSING:
            await self.wait_closed()
            return
        out = self.link.close(reason)
        if out:
            try:
                self._do(out)
                await self._flush_close()
            finally:
                self._shut(reason)

    def fault(self, reason: str) -> None:
        """See the module docstring: count, log (throttled), and close the channel past the limit."""
        self._do(self.link.fault(reason, self.clock.now()))

    async def wait_closed(self) -> None:
        await self._closed_ev.wait()

    def abort(self, reason: str) -> None:
        """Close now, telling the peer if that can be done without waiting."""
        self._do(self.link.abort(reason))

    async def run_link(self) -> None:
        """The link's timer, for a transport that runs one per channel: tick the link at each of its
        deadlines (heartbeats out, a silent peer lost) until the channel closes; returns then. Wakes
        only at a deadline or the close (a frame that moves a deadline later is met by a tick that
        finds nothing due yet)."""
        while not self.closed:
            self._tick(self.clock.now())
            await self.clock.wait_until(self._closed_ev, self.link.next_deadline())

    # -- for the transport's receive path and timer
    def _received(self, frame: LinkFrame, message: Message | None = None) -> None:
        if FAULTS.silenced(self.peer):
            return
        if message is None:
            self._do(self.link.received(frame, self.clock.now()))
            return
        lane = lane_of(message.msg)
        size = bulk_size(message.nbytes) if lane is Lane.BULK else 0
        self._do(self.link.received(frame, self.clock.now(), message, lane, size))

    def _received_app(self, frame: LinkData, header: bytes | memoryview, buffers: tuple[memoryview, ...]) -> None:
        """A data frame's application message, in its header and buffers: decoded and delivered, or
        the peer's fault (the message is dropped)."""
        try:
            msg = decode_app(header, buffers)
        except BadMessage as e:
            self.fault(e.reason)
            return
        self._received(frame, Message(msg, buffers))

    def _heard(self) -> None:
        if FAULTS.silenced(self.peer):
            return
        self.link.heard(self.clock.now())

    def _tick(self, now: float) -> None:
        self._do(self.link.tick(now))

    def _shut(self, reason: str) -> None:
        """Closed without telling the peer."""
        self._do(self.link.shut(reason))

    def _do(self, outputs: Iterable[Output[Message]]) -> None:
        """Execute the link's outputs, in order."""
        for out in outputs:
            if isinstance(out, SendFrame):
                if not FAULTS.silenced(self.peer):
                    self._send_control(out.frame)
            elif isinstance(out, Deliver):
                self._inbox[out.lane].append((out.message, out.size))
                self._arrived.set()
            elif isinstance(out, Writable):
                self._writable.set()
            elif isinstance(out, Faulted):
                suppressed = _quiet.allow(self.peer, self.clock.now())
                if suppressed is not None:
                    log.warning(
                        BAD_MESSAGE, peer=self.peer, reason=out.reason[:300], suppressed=suppressed, faults=out.faults
                    )
            elif isinstance(out, PeerLost):
                log.warning("peer_lost", peer=self.peer, silent_s=round(out.silent_s, 2))
            elif isinstance(out, PeerRejoined):
                self._rejoined(out.incarnation)
            elif isinstance(out, Closed):
                self._writable.set()
                self._closed_ev.set()
                self._arrived.set()
                self._on_shut()
                log.info(CHANNEL_CLOSED, peer=self.peer, reason=out.reason)

    # -- for subclasses
    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...], lane: Lane) -> None:
        """Put one data message of ``lane`` on the wire; messages of one lane keep their order, and two
        sent at once never mix (the lanes may interleave)."""
        raise NotImplementedError

    def _send_control(self, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        """Best effort, never blocks: put one control frame on the wire."""
        raise NotImplementedError

    async def _flush_close(self) -> None:
        """Hook: the close frame is out; wait (bounded) for queued bytes to leave."""

    def _rejoined(self, incarnation: int) -> None:
        """Hook: the peer restarted (the channel closes next; its transport may open a fresh one)."""

    def _on_shut(self) -> None:
        """Hook: the channel has just closed (any cause)."""


__all__ = ["FAULTS_TO_CLOSE", "FAULT_WINDOW_S", "ChannelBase", "LinkTimings"]
