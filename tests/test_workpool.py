"""The coordinator's rules as shipped (`aurora.protocol.workpool.WorkPool`): no event loop, no clock."""

from __future__ import annotations

import math
from collections.abc import Iterator

import hypothesis.strategies as st
from hypothesis import given

from aurora.protocol.workpool import Accepted, PoolSettings, Rejected, ResultRules, SampleIn, WorkPool
from aurora.rl.types import Prompt

RULES = ResultRules(vocab_size=128, max_new_tokens=8)


def _prompts() -> Iterator[Prompt]:
    i = 0
    while True:
        yield Prompt(i, f"{i % 10}+1=", str(i % 10 + 1), tokens=(1, 3 + i % 10, 4))
        i += 1


def _pool(*, prompts_per_lease: int = 2, ahead_steps: int = 2, max_stale: int = 1, group_size: int = 2,
          batch: int = 0, steps: int | None = None, ttl_s: float = 5.0) -> WorkPool:  # fmt: skip
    settings = PoolSettings(ttl_s=ttl_s, prompts_per_lease=prompts_per_lease, batch_s=2.0, ahead_steps=ahead_steps,
                            max_stale=max_stale)  # fmt: skip
    return WorkPool(settings, _prompts(), RULES, group_size=group_size, batch=batch, steps=steps)


def _ok(n: int = 2, tokens: tuple[int, ...] = (5, 6)) -> list[SampleIn]:
    return [SampleIn(list(tokens), [-0.5] * len(tokens))] * n


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


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("want"), st.sampled_from(["a", "b", "c"]), st.integers(0, 3)),
        st.tuples(st.just("result"), st.sampled_from(["a", "b", "c"]), st.integers(0, 3)),
        st.tuples(st.just("forge"), st.sampled_from(["a", "b", "c"]), st.integers(0, 3)),
        st.tuples(st.just("take"), st.just(""), st.integers(0, 3)),
        st.tuples(st.just("tick"), st.just(""), st.integers(1, 4)),
    ),
    max_size=60,
)


@given(OPS)
def test_the_pool_never_accepts_twice_out_of_bound_or_unleased_and_stays_within_room(
    ops: list[tuple[str, str, int]],
) -> None:
    """Whatever workers do (and forge), each prompt's result is accepted at most once, only from the
    worker holding its lease and only within the staleness bound; every result the learner takes
    was within the bound at the take; leased plus waiting stays within ahead_steps × batch."""
    pool = _pool(prompts_per_lease=2, ahead_steps=2, group_size=1, batch=2, max_stale=1, ttl_s=3.0)
    now, current = 0.0, 3
    held: dict[str, list[tuple[bytes, int]]] = {"a": [], "b": [], "c": []}
    accepted: set[int] = set()
    for op, w, x in ops:
        if op == "want":
            for lease, p in pool.want(w, 2, now, version=current - x % 2, current=current):
                held[w].append((lease.token, p.id))
        elif op in ("result", "forge") and held[w]:
            token, item = held[w].pop(0)
            who = w if op == "result" else next(o for o in held if o != w)
            version = current - x
            got = pool.result(who, item, token, version, current, _ok(1), now)
            if isinstance(got, Accepted):
                assert who == w
                assert item not in accepted
                assert current - version <= pool.max_stale
                accepted.add(item)
        elif op == "take":
            batch = pool.take(2, current=current)
            if batch is not None:
                assert all(current - c.version <= pool.max_stale for _, c in batch)
                current += 1
        elif op == "tick":
            now += x
            pool.expire(now)
        assert pool.table.in_flight + len(pool.samples) <= 2 * 2  # ahead_steps × batch
    assert pool.accepted == len(accepted)
