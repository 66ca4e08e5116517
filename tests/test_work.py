"""The coordinator on its own: the lease and staleness gates, and malformed messages rejected, not fatal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aurora.actors.flow import VersionFlow
from aurora.actors.work import Coordinator, WorkPool
from aurora.transport.base import Message

from aurora.config.topology import LeaseSpec
from aurora.rl.tasks import ArithmeticTask
from aurora.rl.types import Completion, Prompt, Sample


def _setup(version: int) -> tuple[Coordinator, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    async def down(header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
        sent.append(dict(header))
        return True

    pool = WorkPool(LeaseSpec(ttl_s=5.0, prompts_per_lease=2), 1, ArithmeticTask().prompts(0), group_size=2)
    return Coordinator(pool, VersionFlow("trainer", None, version), down), sent


def _result(w: str, item: int, token: int, v: int, body: bytes | None = None, n: int = 2) -> Message:
    c = Completion(item, [1, 5], [Sample("x", [5], [-0.5])] * n, v)
    return Message({"k": "result", "w": w, "item": item, "token": token, "v": v},
                   (memoryview(body if body is not None else c.to_wire()),))  # fmt: skip


async def test_results_are_gated_by_lease_and_staleness_and_bad_ones_are_rejected() -> None:
    coord, sent = _setup(version=5)
    for w in ("w1", "w2"):  # a worker not yet measured gets one prompt
        await coord.receive(Message({"k": "want", "w": w, "n": 2}, ()))
    ((a, ta, _, _),), ((b, tb, _, _),) = (g["leases"] for g in sent)
    await coord.receive(_result("w1", a, ta, 3))  # 2 versions old, bound 1: stale, prompt back to the pool
    await coord.receive(_result("w2", b, tb, 4))  # within the bound: accepted
    await coord.receive(_result("w2", b, tb, 4))  # twice: rejected
    await coord.receive(_result("w1", a, ta, 5, body=b"\xc1 not msgpack"))  # malformed: rejected, no crash
    await coord.receive(_result("w1", a, ta, 5, n=3))  # not the group size asked for: rejected
    await coord.receive(Message({"k": "result", "w": "w1"}, ()))  # fields missing: dropped, no crash
    verdicts = [(m["ok"], m["reason"]) for m in sent if m["k"] == "verdict"]
    assert verdicts[0][0] is False
    assert verdicts[0][1].startswith("stale")
    assert verdicts[1] == (True, None)
    assert verdicts[2] == (False, "duplicate")
    assert verdicts[3] == (False, "malformed")
    assert verdicts[4][0] is False
    assert "3 samples" in verdicts[4][1]
    assert coord.pool.accepted == 1
    assert [x[:3] for x in coord.pool.log] == [(b, "w2", 4)]
    await coord.receive(Message({"k": "want", "w": "w3", "n": 1}, ()))
    (again, token, _, _) = sent[-1]["leases"][0]
    assert again == a  # the stale result's prompt is leased again first, under a new token
    assert token > ta
    assert all(g["n"] == 2 for g in sent if g["k"] == "grant")  # the group size travels with the grant
    ((prompt, _),) = coord.pool.samples
    assert isinstance(prompt, Prompt)
    assert prompt.answer == str(sum(int(x) for x in prompt.text[:-1].split("+")))  # the answer stays here


async def test_the_learner_never_takes_results_grown_too_stale_while_they_waited() -> None:
    coord, _ = _setup(version=5)
    pool = coord.pool
    for v in (3, 4, 5, 5):
        pool.samples.append((Prompt(v, "1+1=", "2"), Completion(v, [1], [Sample("2", [5], [0.0])] * 2, v)))
    got = await pool.take(2, current=5)
    assert [c.version for _, c in got] == [4, 5]
    assert pool.dropped_stale == 1
    assert pool.stats()["dropped_stale"] == 1


async def test_leasing_stays_within_ahead_steps_batches_and_parked_wants_are_answered_after_a_take() -> None:
    sent: list[dict[str, Any]] = []

    async def down(header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
        sent.append(dict(header))
        return True

    spec = LeaseSpec(ttl_s=5.0, prompts_per_lease=2, ahead_steps=2)
    pool = WorkPool(spec, 1, ArithmeticTask().prompts(0), group_size=2, batch=1)
    coord = Coordinator(pool, VersionFlow("trainer", None, 0), down)
    for w in ("w1", "w2", "w3"):  # room for 2 × 1 prompts: the third want is parked
        await coord.receive(Message({"k": "want", "w": w, "n": 2}, ()))
    assert [g["w"] for g in sent] == ["w1", "w2"]
    assert {w: (n, v) for w, (n, v, _) in pool.parked.items()} == {"w3": (2, None)}
    for g in sent[:2]:  # the verdicts are appended to sent meanwhile
        ((item, token, _, _),) = g["leases"]
        await coord.receive(_result(g["w"], item, token, 0))
    assert pool.room() == 0  # two accepted results wait for the learner: still no room
    assert pool.unpark(0.0) == {}
    await pool.take(1)  # the learner takes one: room for one more
    await pool.wait_room(0.01)
    granted = pool.unpark(0.0)
    assert list(granted) == ["w3"]
    assert len(granted["w3"]) == 1
    assert pool.parked == {}
    assert pool.stats()["parked"] == 0


def test_a_worker_gets_work_only_while_the_steps_that_may_use_its_version_want_more() -> None:
    """k = 1, batch 2: v4 results serve only the take at v5 (taken oldest version first), v5
    results the takes at v5 and v6; once the learner has taken at v5, v4 serves nothing."""
    spec = LeaseSpec(ttl_s=5.0, prompts_per_lease=4, ahead_steps=4)
    pool = WorkPool(spec, 1, ArithmeticTask().prompts(0), group_size=2, batch=2)
    assert len(pool.want("fresh", 4, 0.0, version=5, current=5)) == 1  # unmeasured worker: one prompt
    assert len(pool.want("old", 4, 0.0, version=4, current=5)) == 1  # the take at v5 still needs v4 results
    assert len(pool.want("old-2", 4, 0.0, version=4, current=5)) == 1  # v5's result comes after them
    assert pool.want("old-3", 4, 0.0, version=4, current=5) == []  # two v4 results fill the take at v5
    assert pool.parked == {"old-3": (4, 4, 0.0)}
    assert pool.unpark(0.0, current=5) == {}  # room, but still too old
    assert pool.want("old-3", 4, 0.0, version=5, current=5) != []  # switched to v5: useful again
    assert pool.parked == {}
    assert pool.want("gone", 4, 0.0, version=4, current=5) == []
    assert pool.unpark(2.6, current=6) == {}  # it has not asked again for half a TTL: dropped, not leased to
    assert pool.parked == {}


async def test_the_learner_takes_the_oldest_versions_first_and_then_leases_only_for_its_next_take() -> None:
    spec = LeaseSpec(ttl_s=5.0, prompts_per_lease=4, ahead_steps=4)
    pool = WorkPool(spec, 1, ArithmeticTask().prompts(0), group_size=1, batch=2)
    for w, v in (("a", 5), ("b", 4), ("c", 5), ("d", 4)):
        (lease, p), = pool.want(w, 1, 0.0, version=v, current=5)  # fmt: skip
        c = Completion(p.id, [1], [Sample("x", [2], [0.0])], v)
        assert pool.result(w, p.id, lease.token, v, 5, c, 0.0) is None
    got = await pool.take(2, current=5)
    assert [c.version for _, c in got] == [4, 4]  # the v5 results can still serve the take at v6
    assert pool.want("e", 1, 0.0, version=4, current=5) == []  # the learner trains: v4 serves no take now
    assert pool.want("f", 1, 0.0, version=5, current=5) == []  # the two v5 results fill the take at v6
    # the learner made v6 and takes at it while v6 is still being published (the trainer's
    # flow, which the coordinator asks, is at v5): its next take is at v7, which v5 cannot serve
    assert [c.version for _, c in await pool.take(2, current=6)] == [5, 5]
    assert pool.want("g", 1, 0.0, version=5, current=5) == []
    assert pool.want("h", 1, 0.0, version=6, current=5) != []
    assert pool.dropped_stale == 0


def test_no_work_is_leased_once_the_runs_last_take_has_its_results() -> None:
    """A run of 7 versions: the learner's last take is at v6; v6 results serve no take."""
    spec = LeaseSpec(ttl_s=5.0, prompts_per_lease=4, ahead_steps=4)
    pool = WorkPool(spec, 1, ArithmeticTask().prompts(0), group_size=1, batch=2, steps=7)
    assert len(pool.want("a", 1, 0.0, version=5, current=6)) == 1  # for the take at v6
    assert len(pool.want("a2", 1, 0.0, version=5, current=6)) == 1
    assert pool.want("b", 1, 0.0, version=6, current=6) == []  # the take at v6 has its two in flight
    assert pool.want("c", 2, 0.0, version=7, current=7) == []  # the run is over
