"""PeerLiveness: pure, with virtual time."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from aurora.protocol import Heartbeat, PeerLiveness, PeerLost, PeerRecovered, PeerRejoined, PeerState, PeerSuspected


def _live(**kw: float) -> PeerLiveness:
    return PeerLiveness("me", interval_s=1.0, jitter=0.2, suspect_after_s=3.0, lost_after_s=6.0, **kw)  # type: ignore[arg-type]


def test_silence_becomes_suspected_then_lost_once() -> None:
    lv = _live()
    lv.add_peer("p", 0.0)
    for t in range(0, 10):
        lv.tick(float(t))
    evs = lv.events()
    assert [type(e) for e in evs] == [PeerSuspected, PeerLost]
    assert lv.state("p") is PeerState.LOST


def test_recovery_and_rejoin_as_new_incarnation() -> None:
    lv = _live()
    lv.add_peer("p", 0.0)
    lv.tick(3.5)
    lv.on_heartbeat(Heartbeat("p", 0, 1), 3.6)
    assert [type(e) for e in lv.events()] == [PeerSuspected, PeerRecovered]
    lv.tick(10.0)
    lv.on_heartbeat(Heartbeat("p", 0, 2), 10.1)  # back after being lost: a new incarnation here
    evs = lv.events()
    assert isinstance(evs[-1], PeerRejoined)
    assert evs[-1].incarnation == 1
    lv.on_heartbeat(Heartbeat("p", 1, 3), 10.2)  # it restarted: another incarnation
    assert lv.events() == [PeerRejoined("p", 2)]
    lv.on_heartbeat(Heartbeat("p", 0, 4), 10.3)  # stale incarnation: ignored
    assert lv.events() == []


def test_heartbeat_schedule_is_jittered_and_seeded() -> None:
    def sends(seed: int) -> list[float]:
        lv = _live(seed=seed)
        lv.add_peer("p", 0.0)
        times = []
        t = 0.0
        while t < 20:
            lv.tick(t)
            times += [t for _ in lv.messages_to_send()]
            t = round(t + 0.01, 2)
            lv.on_heartbeat(Heartbeat("p", 0, 0), t)
        return times

    a, b, c = sends(1), sends(1), sends(2)
    assert a == b != c
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert all(0.79 <= g <= 1.21 for g in gaps)
    assert len({round(g, 2) for g in gaps}) > 3


@given(st.lists(st.floats(0.01, 2.99), min_size=1, max_size=60))
def test_a_peer_heard_within_the_bound_is_never_suspected(gaps: list[float]) -> None:
    lv = _live()
    lv.add_peer("p", 0.0)
    t = 0.0
    for g in gaps:
        # tick at arbitrary points inside the gap, then hear from the peer
        lv.tick(t + g / 2)
        t += g
        lv.tick(t - 1e-9)
        lv.on_heartbeat(Heartbeat("p", 0, 0), t)
    assert not [e for e in lv.events() if isinstance(e, PeerSuspected | PeerLost)]


def test_next_deadline_is_when_something_happens() -> None:
    lv = _live()
    lv.add_peer("p", 0.0)
    assert lv.next_deadline() == 0.0
    lv.tick(0.0)
    lv.messages_to_send()
    d = lv.next_deadline()
    assert d is not None
    assert 0.8 <= d <= 1.2


@given(st.floats(0.0, 1e6), st.lists(st.floats(0.0, 10.0), min_size=1, max_size=30))
def test_tick_at_next_deadline_always_makes_progress(t0: float, hears: list[float]) -> None:
    # A deadline that tick() does not honour would make an event loop spin (found by the simulator).
    lv = _live()
    lv.add_peer("p", t0)
    for h in hears:
        lv.on_heartbeat(Heartbeat("p", 0, 0), t0 + h)
    for _ in range(20):
        d = lv.next_deadline()
        assert d is not None
        lv.tick(d)
        lv.messages_to_send()
        d2 = lv.next_deadline()
        assert d2 is not None
        assert d2 > d or lv.state("p") is PeerState.LOST
