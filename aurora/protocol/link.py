"""`Link`: one channel's link rules as a value — credit, close, heartbeats and faults.

Every transport (`aurora.transport.zmq`, `aurora.transport.webrtc`, the in-memory channel of
`aurora.testing.memory`) runs one `Link` per channel under a thin driver
(`aurora.transport.channel.ChannelBase`): the driver moves bytes, decodes them into link frames
(`aurora.protocol.messages`: ``d`` data, ``c`` credit, ``hb`` heartbeat, ``x`` close), feeds them
in with ``now``, does what the outputs say and sleeps until `Link.next_deadline()` or its next
event. Nothing here reads a clock, opens a socket or logs.

Inputs (each returns the outputs, in order): `received` (a link frame from the peer; a data frame
with its decoded message), `heard` (bytes from the peer that are not a whole frame yet), `fault`
(the peer sent something malformed or out of place), `read` (the application took one message),
`try_send` (the application wants to send one), `close` / `abort` / `shut` (local ends), and
`tick` (time passed). Outputs: commands — `SendFrame` (a control frame: best effort, never
waited for), `Deliver`, `Writable` (waiting senders may try again) — and events for the driver to
act on and log — `Faulted`, `PeerLost` (silent too long), `PeerRejoined` (the peer restarted: its
transport opens a fresh channel) and `Closed` (exactly once per link, with the reason).

States (`LinkState`): ``AWAITING_PEER`` (nothing is sent until the peer's first heartbeat, so
nothing goes half-sent to an incarnation never heard: a dialling ZeroMQ client) → ``OPEN`` →
``CLOSING`` (the local side closed: its ``x`` frame is out, the driver lets queued bytes leave)
→ ``CLOSED``. Any state goes straight to ``CLOSED`` on the peer's close, a lost or restarted
peer, an overrun window, too many faults, or a local `abort`/`shut`.

Rules and invariants (tests/test_protocol_link.py holds two connected links to them):

* **Two lanes** (`aurora.protocol.messages.Lane`, chosen per message kind by `lane_of` at both
  ends): control (work, membership, status) and bulk (a version's stream, striped payloads). Each
  has its own credit and its own delivery order, so a control message never waits for credit, or
  to be read, behind bulk ones; order holds within a lane, not across them.
* **Credit** is cumulative per lane, so a lost or late report never leaks any: the sender counts
  what it sent, the receiver what the application has read, and reports those totals (``c``, and
  ``r``/``rb`` on every heartbeat). Control credit counts messages: a sender is at most ``window``
  ahead of the total it was told (``0 <= sent - acked <= window``; a report above what was sent
  counts as what was sent), reported every ``max(1, window // 2)`` reads. Bulk credit counts bytes
  (`bulk_size`: buffers plus a per-message overhead): a sender is at most ``bulk_bytes`` ahead, or
  one message ahead of all it was told however large (reported every ``bulk_bytes // 2``, and
  whenever the application has read every bulk message delivered). So the
  bulk bytes queued in the transport stay within ``bulk_bytes``, and a control message queued
  behind them waits at most that many bytes' time on the wire. `try_send` counts a message only
  while its lane allows it.
* A receiver holds at most ``window`` delivered, unread control messages, and at most
  ``bulk_bytes`` of unread bulk ones (or a single one): a data frame beyond that closes the link
  (the peer overran the window).
* **Liveness** (`aurora.protocol.liveness.PeerLiveness`, one peer): a heartbeat goes out every
  ``heartbeat_s`` (jittered); any frame from the peer shows it alive; a peer silent for
  ``lost_after_s`` is lost (the link closes, ``peer lost: silent for … s``) and one heard within
  it never is; a heartbeat of a newer incarnation than the one first heard means the peer
  restarted (`PeerRejoined`, then the link closes, ``peer restarted``); older ones are stale.
* **Faults**: `FAULTS_TO_CLOSE` within `FAULT_WINDOW_S` cut the peer off (the link is aborted and
  `cut_off` set, so its transport may ban the peer a while); fewer are only counted.
* **Close**: `Closed` is emitted exactly once; after it no input changes anything or sends a frame,
  and `try_send` raises `TransportClosed`. A local close sends one ``x`` frame with the reason
  (`close`, `abort`; `shut` sends none); closing twice is closing once.
* After `tick(now)`, `next_deadline()` is None or later than ``now`` (None once closed, or with
  no liveness, as on an in-memory link).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from aurora.errors import ProtocolError, TransportClosed
from aurora.protocol.liveness import DEFAULT_JITTER, Heartbeat, PeerLiveness, PeerLost, PeerRejoined
from aurora.protocol.messages import MAX_REASON_CHARS, Lane, LinkBeat, LinkClose, LinkCredit, LinkData, LinkFrame

FAULTS_TO_CLOSE = 16
FAULT_WINDOW_S = 10.0
"""A peer may send this many bad messages in this many seconds before its channel is closed: a
slip (one message of a kind this build does not know) is forgiven, a stream of garbage is not."""

DEFAULT_BULK_BYTES = 16 * 1024 * 1024
"""Bulk bytes a sender may have unread at its peer: 1.3 s of a 100 Mbit/s link (what a control message
behind them waits at most), 25x the bandwidth-delay product of such a link at 50 ms RTT."""
BULK_MESSAGE_OVERHEAD = 1024
"""What a bulk message costs in credit besides its buffers, so that empty ones cannot pile up unbounded."""

M = TypeVar("M")


def bulk_size(buffer_bytes: int) -> int:
    """What one bulk message with ``buffer_bytes`` of buffers costs in bulk credit (both ends count alike)."""
    return buffer_bytes + BULK_MESSAGE_OVERHEAD


class LinkState(enum.Enum):
    AWAITING_PEER = "awaiting_peer"
    """Nothing is sent until the peer's first heartbeat (control frames and heartbeats go)."""
    OPEN = "open"
    CLOSING = "closing"
    """Closed locally, the close frame out: the driver lets queued bytes leave, then `shut`s."""
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class LinkTimings:
    """Heartbeats every ``heartbeat_s`` (± ``jitter``), a peer silent ``lost_after_s`` is lost."""

    heartbeat_s: float
    suspect_after_s: float
    lost_after_s: float
    jitter: float = DEFAULT_JITTER


# ---------------------------------------------------------------- outputs
@dataclass(frozen=True, slots=True)
class SendFrame:
    """Put this control frame on the wire, best effort (credit totals repeat on every heartbeat; a
    lost close is made moot by liveness)."""

    frame: LinkCredit | LinkBeat | LinkClose


@dataclass(frozen=True, slots=True)
class Deliver(Generic[M]):
    """Hand the application this message (in order within its lane)."""

    message: M
    lane: Lane = Lane.CONTROL
    size: int = 0
    """Its bulk credit (`bulk_size`), for a bulk message: what `read` is given back."""


@dataclass(frozen=True, slots=True)
class Writable:
    """The peer was heard or reported reads: senders waiting for credit may try again."""


@dataclass(frozen=True, slots=True)
class Faulted:
    """The peer sent something bad (``faults`` on this link so far)."""

    reason: str
    faults: int


@dataclass(frozen=True, slots=True)
class Closed:
    """The link is closed (emitted once); ``cut_off``: for too many faults."""

    reason: str
    cut_off: bool = False


Output = SendFrame | Deliver[M] | Writable | Faulted | PeerLost | PeerRejoined | Closed


class FaultBudget:
    """At most ``limit`` faults within ``window_s``: `spend` says whether one went over."""

    def __init__(self, limit: int = FAULTS_TO_CLOSE, window_s: float = FAULT_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque(maxlen=limit)

    def spend(self, now: float) -> bool:
        """Count one fault at ``now``; True when ``limit`` of them fell within ``window_s``."""
        self._times.append(now)
        return len(self._times) == self.limit and now - self._times[0] < self.window_s

    def reset(self) -> None:
        self._times.clear()


class Link(Generic[M]):
    """One channel's end towards ``peer`` (see the module docstring). ``timings``: heartbeats and
    loss (None: none, as on an in-memory link); ``incarnation`` and ``name`` go in this end's
    heartbeats (``n``: a client's hello); ``await_peer``: start in ``AWAITING_PEER``; ``seed``: the
    heartbeat jitter's."""

    def __init__(
        self,
        peer: str,
        *,
        window: int,
        bulk_bytes: int = DEFAULT_BULK_BYTES,
        timings: LinkTimings | None = None,
        now: float = 0.0,
        incarnation: int = 0,
        name: str | None = None,
        await_peer: bool = False,
        seed: int = 0,
    ) -> None:
        if window < 1 or bulk_bytes < 1:
            raise ValueError(f"window and bulk_bytes must be at least 1, got {window} and {bulk_bytes}")
        self.peer = peer
        self.window = window
        self.bulk_bytes = bulk_bytes
        self.name = name
        self.incarnation = incarnation
        self.state = LinkState.AWAITING_PEER if await_peer else LinkState.OPEN
        self.reason: str | None = None
        """Why the link closed (set with ``CLOSED``)."""
        self.closing: str | None = None
        """The local close's reason (set with ``CLOSING``)."""
        self.sent = 0
        self.acked = 0
        """The peer's reported read total (never above `sent`)."""
        self.delivered = 0
        self.read_total = 0
        self._reported = 0
        self.bulk_sent = 0
        """Bulk bytes sent (`bulk_size` each message), and the peer's reported bulk read total."""
        self.bulk_acked = 0
        self.bulk_delivered = 0
        self.bulk_read = 0
        self._bulk_reported = 0
        self.faults = 0
        self.cut_off = False
        self._budget = FaultBudget()
        self._live: PeerLiveness | None = None
        if timings is not None:
            self._live = PeerLiveness(
                name or "",
                incarnation=incarnation,
                interval_s=timings.heartbeat_s,
                jitter=timings.jitter,
                suspect_after_s=timings.suspect_after_s,
                lost_after_s=timings.lost_after_s,
                seed=seed,
            )
            self._live.add_peer(peer, now)

    # ------------------------------------------------------------ reading the state
    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

    @property
    def in_flight(self) -> int:
        """Messages sent that the peer has not reported read."""
        return self.sent - self.acked

    @property
    def unread(self) -> int:
        """Control messages delivered that the application has not read."""
        return self.delivered - self.read_total

    @property
    def bulk_in_flight(self) -> int:
        """Bulk bytes sent that the peer has not reported read."""
        return self.bulk_sent - self.bulk_acked

    @property
    def bulk_unread(self) -> int:
        """Bulk bytes delivered that the application has not read."""
        return self.bulk_delivered - self.bulk_read

    @property
    def remote_incarnation(self) -> int | None:
        """The incarnation the peer's heartbeats announce (None: none heard, or no liveness)."""
        return None if self._live is None else self._live.remote_incarnation(self.peer)

    def ensure_open(self, direction: str = "to") -> None:
        """Raise `TransportClosed` (with the reason) unless the link may still carry messages."""
        if self.state is LinkState.CLOSED:
            raise TransportClosed(f"channel {direction} {self.peer!r} is closed ({self.reason})")
        if self.state is LinkState.CLOSING:
            raise TransportClosed(f"channel {direction} {self.peer!r} is closing ({self.closing})")

    def next_deadline(self) -> float | None:
        """When `tick` has something to do: the next heartbeat, or the peer's silence turning into
        suspicion or loss (None: only an input moves this link)."""
        if self._live is None or self.state is LinkState.CLOSED:
            return None
        return self._live.next_deadline()

    # ------------------------------------------------------------ inputs
    def tick(self, now: float) -> list[Output[M]]:
        """Time passed: heartbeats due go out; a peer silent for ``lost_after_s`` is lost."""
        if self._live is None or self.state is LinkState.CLOSED:
            return []
        self._live.tick(now)
        out: list[Output[M]] = [SendFrame(self._beat(hb)) for _, hb in self._live.messages_to_send()]
        for ev in self._live.events():
            if isinstance(ev, PeerLost):
                out += [ev, *self._end(f"peer lost: silent for {ev.silent_s:.1f} s")]
        return out

    def heard(self, now: float) -> None:
        """Bytes from the peer (say, a piece of a message not whole yet): it is alive."""
        if self._live is not None and self.state is not LinkState.CLOSED:
            self._live.heard(self.peer, now)
            self._live.events()  # a suspected peer recovered: nothing to do

    def received(
        self, frame: LinkFrame, now: float, message: M | None = None, lane: Lane = Lane.CONTROL, size: int = 0
    ) -> list[Output[M]]:
        """A link frame from the peer; ``message``: a data frame's decoded application message, in
        ``lane`` (`lane_of`), with ``size`` its bulk credit (`bulk_size`) if a bulk one."""
        if self.state is LinkState.CLOSED:
            return []
        if isinstance(frame, LinkData):
            if message is None:
                raise ProtocolError("a data frame is received with its decoded message", remote=False)
            self.heard(now)
            if lane is Lane.BULK:
                if self.bulk_unread and self.bulk_unread + size > self.bulk_bytes:
                    return self._end(f"peer {self.peer!r} overran the bulk flow-control window")
                self.bulk_delivered += size
                return [Deliver(message, lane, size)]
            if self.unread >= self.window:
                return self._end(f"peer {self.peer!r} overran the flow-control window")
            self.delivered += 1
            return [Deliver(message)]
        if isinstance(frame, LinkClose):
            return self._end(frame.reason)
        if isinstance(frame, LinkCredit):
            self.heard(now)
            return [Writable()] if self._credit(frame.n, frame.b) else []
        return self._heartbeat(frame, now)

    def fault(self, reason: str, now: float) -> list[Output[M]]:
        """The peer sent something malformed or out of place: counted; past the budget, cut off."""
        self.faults += 1
        out: list[Output[M]] = [Faulted(reason, self.faults)]
        if self._budget.spend(now) and self.state is not LinkState.CLOSED:
            self.cut_off = True
            why = f"peer {self.peer!r} sent {FAULTS_TO_CLOSE} bad messages within {FAULT_WINDOW_S:g} s (last: {reason[:200]})"
            out += self.abort(why)
        return out

    def read(self, lane: Lane = Lane.CONTROL, size: int = 0) -> list[Output[M]]:
        """The application took one delivered message (of ``lane``, with its ``size`` if bulk); the
        read totals go back every ``window // 2`` control reads or ``bulk_bytes // 2`` bulk bytes."""
        if lane is Lane.BULK:
            self.bulk_read += size
        else:
            self.read_total += 1
        bulk_due = self.bulk_read - self._bulk_reported >= max(1, self.bulk_bytes // 2) or (
            lane is Lane.BULK and not self.bulk_unread and self.bulk_read > self._bulk_reported
        )  # all read: say so, or a next message larger than the rest of the window waits for a heartbeat
        due = self.read_total - self._reported >= max(1, self.window // 2) or bulk_due
        if self.state is not LinkState.CLOSED and due:
            self._reported, self._bulk_reported = self.read_total, self.bulk_read
            return [SendFrame(LinkCredit(n=self.read_total, b=self.bulk_read))]
        return []

    def try_send(self, lane: Lane = Lane.CONTROL, size: int = 0) -> bool:
        """The application wants to send one data message of ``lane`` (``size``: its `bulk_size`, if
        bulk): True counts it sent (the driver puts it on the wire now); False: not yet (no credit in
        its lane, or the peer not heard yet) — wait for `Writable`. Raises `TransportClosed` once the
        link is closing or closed."""
        self.ensure_open()
        if self.state is LinkState.AWAITING_PEER:
            return False
        if lane is Lane.BULK:
            if self.bulk_in_flight and self.bulk_in_flight + size > self.bulk_bytes:
                return False
            self.bulk_sent += size
            return True
        if self.in_flight >= self.window:
            return False
        self.sent += 1
        return True

    def close(self, reason: str) -> list[Output[M]]:
        """Close from this side: the close frame goes out, and the driver `shut`s once queued bytes
        have left (``CLOSING``). Nothing if already closing or closed."""
        if self.state in (LinkState.CLOSING, LinkState.CLOSED):
            return []
        self.state = LinkState.CLOSING
        self.closing = reason
        return [SendFrame(LinkClose(reason=reason[:MAX_REASON_CHARS]))]

    def abort(self, reason: str) -> list[Output[M]]:
        """Close now, telling the peer (unless a close frame went already)."""
        if self.state is LinkState.CLOSED:
            return []
        return [*self.close(reason), *self._end(reason)]

    def shut(self, reason: str) -> list[Output[M]]:
        """Closed, without a word to the peer (the connection failed, or a close finished)."""
        return self._end(reason)

    # ------------------------------------------------------------ helpers
    def _beat(self, hb: Heartbeat) -> LinkBeat:
        return LinkBeat(i=hb.incarnation, s=hb.seq, r=self.read_total, rb=self.bulk_read, n=self.name)

    def _heartbeat(self, beat: LinkBeat, now: float) -> list[Output[M]]:
        if self._live is not None:
            self._live.on_heartbeat(Heartbeat(self.peer, beat.i, beat.s), now)
            self._live.heard(self.peer, now)
            for ev in self._live.events():
                if isinstance(ev, PeerRejoined):  # a new incarnation: what was in flight is gone
                    return [ev, *self._end("peer restarted")]
        opened = self.state is LinkState.AWAITING_PEER
        if opened:
            self.state = LinkState.OPEN
        credited = self._credit(beat.r, beat.rb)
        return [Writable()] if opened or credited else []

    def _credit(self, total: int, bulk_total: int) -> bool:
        moved = False
        if total > self.acked:
            self.acked = min(total, self.sent)
            moved = True
        if bulk_total > self.bulk_acked:
            self.bulk_acked = min(bulk_total, self.bulk_sent)
            moved = True
        return moved

    def _end(self, reason: str) -> list[Output[M]]:
        if self.state is LinkState.CLOSED:
            return []
        self.state = LinkState.CLOSED
        self.reason = reason
        return [Closed(reason, self.cut_off)]


__all__ = [
    "BULK_MESSAGE_OVERHEAD",
    "DEFAULT_BULK_BYTES",
    "FAULTS_TO_CLOSE",
    "FAULT_WINDOW_S",
    "Closed",
    "Deliver",
    "FaultBudget",
    "Faulted",
    "Link",
    "LinkState",
    "LinkTimings",
    "Output",
    "PeerLost",
    "PeerRejoined",
    "SendFrame",
    "Writable",
    "bulk_size",
]
