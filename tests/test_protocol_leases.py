"""LeaseTable and LeaseHolder: pure, against a tiny reference model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aurora.protocol import LeaseHolder, LeaseTable, ResultAccepted, ResultRejected
from aurora.protocol.leases import LeaseExpired, LeaseReleased


def test_grant_complete_and_late_results_are_rejected() -> None:
    t = LeaseTable(ttl_s=10)
    t.add_items(["a", "b"])
    (la,) = t.grant("w1", 0.0)
    assert la.item == "a"
    assert isinstance(t.complete("w1", "a", la.token, 5.0), ResultAccepted)
    dup = t.complete("w1", "a", la.token, 5.5)
    assert isinstance(dup, ResultRejected)
    assert dup.reason == "duplicate"
    (lb,) = t.grant("w1", 6.0)
    t.tick(16.0)  # expired: back to the pool
    (lb2,) = t.grant("w2", 16.5)
    assert lb2.item == "b"
    assert lb2.token > lb.token
    fenced = t.complete("w1", "b", lb.token, 17.0)
    assert isinstance(fenced, ResultRejected)
    assert fenced.reason == "fenced"
    assert isinstance(t.complete("w2", "b", lb2.token, 17.0), ResultAccepted)
    assert [e.lease for e in t.events()] == [lb]  # the queue holds what happened by itself: the expiry
    assert t.finished


def test_renewal_extends_and_an_unrenewed_lease_returns_its_item() -> None:
    t = LeaseTable(ttl_s=10, floor=2)
    t.add_items(range(4))
    ls = t.grant("w", 0.0)
    assert len(ls) == 2
    (r,) = t.renew("w", [ls[0].token], 8.0)
    assert r.expires_at == 18.0
    t.tick(12.0)
    assert t.current(ls[0].item) is not None
    assert t.current(ls[1].item) is None
    assert [e.lease for e in t.events() if isinstance(e, LeaseExpired)] == [ls[1]]
    assert t.in_flight == 1
    assert t.pending == 3
    (again,) = t.grant("w2", 12.5, 1)
    assert again.item == ls[1].item  # an expired lease's item is leased first


def test_work_is_shared_by_measured_throughput() -> None:
    t = LeaseTable(ttl_s=100, floor=1, max_batch=64, batch_s=2)
    t.add_items(range(1000))
    now = 0.0
    # fast completes one item per 0.1 s, slow one per 1 s
    for worker, period in (("fast", 0.1), ("slow", 1.0)):
        now = 0.0
        for _ in range(6):
            for lease in t.grant(worker, now):
                now += period
                assert isinstance(t.complete(worker, lease.item, lease.token, now), ResultAccepted)
    fast, slow = t.quota("fast"), t.quota("slow")
    assert fast >= 8 * slow  # about 10x the throughput, about 10x the work
    assert t.quota("new") == 1  # a new worker gets the floor, to be measured


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[str, str, float]]:
    ops = st.tuples(
        st.sampled_from(["grant", "complete", "complete_stale", "renew", "tick", "release"]),
        st.sampled_from(["w1", "w2", "w3"]),
        st.floats(0, 4),
    )
    return draw(st.lists(ops, max_size=80))


@given(schedules())
def test_lease_invariants_against_a_reference_model(ops: list[tuple[str, str, float]]) -> None:
    t = LeaseTable(ttl_s=5, floor=2, max_batch=4)
    items = list(range(10))
    t.add_items(items)
    now = 0.0
    ever: dict[int, list[tuple[int, str]]] = {}  # item -> [(token, worker)] in grant order
    expiry: dict[int, float] = {}  # token -> expiry, from the table's own answers
    accepted: dict[int, int] = {}
    for op, w, dt in ops:
        now += dt
        if op == "grant":
            for lease in t.grant(w, now):
                ever.setdefault(lease.item, []).append((lease.token, w))
                expiry[lease.token] = lease.expires_at
        elif op in ("complete", "complete_stale"):
            for it, hist in ever.items():
                token, holder = hist[0] if op == "complete_stale" else hist[-1]
                if holder == w:
                    ok = isinstance(t.complete(w, it, token, now), ResultAccepted)
                    latest = ever[it][-1][0]
                    if ok:
                        # reference: only the newest token, unexpired, never twice
                        assert token == latest
                        assert now < expiry[token]
                        assert it not in accepted
                        accepted[it] = token
                    break
        elif op == "renew":
            for lease in t.renew(w, list(expiry), now):
                expiry[lease.token] = lease.expires_at
        elif op == "tick":
            t.tick(now)
        else:  # the worker's newest lease given back (a result the coordinator cannot use)
            for it, hist in ever.items():
                token, holder = hist[-1]
                if holder == w and it not in accepted and isinstance(t.release(w, it, token, now), LeaseReleased):
                    expiry[token] = min(expiry[token], now)  # its lease ended now
                    break
        valid = t.valid_leases(now)
        assert len({lease.item for lease in valid}) == len(valid)  # at most one valid lease per item
        assert not {lease.item for lease in valid} & set(accepted)
    assert all(isinstance(e, LeaseExpired) for e in t.events())
    assert t.done == frozenset(accepted)


def test_holder_renews_and_gives_up_by_its_own_clock() -> None:
    t = LeaseTable(ttl_s=10)
    t.add_items(["x"])
    h = LeaseHolder("w", renew_fraction=0.5, safety_s=1.0)
    (lease,) = t.grant("w", 0.0)
    h.on_granted([lease], 100.0)  # the worker's clock is offset by 100 s
    assert h.renewals_due(103.0) == []
    assert h.renewals_due(105.0) == [lease.token]
    assert h.renewals_due(105.5) == []  # asked once
    h.tick(109.0)  # 10 s ttl - 1 s safety
    assert h.items == []
    assert [e.lease.token for e in h.events()] == [lease.token]
    assert h.take("x") is None


def test_a_released_item_is_leased_anew_and_the_old_token_is_fenced() -> None:
    t = LeaseTable(ttl_s=10)
    t.add_items(["p"])
    (a,) = t.grant("w1", 0.0)
    assert isinstance(t.release("w2", "p", a.token, 1.0), ResultRejected)  # not the holder
    assert t.release("w1", "p", a.token, 1.0) == LeaseReleased(a)
    assert t.pending == 1
    assert t.in_flight == 0
    assert isinstance(t.release("w1", "p", a.token, 1.5), ResultRejected)  # released once
    (b,) = t.grant("w2", 2.0)
    assert b.item == "p"
    assert b.token > a.token
    assert isinstance(t.complete("w1", "p", a.token, 3.0), ResultRejected)
    assert isinstance(t.complete("w2", "p", b.token, 3.0), ResultAccepted)
    assert t.finished
    assert t.events() == [], "a release is its caller's outcome, not an expiry"


def test_renewals_stop_at_the_lifetime_bound_and_an_unanswered_expiry_resets_the_rate() -> None:
    t = LeaseTable(ttl_s=10, floor=1, max_batch=8, batch_s=10, max_life_s=30)
    t.add_items(range(20))
    (first,) = t.grant("w", 0.0)
    assert isinstance(t.complete("w", first.item, first.token, 0.5), ResultAccepted)  # measured: 2 a second
    held = t.grant("w", 1.0)
    assert len(held) == 8
    assert t.life_s("w") == 20.0  # 4 x (8 held / 2 per s) = 16 s, within [2 TTL, max_life_s]: 20 s
    now, renewed_until = 1.0, 0.0
    while now < 60:
        now += 5.0
        for lease in t.renew("w", [x.token for x in held], now):
            renewed_until = max(renewed_until, lease.expires_at)
    assert renewed_until <= 1.0 + t.life_s("w")
    assert {e.lease.item for e in t.events()} == {x.item for x in held}, "every hoarded lease ended"
    assert t.rate("w") is None
    assert t.quota("w") == 1, "after leases expire unanswered, the worker gets the floor until it delivers"


def test_a_lifetime_bound_shorter_than_two_ttls_is_refused() -> None:
    with pytest.raises(ValueError, match="max_life_s"):
        LeaseTable(ttl_s=10, max_life_s=15)


def test_a_worker_that_let_a_lease_lapse_gets_no_slack_until_it_delivers() -> None:
    t = LeaseTable(ttl_s=10, floor=1, max_batch=4, max_life_s=80)
    t.add_items(range(10))
    assert t.life_s("w") == 80  # unmeasured: the configured bound
    t.grant("w", 0.0)
    t.tick(10.0)  # unanswered: lapsed
    assert t.life_s("w") == 20
    (lease,) = t.grant("w", 11.0)
    t.renew("w", [lease.token], 19.0)
    (last,) = t.renew("w", [lease.token], 27.0)
    assert last.expires_at == 31.0  # renewals end at the short bound: granted at 11, 20 s
    assert isinstance(t.complete("w", lease.item, lease.token, 30.0), ResultAccepted)
    assert t.life_s("w") == 76  # delivered again: 4 x the 19 s its result took, within [20, 80]


def test_a_renewal_answered_gives_its_round_trip_by_the_holders_clock() -> None:
    t = LeaseTable(ttl_s=10)
    t.add_items(["x"])
    h = LeaseHolder("w", renew_fraction=0.5)
    (lease,) = t.grant("w", 0.0)
    h.on_granted([lease], 100.0)
    assert h.renewals_due(105.0) == [lease.token]
    (renewed,) = t.renew("w", [lease.token], 5.2)
    assert h.on_renewed([renewed], 105.25) == [0.25]
    assert h.on_renewed([renewed], 106.0) == []  # answered already: nothing pending to time
