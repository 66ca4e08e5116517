"""`aurora.protocol.link.Link` as shipped: two links joined by a pipe that keeps order and may lose
control frames (never data: ZeroMQ and SCTP deliver data reliably, a control frame is best
effort), driven by a virtual clock, with applications that send and read, ends that close, abort,
fail, fall silent or send garbage.

Invariants held after every step: credit never goes negative and a sender is never more than
``window`` messages ahead of what it was told was read (nor of what was read); a receiver never
holds more than ``window`` unread messages (no honest peer overruns it); data arrives once and in
order; a link is lost only once the peer has been silent for ``lost_after_s``, and is lost at the
first tick after that; heartbeats on time keep both ends alive; a close reaches the peer with
its reason, `Closed` comes exactly once and nothing is sent after it; a peer past the fault
budget is cut off and one within it never is; after a tick, `next_deadline()` is in the future."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aurora.errors import ProtocolError, TransportClosed
from aurora.protocol.link import (
    FAULT_WINDOW_S,
    FAULTS_TO_CLOSE,
    Closed,
    Deliver,
    FaultBudget,
    Faulted,
    Link,
    LinkState,
    LinkTimings,
    Output,
    PeerLost,
    PeerRejoined,
    SendFrame,
    Writable,
)
from aurora.protocol.messages import MAX_REASON_CHARS, LinkBeat, LinkClose, LinkCredit, LinkData, LinkFrame

TIMINGS = LinkTimings(heartbeat_s=1.0, suspect_after_s=3.0, lost_after_s=6.0)
BEAT_GAP_S = TIMINGS.heartbeat_s * (1 + TIMINGS.jitter)
"""The longest a link waits between its heartbeats."""
EPS = 1e-9
REASONS = st.sampled_from(["done", "x" * (MAX_REASON_CHARS + 10), "bye"])


@dataclass
class End:
    name: str
    link: Link[int]
    pipe: deque[tuple[LinkFrame, int | None]] = field(default_factory=deque)
    """Frames on their way to this end, in order."""
    inbox: deque[int] = field(default_factory=deque)
    alive: bool = True
    """A silenced end (its process frozen or dead) neither ticks, sends nor receives."""
    last_heard: float = 0.0
    next_seq: int = 0
    expect: int = 0
    closes: int = 0
    lost_at: float | None = None
    fault_times: list[float] = field(default_factory=list)
    over_budget: bool = False
    beats: list[float] = field(default_factory=list)
    """When this end sent its heartbeats."""


class TwoLinks(RuleBasedStateMachine):
    @initialize(window=st.integers(1, 6), seed=st.integers(0, 3))
    def start(self, window: int, seed: int) -> None:
        self.now = 0.0
        self.window = window
        # a is a dialling client (it sends nothing until it hears b), b the side that heard a's hello
        a = Link[int]("b", window=window, timings=TIMINGS, now=0.0, incarnation=7, name="a", await_peer=True, seed=seed)
        b = Link[int]("a", window=window, timings=TIMINGS, now=0.0, incarnation=9, seed=seed + 1)
        self.ends = {"a": End("a", a), "b": End("b", b)}
        self._tick_all()

    def other(self, e: End) -> End:
        return self.ends["b" if e.name == "a" else "a"]

    # ------------------------------------------------------------ the driver: execute outputs
    def do(self, e: End, outputs: list[Output[int]], *, was_closed: bool) -> None:
        if was_closed:
            assert all(isinstance(o, Faulted) for o in outputs), outputs  # nothing moves after Closed
        for o in outputs:
            if isinstance(o, SendFrame):
                assert e.alive
                f = o.frame
                if isinstance(f, LinkBeat):
                    assert (f.i, f.r, f.n) == (e.link.incarnation, e.link.read_total, e.link.name)
                    e.beats.append(self.now)
                peer = self.other(e)
                if peer.alive:
                    peer.pipe.append((f, None))
            elif isinstance(o, Deliver):
                assert o.message == e.expect, "data arrives once and in order"
                e.expect += 1
                e.inbox.append(o.message)
            elif isinstance(o, PeerLost):
                assert self.now >= e.last_heard + TIMINGS.lost_after_s, "lost before lost_after_s of silence"
                e.lost_at = self.now
            elif isinstance(o, Closed):
                e.closes += 1
                assert "overran" not in o.reason, "an honest sender overran the window"
                assert o.cut_off == e.link.cut_off
            elif isinstance(o, PeerRejoined):
                raise AssertionError("no end restarts here")
            else:
                assert isinstance(o, Writable | Faulted)

    def _tick(self, e: End) -> None:
        if not e.alive:
            return
        was_closed = e.link.closed
        self.do(e, e.link.tick(self.now), was_closed=was_closed)
        if not was_closed and self.now >= e.last_heard + TIMINGS.lost_after_s:
            assert e.link.closed, "a silent peer is lost at the first tick past the bound"
            assert e.lost_at == self.now
        d = e.link.next_deadline()
        assert d is None or d > self.now, (d, self.now)

    def _tick_all(self) -> None:
        for e in self.ends.values():
            self._tick(e)

    def _deliver(self, e: End) -> None:
        frame, msg = e.pipe.popleft()
        was_closed = e.link.closed
        if not was_closed and not isinstance(frame, LinkClose):
            e.last_heard = max(e.last_heard, self.now)
        self.do(e, e.link.received(frame, self.now, msg), was_closed=was_closed)
        if isinstance(frame, LinkClose) and not was_closed:
            assert e.link.reason == frame.reason, "a close reaches the peer with its reason"

    # ------------------------------------------------------------ the applications
    @rule(name=st.sampled_from("ab"))
    def send(self, name: str) -> None:
        e = self.ends[name]
        if not e.alive:
            return
        link = e.link
        if link.state in (LinkState.CLOSING, LinkState.CLOSED):
            with pytest.raises(TransportClosed):
                link.try_send()
            return
        may = link.state is LinkState.OPEN and link.in_flight < self.window
        assert link.try_send() == may
        if may:
            peer = self.other(e)
            if peer.alive:
                peer.pipe.append((LinkData(), e.next_seq))
            e.next_seq += 1

    @rule(name=st.sampled_from("ab"))
    def read(self, name: str) -> None:
        e = self.ends[name]
        if e.alive and e.inbox:
            e.inbox.popleft()
            was_closed = e.link.closed
            self.do(e, e.link.read(), was_closed=was_closed)

    @rule(
        steps=st.lists(
            st.sampled_from(["send", "read", "deliver"]).flatmap(
                lambda what: st.tuples(st.just(what), st.sampled_from("ab"))
            ),
            max_size=24,
        )
    )
    def traffic(self, steps: list[tuple[str, str]]) -> None:
        """A run of sends, reads and arrivals at one instant."""
        for what, name in steps:
            {"send": self.send, "read": self.read, "deliver": self.deliver}[what](name)

    # ------------------------------------------------------------ the pipe
    @rule(name=st.sampled_from("ab"))
    def deliver(self, name: str) -> None:
        e = self.ends[name]
        if e.pipe:
            self._deliver(e)

    @rule(name=st.sampled_from("ab"))
    def lose_a_control_frame(self, name: str) -> None:
        e = self.ends[name]
        if e.pipe and not isinstance(e.pipe[0][0], LinkData):
            e.pipe.popleft()

    @rule(name=st.sampled_from("ab"))
    def bytes_of_a_piece(self, name: str) -> None:
        e = self.ends[name]
        if e.alive and self.other(e).alive:
            if not e.link.closed:
                e.last_heard = max(e.last_heard, self.now)
            e.link.heard(self.now)

    # ------------------------------------------------------------ time
    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.5, 4.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._tick_all()

    @rule()
    def to_the_next_deadline(self) -> None:
        ds = [d for e in self.ends.values() if e.alive and (d := e.link.next_deadline()) is not None]
        if ds:
            self.now = max(self.now, min(ds))
            self._tick_all()

    @precondition(
        lambda self: all(
            e.alive and e.link.state in (LinkState.AWAITING_PEER, LinkState.OPEN) for e in self.ends.values()
        )
    )
    @rule(duration_s=st.sampled_from([2.0, 7.0, 13.0]))
    def healthy(self, duration_s: float) -> None:
        """Both ends tick at their deadlines and frames arrive at once: after the first heartbeat
        gap, nothing is lost."""
        start, end = self.now, self.now + duration_s
        while True:
            for e in self.ends.values():
                while e.pipe:
                    self._deliver(e)
                while e.inbox:
                    self.read(e.name)
            ds = [d for e in self.ends.values() if (d := e.link.next_deadline()) is not None]
            if not ds or min(ds) > end:
                break
            self.now = max(self.now, min(ds))
            self._tick_all()
        for e in self.ends.values():
            assert e.lost_at is None or e.lost_at <= start + BEAT_GAP_S, "heartbeats on time keep a live peer"
            beats = [t for t in e.beats if t >= start]
            gaps = [y - x for x, y in itertools.pairwise(beats)]
            assert all(TIMINGS.heartbeat_s * (1 - TIMINGS.jitter) - EPS <= g <= BEAT_GAP_S + EPS for g in gaps)
        if all(e.lost_at is None for e in self.ends.values()) and end - start > BEAT_GAP_S:
            assert all(e.link.state is LinkState.OPEN for e in self.ends.values()), "each heard the other"

    # ------------------------------------------------------------ ends
    @rule(name=st.sampled_from("ab"), how=st.sampled_from(["close", "abort", "fail", "silence"]), reason=REASONS)
    def an_end_stops(self, name: str, how: str, reason: str) -> None:
        """The application closes (``close``: the close frame goes, the link is ``CLOSING`` until
        `close_finishes`), aborts, the connection fails (``shut``: no word to the peer) or the
        process falls silent (frozen or dead)."""
        e = self.ends[name]
        if not e.alive:
            return
        before = e.link.state
        was_closed = before is LinkState.CLOSED
        if how == "silence":
            e.alive = False
            e.pipe.clear()
        elif how == "close":
            out = e.link.close(reason)
            if before in (LinkState.AWAITING_PEER, LinkState.OPEN):
                assert out == [SendFrame(LinkClose(reason=reason[:MAX_REASON_CHARS]))]
                assert e.link.state is LinkState.CLOSING
                assert e.link.closing == reason
            else:
                assert out == [], "closing twice is closing once"
                assert e.link.state is before
            self.do(e, out, was_closed=was_closed)
        elif how == "abort":
            out = e.link.abort(reason)
            frames = [o for o in out if isinstance(o, SendFrame)]
            assert len(frames) == (before in (LinkState.AWAITING_PEER, LinkState.OPEN))
            assert e.link.closed
            assert was_closed or e.link.reason == reason
            self.do(e, out, was_closed=was_closed)
        else:
            self.do(e, e.link.shut("send failed"), was_closed=was_closed)
            assert e.link.closed
            assert was_closed or e.link.reason == "send failed"

    @precondition(lambda self: any(e.alive and e.link.state is LinkState.CLOSING for e in self.ends.values()))
    @rule()
    def close_finishes(self) -> None:
        e = next(e for e in self.ends.values() if e.alive and e.link.state is LinkState.CLOSING)
        self.do(e, e.link.shut(e.link.closing or ""), was_closed=False)
        assert e.link.reason == e.link.closing

    # ------------------------------------------------------------ a misbehaving peer
    @rule(name=st.sampled_from("ab"), n=st.sampled_from([1, 1, 1, 3, FAULTS_TO_CLOSE]))
    def faults(self, name: str, n: int) -> None:
        e = self.ends[name]
        if not e.alive:
            return
        for _ in range(n):
            was_closed = e.link.closed
            e.fault_times.append(self.now)
            last = e.fault_times[-FAULTS_TO_CLOSE:]
            over = len(last) == FAULTS_TO_CLOSE and self.now - last[0] < FAULT_WINDOW_S
            e.over_budget = e.over_budget or (over and not was_closed)
            self.do(e, e.link.fault("garbage", self.now), was_closed=was_closed)
            assert e.link.faults == len(e.fault_times)
            assert e.link.cut_off == e.over_budget, "cut off exactly when past the budget"
            if over and not was_closed:
                assert e.link.closed

    # ------------------------------------------------------------ invariants
    @invariant()
    def credit_is_bounded(self) -> None:
        for e in self.ends.values():
            link, peer = e.link, self.other(e).link
            assert 0 <= link.acked <= link.sent
            assert 0 <= link.in_flight <= self.window, "credit never goes negative"
            assert link.acked <= peer.read_total, "only what was read is credited"
            assert link.sent - peer.read_total <= self.window, "never more in flight than the window"
            assert 0 <= link.unread == len(e.inbox) <= self.window
            assert link.sent == e.next_seq

    @invariant()
    def closed_once(self) -> None:
        for e in self.ends.values():
            assert e.closes == (1 if e.link.closed else 0)
            assert (e.link.reason is not None) == e.link.closed
            if e.link.state is LinkState.CLOSING:
                assert e.link.closing is not None
            if e.link.closed:
                assert e.link.next_deadline() is None
                with pytest.raises(TransportClosed, match="closed"):
                    e.link.ensure_open()


TwoLinks.TestCase.settings = settings(stateful_step_count=60, deadline=None)
TestTwoLinks = TwoLinks.TestCase


# ---------------------------------------------------------------- single rules
def test_a_restarted_peer_closes_the_link_and_says_so() -> None:
    link = Link[int]("p", window=4, timings=TIMINGS, now=0.0, await_peer=True)
    assert link.received(LinkBeat(i=5, s=1, r=0), 0.5) == [Writable()]
    assert link.state is LinkState.OPEN
    assert link.remote_incarnation == 5
    assert link.received(LinkBeat(i=4, s=2, r=0), 0.6) == [], "a stale incarnation is ignored"
    out = link.received(LinkBeat(i=6, s=1, r=0), 0.7)
    assert isinstance(out[0], PeerRejoined)
    assert out[1:] == [Closed("peer restarted")]
    assert link.received(LinkBeat(i=6, s=2, r=0), 0.8) == []


def test_a_client_sends_nothing_before_it_hears_the_peer_but_its_hello() -> None:
    link = Link[int]("server", window=2, timings=TIMINGS, now=0.0, incarnation=3, name="me", await_peer=True)
    assert link.tick(0.0) == [SendFrame(LinkBeat(i=3, s=1, r=0, n="me"))]
    assert not link.try_send()
    assert link.received(LinkCredit(n=0), 0.1) == []  # credit is not the peer's heartbeat
    assert not link.try_send()
    assert link.received(LinkBeat(i=1, s=1, r=0), 0.2) == [Writable()]
    assert [link.try_send(), link.try_send(), link.try_send()] == [True, True, False]
    assert link.received(LinkCredit(n=99), 0.3) == [Writable()]
    assert link.acked == 2, "a report above what was sent counts as what was sent"


def test_credit_goes_back_every_half_window_of_reads() -> None:
    link = Link[str]("p", window=4)
    for i in range(4):
        assert link.received(LinkData(), 0.0, f"m{i}") == [Deliver(f"m{i}")]
    assert [link.read(), link.read(), link.read()] == [[], [SendFrame(LinkCredit(n=2))], []]
    for i in range(4, 7):
        assert link.received(LinkData(), 0.0, f"m{i}") == [Deliver(f"m{i}")]
    assert link.received(LinkData(), 0.0, "m7") == [Closed("peer 'p' overran the flow-control window")]
    assert [link.read(), link.read()] == [[], []], "no credit is granted once the link is closed"


def test_a_data_frame_needs_its_message() -> None:
    with pytest.raises(ProtocolError):
        Link[int]("p", window=1).received(LinkData(), 0.0)


def test_a_link_without_timings_has_no_deadline_and_sends_no_heartbeat() -> None:
    link = Link[int]("p", window=1)
    assert link.next_deadline() is None
    assert link.tick(1e9) == []


@given(st.lists(st.floats(0, 1e4, allow_nan=False), max_size=60), st.integers(1, 8), st.sampled_from([0.5, 10.0]))
def test_the_fault_budget_is_a_sliding_window(gaps: list[float], limit: int, window_s: float) -> None:
    budget, now, times = FaultBudget(limit, window_s), 0.0, []
    for g in gaps:
        now += g / 1000
        times.append(now)
        recent = times[-limit:]
        assert budget.spend(now) == (len(recent) == limit and now - recent[0] < window_s)


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 5),
    bulk_bytes=st.integers(1, 5000),
    ops=st.lists(
        st.tuples(st.sampled_from(["send_c", "send_b", "read_c", "read_b", "deliver"]), st.integers(0, 3000)),
        max_size=120,
    ),
)
def test_two_lanes_each_keep_their_own_credit_and_order(
    window: int, bulk_bytes: int, ops: list[tuple[str, int]]
) -> None:
    """Control and bulk credit are separate: a full bulk lane never stops a control send; a sender is at
    most ``window`` control messages and ``bulk_bytes`` bulk bytes (or one bulk message) ahead of what
    was read; an honest sender never overruns the receiver; each lane keeps its own order."""
    from aurora.protocol.messages import Lane

    tx = Link[tuple[Lane, int]]("rx", window=window, bulk_bytes=bulk_bytes)
    rx = Link[tuple[Lane, int]]("tx", window=window, bulk_bytes=bulk_bytes)
    pipe: deque[tuple[Lane, int, int]] = deque()  # (lane, seq, size) on the wire, in order
    inbox: dict[Lane, deque[tuple[int, int]]] = {Lane.CONTROL: deque(), Lane.BULK: deque()}
    sent = {Lane.CONTROL: 0, Lane.BULK: 0}
    got = {Lane.CONTROL: 0, Lane.BULK: 0}

    def frames_to_tx(out: list[Output[tuple[Lane, int]]]) -> None:
        for o in out:
            if isinstance(o, SendFrame):
                tx.received(o.frame, 0.0)

    for op, size in ops:
        if op == "send_c":
            control_room = tx.in_flight < window
            assert tx.try_send(Lane.CONTROL) == control_room, "control credit depends on control alone"
            if control_room:
                pipe.append((Lane.CONTROL, sent[Lane.CONTROL], 0))
                sent[Lane.CONTROL] += 1
        elif op == "send_b":
            if tx.try_send(Lane.BULK, size + 1):
                pipe.append((Lane.BULK, sent[Lane.BULK], size + 1))
                sent[Lane.BULK] += 1
        elif op == "deliver" and pipe:
            lane, seq, sz = pipe.popleft()
            out = rx.received(LinkData(), 0.0, (lane, seq), lane, sz)
            assert not any(isinstance(o, Closed) for o in out), "an honest sender overran the receiver"
            for o in out:
                if isinstance(o, Deliver):
                    inbox[o.lane].append((o.message[1], o.size))
        elif op in ("read_c", "read_b"):
            lane = Lane.CONTROL if op == "read_c" else Lane.BULK
            if inbox[lane]:
                seq, sz = inbox[lane].popleft()
                assert seq == got[lane], "out of order within a lane"
                got[lane] += 1
                frames_to_tx(rx.read(lane, sz))
        assert 0 <= tx.in_flight <= window
        in_pipe_b = [sz for ln, _, sz in pipe if ln is Lane.BULK]
        assert tx.bulk_in_flight <= bulk_bytes or len(in_pipe_b) + len(inbox[Lane.BULK]) <= 1
        assert rx.unread <= window
        assert rx.bulk_unread <= bulk_bytes or len(inbox[Lane.BULK]) <= 1


def test_a_bulk_reader_that_has_read_everything_says_so_at_once() -> None:
    """Without heartbeats (an in-memory link) nothing else would report it: a message larger than what
    is left of the window after an unreported read must still go once the reader has read it all."""
    from aurora.protocol.link import bulk_size
    from aurora.protocol.messages import Lane

    mib = 1 << 20
    tx = Link[int]("rx", window=4, bulk_bytes=16 * mib)
    rx = Link[int]("tx", window=4, bulk_bytes=16 * mib)
    first, second = bulk_size(6 * mib), bulk_size(12 * mib)
    assert tx.try_send(Lane.BULK, first)
    rx.received(LinkData(), 0.0, 1, Lane.BULK, first)
    for out in rx.read(Lane.BULK, first):
        assert isinstance(out, SendFrame)
        tx.received(out.frame, 0.0)
    assert tx.bulk_in_flight == 0
    assert tx.try_send(Lane.BULK, second)
