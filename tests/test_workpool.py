"""The coordinator's rules as shipped (`aurora.protocol.workpool.WorkPool`): no event loop, no clock.
Examples of each rule, then a stateful hypothesis test of the whole pool through its messages."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aurora.protocol.messages import Grant, Renew, Renewed, Result, SampleWire, Verdict, Want
from aurora.protocol.workpool import (
    ABOUT_TO_ASK_S,
    Accepted,
    PoolSettings,
    Rejected,
    ResultRules,
    SampleIn,
    WorkPool,
)
from aurora.rl.types import Prompt

RULES = ResultRules(vocab_size=128, max_new_tokens=8)


def _prompts() -> Iterator[Prompt]:
    i = 0
    while True:
        yield Prompt(i, f"{i % 10}+1=", str(i % 10 + 1), tokens=(1, 3 + i % 10, 4))
        i += 1


def _pool(
    *,
    prompts_per_lease: int = 2,
    ahead_steps: int = 2,
    max_stale: int = 1,
    group_size: int = 2,
    batch: int = 0,
    steps: int | None = None,
    ttl_s: float = 5.0,
) -> WorkPool:
    settings = PoolSettings(
        ttl_s=ttl_s, prompts_per_lease=prompts_per_lease, batch_s=2.0, ahead_steps=ahead_steps, max_stale=max_stale
    )
    return WorkPool(settings, _prompts(), RULES, group_size=group_size, batch=batch, steps=steps)


def _ok(n: int = 2, tokens: tuple[int, ...] = (5, 6)) -> list[SampleIn]:
    return [SampleIn(list(tokens), [-0.5] * len(tokens))] * n


def test_a_results_verdict_does_not_swallow_an_expiry_it_happened_beside() -> None:
    """An expiry that a result's own bookkeeping noticed first is still reported by `expire` (a result's
    verdict is its return value; the table's event queue holds only expiries)."""
    pool = _pool(ttl_s=5.0)
    ((la, pa),) = pool.want("w1", 1, 0.0, current=0)
    ((lb, pb),) = pool.want("w2", 1, 3.0, current=0)
    forged = pool.result("w2", pb.id, bytes(16), 0, 0, _ok(), 6.0)  # w1's lease ran out at 5.0
    assert isinstance(forged, Rejected)
    assert forged.kind == "unknown"
    assert isinstance(pool.result("w2", pb.id, lb.token, 0, 0, _ok(), 6.0), Accepted)
    assert [e.lease for e in pool.expire(6.0)] == [la]
    late = pool.result("w1", pa.id, la.token, 0, 0, _ok(), 6.1)
    assert isinstance(late, Rejected)
    assert late.kind == "expired"


def test_a_worker_that_leaves_gives_its_prompts_back_at_once() -> None:
    """A pool member that lost its place (`WorkPool.leave`): its leases end now, reported as expiries,
    their prompts are leased next, and its result under one of them is refused."""
    pool = _pool(ttl_s=30.0)
    held = pool.want("m", 2, 0.0, current=0)
    assert held
    gone = pool.leave("m", 1.0)
    assert sorted(e.lease.item for e in gone) == sorted(p.id for _, p in held)
    again = pool.want("w", 2, 1.5, current=0)
    assert sorted(p.id for _, p in again) == sorted(p.id for _, p in held)
    (lease, prompt) = held[0]
    late = pool.result("m", prompt.id, lease.token, 0, 0, _ok(), 2.0)
    assert isinstance(late, Rejected)
    assert "m" not in pool.credit
    assert pool.leave("nobody", 3.0) == []


def test_results_are_gated_by_lease_and_staleness() -> None:
    pool = _pool()
    ((la, pa),) = pool.want("w1", 2, 0.0, current=5)  # a worker not yet measured gets one prompt
    ((lb, pb),) = pool.want("w2", 2, 0.0, current=5)
    stale = pool.result("w1", pa.id, la.token, 3, 5, _ok(), 0.1)  # 2 versions old, bound 1
    assert isinstance(stale, Rejected)
    assert stale.kind == "stale"
    got = pool.result("w2", pb.id, lb.token, 4, 5, _ok(), 0.1)
    assert isinstance(got, Accepted)
    assert got.completion.prompt_tokens == list(pb.tokens)  # the trainer's tokenization, not the worker's
    again = pool.result("w2", pb.id, lb.token, 4, 5, _ok(), 0.2)
    assert isinstance(again, Rejected)
    assert again.kind == "duplicate"
    ((lc, pc),) = pool.want("w3", 1, 0.3, current=5)
    assert pc.id == pa.id  # the stale result's prompt is leased again first, under a new token
    assert lc.token != la.token
    fenced = pool.result("w1", pa.id, la.token, 5, 5, _ok(), 0.4)
    assert isinstance(fenced, Rejected)
    assert fenced.kind == "fenced"
    assert pool.accepted == 1
    assert pool.rejected == {"stale": 1, "duplicate": 1, "fenced": 1}


POISON = {
    "a NaN log-probability": [SampleIn([5], [math.nan])] * 2,
    "-inf": [SampleIn([5], [-math.inf])] * 2,
    "a positive log-probability": [SampleIn([5], [0.5])] * 2,
    "a log-probability no sampler makes": [SampleIn([5], [-1e4])] * 2,
    "a token id beyond the vocabulary": [SampleIn([10**6], [-0.1])] * 2,
    "a negative token id": [SampleIn([-5], [-0.1])] * 2,
    "too many tokens": [SampleIn([5] * 9, [-0.1] * 9)] * 2,
    "no tokens": [SampleIn([], [])] * 2,
    "lengths that differ": [SampleIn([5, 6], [-0.1])] * 2,
    "the wrong group size": [SampleIn([5], [-0.1])] * 3,
}


def test_poisoned_results_are_rejected_with_their_reason_and_the_lease_stays() -> None:
    pool = _pool()
    ((lease, p),) = pool.want("w", 1, 0.0, current=5)
    for why, samples in POISON.items():
        got = pool.result("w", p.id, lease.token, 5, 5, samples, 0.1)
        assert isinstance(got, Rejected), why
        assert got.kind == "malformed", why
        assert got.reason.startswith("malformed"), why
    future = pool.result("w", p.id, lease.token, 10**9, 50, _ok(), 0.1)  # a label beyond the trainer
    assert isinstance(future, Rejected)
    assert "labelled version" in future.reason
    assert isinstance(pool.result("w", p.id, lease.token, 5, 5, _ok(), 0.2), Accepted)  # still under its lease
    assert pool.rejected["malformed"] == len(POISON) + 1


def test_a_guessed_token_is_unknown_and_a_result_for_another_worker_is_refused() -> None:
    pool = _pool()
    ((lease, p),) = pool.want("w", 1, 0.0, current=5)
    guess = pool.result("w", p.id, bytes(16), 5, 5, _ok(), 0.1)
    assert isinstance(guess, Rejected)
    assert guess.kind == "unknown"
    other = pool.result("intruder", p.id, lease.token, 5, 5, _ok(), 0.1)
    assert isinstance(other, Rejected)
    assert other.kind == "not-holder"


def test_the_learner_never_takes_results_grown_too_stale_while_they_waited() -> None:
    pool = _pool(group_size=1, prompts_per_lease=4, ahead_steps=0)
    for i, v in enumerate((3, 4, 5, 5)):
        ((lease, p),) = pool.want(f"w{i}", 1, 0.0, current=v)
        assert isinstance(pool.result(f"w{i}", p.id, lease.token, v, v, _ok(1), 0.0), Accepted)
    got = pool.take(2, current=5)
    assert got is not None
    assert [c.version for _, c in got] == [4, 5]  # oldest first; v3 is two versions behind v5
    assert pool.dropped_stale == 1
    assert [c.version for _, c in pool.samples] == [5]
    assert pool.take(2, current=6) is None  # one left, not enough


def test_leasing_stays_within_ahead_steps_batches_and_parked_wants_are_answered_after_a_take() -> None:
    pool = _pool(batch=1)
    grants = {w: pool.want(w, 2, 0.0) for w in ("w1", "w2", "w3")}  # room for 2 × 1 prompts
    assert [w for w, g in grants.items() if g] == ["w1", "w2"]
    assert {w: (n, v) for w, (n, v, _) in pool.parked.items()} == {"w3": (2, None)}
    for w in ("w1", "w2"):
        ((lease, p),) = grants[w]
        assert isinstance(pool.result(w, p.id, lease.token, 0, 0, _ok(), 0.1), Accepted)
    assert pool.room() == 0  # two accepted results wait for the learner: still no room
    assert pool.unpark(0.2) == {}
    assert pool.take(1) is not None  # the learner takes one: room for one more
    granted = pool.unpark(0.3)
    assert list(granted) == ["w3"]
    assert len(granted["w3"]) == 1
    assert pool.parked == {}
    assert pool.stats()["parked"] == 0


def test_a_worker_gets_work_only_while_the_steps_that_may_use_its_version_want_more() -> None:
    """k = 1, batch 2: v4 results serve only the take at v5 (taken oldest version first), v5
    results the takes at v5 and v6; once the learner has taken at v5, v4 serves nothing."""
    pool = _pool(prompts_per_lease=4, ahead_steps=4, batch=2)
    assert len(pool.want("fresh", 4, 0.0, version=5, current=5)) == 1  # unmeasured worker: one prompt
    assert len(pool.want("old", 4, 0.0, version=4, current=5)) == 1  # the take at v5 still needs v4 results
    assert len(pool.want("old-2", 4, 0.0, version=4, current=5)) == 1  # v5's result comes after them
    assert pool.want("old-3", 4, 0.0, version=4, current=5) == []  # two v4 results fill the take at v5
    assert pool.parked == {"old-3": (4, 4, 0.0)}
    assert pool.unpark(0.0, current=5) == {}  # room, but still too old
    assert pool.want("old-3", 4, 0.0, version=5, current=5) != []  # switched to v5: useful again
    assert pool.parked == {}
    assert pool.want("gone", 4, 0.0, version=4, current=5) == []
    assert pool.next_deadline() == 2.5  # when the parked want lapses: half a TTL (the leases expire at 5.0)
    assert pool.unpark(2.6, current=6) == {}  # it has not asked again for half a TTL: dropped, not leased to
    assert pool.parked == {}


def test_the_learner_takes_the_oldest_versions_first_and_then_leases_only_for_its_next_take() -> None:
    pool = _pool(prompts_per_lease=4, ahead_steps=4, group_size=1, batch=2)
    for w, v in (("a", 5), ("b", 4), ("c", 5), ("d", 4)):
        ((lease, p),) = pool.want(w, 1, 0.0, version=v, current=5)
        assert isinstance(pool.result(w, p.id, lease.token, v, 5, _ok(1), 0.0), Accepted)
    got = pool.take(2, current=5)
    assert got is not None
    assert [c.version for _, c in got] == [4, 4]  # the v5 results can still serve the take at v6
    assert pool.want("e", 1, 0.0, version=4, current=5) == []  # the learner trains: v4 serves no take now
    assert pool.want("f", 1, 0.0, version=5, current=5) == []  # the two v5 results fill the take at v6
    # the learner made v6 and takes at it while v6 is still being published (the trainer's
    # flow, which the coordinator asks, is at v5): its next take is at v7, which v5 cannot serve
    nxt = pool.take(2, current=6)
    assert nxt is not None
    assert [c.version for _, c in nxt] == [5, 5]
    assert pool.want("g", 1, 0.0, version=5, current=5) == []
    assert pool.want("h", 1, 0.0, version=6, current=5) != []
    assert pool.dropped_stale == 0


def test_no_work_is_leased_once_the_runs_last_take_has_its_results() -> None:
    """A run of 7 versions: the learner's last take is at v6; v6 results serve no take."""
    pool = _pool(prompts_per_lease=4, ahead_steps=4, group_size=1, batch=2, steps=7)
    assert len(pool.want("a", 1, 0.0, version=5, current=6)) == 1  # for the take at v6
    assert len(pool.want("a2", 1, 0.0, version=5, current=6)) == 1
    assert pool.want("b", 1, 0.0, version=6, current=6) == []  # the take at v6 has its two in flight
    assert pool.want("c", 2, 0.0, version=7, current=7) == []  # the run is over


def test_handle_answers_each_work_message_with_the_message_back() -> None:
    """Want -> Grant (the trainer's prompt tokens), Renew -> Renewed (a TTL that counts from the
    renewal), Result -> Verdict (with the rejection's reason); a want that gets nothing, or a renewal
    that renews nothing, is answered with nothing."""
    pool = _pool(ttl_s=5.0)
    got = pool.handle(Want(w="w", n=1, v=5), 0.0, 5)
    assert isinstance(got.reply, Grant)
    ((g,),) = [got.reply.leases]
    assert (got.reply.w, got.reply.n, g.ttl_s) == ("w", 2, 5.0)
    assert g.tokens == list(pool.open[g.item].tokens)
    renewed = pool.handle(Renew(w="w", tokens=[g.token]), 4.0, 5).reply
    assert isinstance(renewed, Renewed)
    assert [(r.item, r.ttl_s) for r in renewed.leases] == [(g.item, 5.0)]  # not 9 s: from the renewal
    assert pool.handle(Renew(w="other", tokens=[g.token]), 4.0, 5).reply is None
    bad = pool.handle(Result(w="w", item=g.item, token=g.token, v=5, samples=[SampleWire([5], [-0.1])]), 4.5, 5)
    assert isinstance(bad.outcome, Rejected)
    assert bad.reply == Verdict(w="w", item=g.item, ok=False, reason=bad.outcome.reason)
    ok = pool.handle(Result(w="w", item=g.item, token=g.token, v=5, samples=[SampleWire([5], [-0.1])] * 2), 8.5, 5)
    assert isinstance(ok.outcome, Accepted)  # within the renewed lease (4 + 5 s)
    assert ok.reply == Verdict(w="w", item=g.item, ok=True)
    assert isinstance(pool.handle(Want(w="w3", n=1, v=5), 9.0, 5).reply, Grant)
    assert pool.handle(Want(w="w3", n=1, v=5), 9.0, 5).reply is None  # holds all it may (not measured yet)


def test_a_parked_want_lapses_from_when_its_worker_asked_however_often_it_was_retried() -> None:
    pool = _pool(batch=1, ahead_steps=1, ttl_s=4.0)
    assert pool.want("a", 1, 0.0) != []
    assert pool.want("b", 1, 0.5) == []  # no room: parked at 0.5
    assert pool.next_deadline() == 2.5  # half a TTL, at least 2 s, after it asked
    assert pool.unpark(1.0) == {}
    assert pool.unpark(2.0) == {}  # retried, still no room: as old as it was
    assert pool.next_deadline() == 2.5
    assert pool.unpark(2.5) == {}
    assert pool.parked == {}  # lapsed at its deadline, not after it
    assert pool.next_deadline() == 4.0  # a's lease


WORKERS = ["a", "b", "c"]
TTL_S = 3.0
BATCH = 2
AHEAD = 2


class Pool(RuleBasedStateMachine):
    """The pool as shipped, driven through its messages by honest, slow, forging and replaying
    workers, a learner and the clock, against a reference model of the leases it granted."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _pool(prompts_per_lease=2, ahead_steps=AHEAD, group_size=1, batch=BATCH, max_stale=1, ttl_s=TTL_S)
        self.now, self.current = 0.0, 3
        self.held: dict[str, list[tuple[bytes, int]]] = {w: [] for w in WORKERS}
        self.latest: dict[int, tuple[bytes, str]] = {}
        """The reference: per prompt, the token and worker of its newest lease."""
        self.expiry: dict[bytes, float] = {}
        self.used: list[tuple[str, int, bytes]] = []
        self.accepted: set[int] = set()

    def _granted(self, reply: Grant | None) -> None:
        if reply is None:
            return
        assert reply.w not in self.pool.parked
        for g in reply.leases:
            assert g.item not in self.accepted
            old = self.latest.get(g.item)
            assert old is None or self.now >= self.expiry[old[0]], "a second valid lease for a prompt"
            self.latest[g.item] = (g.token, reply.w)
            self.expiry[g.token] = self.now + g.ttl_s
            self.held[reply.w].append((g.token, g.item))

    @rule(w=st.sampled_from(WORKERS), lag=st.integers(0, 2), n=st.integers(1, 4))
    def want(self, w: str, lag: int, n: int) -> None:
        got = self.pool.handle(Want(w=w, n=n, v=self.current - lag), self.now, self.current)
        assert got.outcome is None
        assert got.reply is None or isinstance(got.reply, Grant)
        if got.reply is not None:
            assert len(got.reply.leases) <= min(n, 2)
        self._granted(got.reply)

    @rule()
    def unpark(self) -> None:
        lapse = max(2.0, TTL_S / 2)
        due = {w for w, (_, _, since) in self.pool.parked.items() if self.now < since + lapse}
        for w, granted in self.pool.unpark(self.now, self.current).items():
            assert w in due, "a lapsed want was granted"
            self._granted(self.pool.grant_message(w, granted))

    @rule(w=st.sampled_from(WORKERS))
    def renew(self, w: str) -> None:
        if not self.held[w]:
            return
        got = self.pool.handle(Renew(w=w, tokens=[t for t, _ in self.held[w]]), self.now, self.current)
        for r in got.reply.leases if isinstance(got.reply, Renewed) else ():
            assert self.latest[r.item] == (r.token, w)
            assert self.now < self.expiry[r.token], "an expired lease renewed"
            assert r.ttl_s <= TTL_S  # one TTL, or less at the lease's lifetime bound
            self.expiry[r.token] = self.now + r.ttl_s

    @rule(
        w=st.sampled_from(WORKERS),
        lag=st.sampled_from([0, 0, 1, 2]),
        how=st.sampled_from(["honest", "honest", "honest", "forged", "replayed"]),
    )
    def result(self, w: str, lag: int, how: str) -> None:
        if how == "replayed":
            if not self.used:
                return
            w, item, token = self.used[0]
        elif self.held[w]:
            token, item = self.held[w].pop(0)
            self.used.append((w, item, token))
        else:
            return
        who = w if how != "forged" else next(o for o in WORKERS if o != w)
        version = self.current - lag
        msg = Result(w=who, item=item, token=token, v=version, samples=[SampleWire([5, 6], [-0.5, -0.5])])
        got = self.pool.handle(msg, self.now, self.current)
        assert isinstance(got.reply, Verdict)
        assert got.reply.ok == isinstance(got.outcome, Accepted)
        if isinstance(got.outcome, Accepted):
            assert self.latest[item] == (token, who), "accepted from other than the current lease's holder"
            assert self.now < self.expiry[token], "accepted under an expired lease"
            assert item not in self.accepted, "accepted twice"
            assert self.current - version <= self.pool.max_stale
            self.accepted.add(item)
        else:
            assert isinstance(got.outcome, Rejected)
            assert got.reply.reason == got.outcome.reason
            if got.outcome.kind == "stale":  # given back: the lease ended now
                self.expiry[token] = self.now

    @rule()
    def take(self) -> None:
        batch = self.pool.take(BATCH, current=self.current)
        if batch is not None:
            assert len(batch) == BATCH
            assert all(self.current - c.version <= self.pool.max_stale for _, c in batch)
            self.current += 1  # the learner publishes what it trained

    @rule(dt=st.floats(0.05, 1.5))
    def tick(self, dt: float) -> None:
        """`expire` ends leases only once their TTL is over, and none before `next_deadline` (what it
        reports may have ended earlier, inside a grant, renewal or result at a later time than due)."""
        due = self.pool.next_deadline()
        live = {item: self.pool.table.current(item) for item in self.latest}
        self.now += dt
        expired = self.pool.expire(self.now)
        if due is None or self.now < due:
            assert live == {item: self.pool.table.current(item) for item in self.latest}, "ended before the deadline"
        for e in expired:
            assert self.now >= self.expiry[e.lease.token], "a lease ended early"

    @invariant()
    def at_most_one_valid_lease_per_prompt_and_none_for_one_done(self) -> None:
        items = [lease.item for lease in self.pool.table.valid_leases(self.now)]
        assert len(items) == len(set(items))
        assert not set(items) & self.accepted

    @invariant()
    def leasing_stays_within_ahead_steps_batches(self) -> None:
        assert self.pool.table.in_flight + len(self.pool.samples) <= AHEAD * BATCH

    @invariant()
    def no_prompt_is_lost(self) -> None:
        assert len(self.pool.open) == self.pool.table.pending + self.pool.table.in_flight
        assert self.pool.accepted == len(self.accepted)


TestPool = Pool.TestCase
TestPool.settings = settings(stateful_step_count=60)


def test_work_is_divided_among_the_workers_waiting_for_it_not_raced_for() -> None:
    """Two workers between batches (each has just returned a result): the first to ask gets half of
    what may be leased, and the other the rest, instead of the first taking it all."""
    pool = _pool(prompts_per_lease=4, ahead_steps=1, batch=4, group_size=1)
    for t in (0.0, 0.5):  # measured, so that quota does not cap the grants (an unmeasured worker gets 1)
        held = {w: pool.want(w, 1, t, version=0, current=0) for w in ("a", "b")}
        for w, ((lease, p),) in held.items():
            assert isinstance(pool.result(w, p.id, lease.token, 0, 0, _ok(1), t + 0.25), Accepted)
    assert pool.take(4, 0) is not None
    first = pool.want("a", 4, 1.0, version=1, current=1)
    second = pool.want("b", 4, 1.01, version=1, current=1)
    assert (len(first), len(second)) == (2, 2)


def test_a_worker_stuck_on_an_old_version_holds_back_work_only_while_a_switch_could_take() -> None:
    """A worker that keeps asking with a version whose results nobody would use (its node never got
    the new one) is not waited for past `ABOUT_TO_ASK_S` after the version came: the other worker's
    parked want is answered then, at the pool's next deadline."""
    pool = _pool(prompts_per_lease=2, ahead_steps=1, batch=1, max_stale=0, ttl_s=30.0, group_size=1)
    ((lease, p),) = pool.want("a", 2, 0.0, version=5, current=5)
    assert isinstance(pool.result("a", p.id, lease.token, 5, 5, _ok(1), 1.0), Accepted)
    assert pool.take(1, 5) is not None
    assert pool.want("b", 2, 2.0, version=5, current=6) == []  # useless: 5 serves no take any more
    assert pool.want("a", 2, 2.5, version=6, current=6) == []  # held back: b may be switching to 6
    deadline = pool.next_deadline()
    assert deadline is not None
    assert deadline <= 2.0 + ABOUT_TO_ASK_S
    assert pool.want("b", 2, deadline - 0.5, version=5, current=6) == []  # still on 5
    assert [len(g) for g in pool.unpark(deadline, current=6).values()] == [1]


def test_a_worker_gone_quiet_holds_back_work_only_until_it_leaves_the_waiting_window() -> None:
    pool = _pool(prompts_per_lease=2, ahead_steps=1, batch=2, max_stale=1, ttl_s=30.0, group_size=1)
    for t in (0.0, 1.0):
        ((lease, p),) = pool.want("a", 2, t, version=0, current=0)
        pool.result("a", p.id, lease.token, 0, 0, _ok(1), t + 0.5)
    assert pool.take(2, 0) is not None
    ((lease, p),) = pool.want("b", 2, 10.0, version=1, current=1)
    pool.result("b", p.id, lease.token, 1, 1, _ok(1), 11.0)  # and then b is heard from no more
    assert pool.want("a", 1, 12.0, version=1, current=1) == []  # b is between batches: about to ask
    granted: dict[str, list[Any]] = {}
    while not granted:  # the coordinator sleeps until the next deadline, then unparks
        deadline = pool.next_deadline()
        assert deadline is not None
        assert deadline <= 11.0 + ABOUT_TO_ASK_S
        granted = pool.unpark(deadline, current=1)
    assert [len(g) for g in granted.values()] == [1]


def _answer(pool: WorkPool, worker: str, t: float, took: float, n: int = 4, current: int | None = None) -> int:
    """``worker`` asks for ``n`` at ``t`` (generating with version ``current``, the trainer's; None: it
    names none, the trainer is at 0) and answers each prompt it gets, spread over ``took`` seconds; how
    many it got."""
    got = pool.want(worker, n, t, version=current, current=current or 0)
    v = current or 0
    for i, (lease, p) in enumerate(got):
        done = pool.result(worker, p.id, lease.token, v, v, _ok(), t + took * (i + 1) / len(got))
        assert isinstance(done, Accepted)
    return len(got)


def test_a_worker_measured_fast_that_then_hoards_does_not_hold_back_an_honest_one() -> None:
    """A worker answers its first leases at once (well-formed, so accepted: it is measured 100x faster),
    then takes a lease and only renews it. It stops counting among the workers at work once it has
    delivered nothing for a while, so the honest worker is not held to a sliver of the work."""
    pool = _pool(prompts_per_lease=4, ahead_steps=4, batch=4, ttl_s=30.0)
    t = 0.0
    for _ in range(10):
        _answer(pool, "p", t, 0.01)
        _answer(pool, "h", t, 1.0)
        t += 1.0
        while pool.take(4):
            pass
    hoard = pool.want("p", 4, t)
    assert hoard
    got = 0
    for _ in range(50):
        pool.expire(t)
        pool.unpark(t)
        pool.renew("p", [lease.token for lease, _ in hoard], t)
        got += _answer(pool, "h", t, 1.0)
        while pool.take(4):
            pass
        t += 1.0
    assert got >= 0.8 * 50 * 4, got


def test_asking_with_an_old_version_does_not_hold_back_the_others_work() -> None:
    """A worker that keeps asking with a version far behind (whose results nobody would use), while the
    versions move on, is not waited for as if it were switching, and junk results do not make it count
    as about to ask: the honest worker gets the work."""
    pool = _pool(prompts_per_lease=4, ahead_steps=2, batch=2, ttl_s=30.0)
    t, current = 0.0, 0
    for _ in range(3):
        _answer(pool, "h", t, 1.0, current=current)
        t += 1.0
    got = []
    for _ in range(20):
        while pool.take(2, current):
            current += 1
        assert pool.want("p", 4, t, version=current - 5, current=current) == []
        junk = pool.result("p", 10**9, bytes(16), current, current, _ok(), t)
        assert isinstance(junk, Rejected)
        got.append(_answer(pool, "h", t + 0.5, 1.0, current=current))
        t += 2.0
    assert sum(got) >= 0.8 * 2 * 2 * len(got), got  # what may be leased: ahead_steps × batch
