"""`aurora chaos`'s parts that need no cluster: the trainer's result journal (what a restart takes back),
the seeded schedule, and the history checker, each rule shown to catch what it names. The whole tool
on real processes is tests/test_chaos_cluster.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aurora.chaos.check import check
from aurora.chaos.schedule import KINDS, schedule
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.errors import StoreError
from aurora.events import (
    BATCH_RETURNED,
    BATCH_TAKEN,
    NODE_RESUMED,
    RESULT_ACCEPTED,
    RESULTS_RESTORED,
    TRAINER_RESUMED,
    VERSION_COMMITTED,
    VERSION_PUBLISHED,
)
from aurora.protocol.messages import Lane
from aurora.rl.types import Completion, Prompt, Sample
from aurora.store.journal import JOURNAL, ResultJournal

ROOT = Path(__file__).resolve().parent.parent


def _result(i: int, version: int) -> tuple[Prompt, Completion]:
    p = Prompt(i, f"{i}+1=", str(i + 1), (1, 2, i))
    return p, Completion(i, [1, 2, i], [Sample([5, 6], [-0.25, -1e-7]), Sample([7], [-3.5])], version)


# -- the result journal
def test_a_resumed_trainer_gets_back_every_acknowledged_result_not_in_a_stored_version(tmp_path: Path) -> None:
    j, first = ResultJournal.open(tmp_path, 0)
    assert first.pending == []
    assert first.next_id == 0
    for i in range(6):
        j.accepted(*_result(i, version=i // 2))
    j.taken([0, 1], at=1)  # made version 2
    j.taken([2, 3], at=2, dropped=[4])  # made version 3, which the store does not hold
    _, back = ResultJournal.open(tmp_path, 2)  # resumed from version 2
    assert [p.id for p, _ in back.pending] == [2, 3, 5]
    assert back.pending[0] == _result(2, 1)  # tokens, samples, log-probabilities and version exact
    assert back.next_id == 6
    assert back.done == 3
    # compacted: the file now holds what a second restart needs, and replays the same
    lines = (tmp_path / JOURNAL).read_text().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[0]) == {"next": 6}
    again = ResultJournal(tmp_path / JOURNAL).replay(2)
    assert again.pending == back.pending
    assert again.next_id == 6


def test_a_journal_torn_by_a_crash_keeps_what_was_whole_and_a_corrupt_one_is_refused(tmp_path: Path) -> None:
    j, _ = ResultJournal.open(tmp_path, 0)
    j.accepted(*_result(0, 0))
    j.accepted(*_result(1, 0))
    path = tmp_path / JOURNAL
    whole = path.read_text()
    path.write_text(whole + '{"accepted": {"id": 2, "te')  # the process died mid-append
    assert [p.id for p, _ in ResultJournal(path).replay(0).pending] == [0, 1]
    path.write_text('{"next": 0}\nnot json\n' + whole)
    with pytest.raises(StoreError, match=f"{path}: line 2"):
        ResultJournal(path).replay(0)


# -- the schedule
def test_the_schedule_is_the_seeds_and_kills_only_the_trainer() -> None:
    path = ROOT / "topologies" / "tiny.yaml"
    topo = load_topology(path)
    tree = plan(topo, str(path))
    a = schedule(topo, tree, 200, 7, 20)
    assert a == schedule(topo, tree, 200, 7, 20) != schedule(topo, tree, 200, 8, 20)
    assert len(a) == 20
    assert [f.at_version for f in a] == sorted(f.at_version for f in a)
    assert all(2 <= f.at_version <= 198 and f.kind in KINDS and f.hold_s > 0 for f in a)
    for seed in range(20):
        for f in schedule(topo, tree, 50, seed, 10):
            assert f.kind == "kill" or f.node != "trainer"


# -- the checker
def _e(event: str, t: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "timestamp": f"2026-12-07T00:00:{t:02d}.000000Z", **fields}


def _clean() -> dict[str, list[list[dict[str, Any]]]]:
    """A trainer that publishes 1..4, is killed after a take at 3 and resumes from 3 (its journal giving
    back prompt 5, accepted and not trained on), and a relay that is killed and resumes too."""
    trainer = [
        [
            _e(RESULT_ACCEPTED, 1, item=0, version=0, current=0),
            _e(RESULT_ACCEPTED, 1, item=1, version=0, current=0),
            _e(BATCH_TAKEN, 2, at=0, items=[0, 1], versions=[0, 0], dropped=[]),
            _e(VERSION_PUBLISHED, 3, version=1, digest="d1"),
            _e(RESULT_ACCEPTED, 4, item=2, version=1, current=1),
            _e(BATCH_TAKEN, 5, at=1, items=[2], versions=[1], dropped=[]),
            _e(VERSION_PUBLISHED, 6, version=2, digest="d2"),
            _e(RESULT_ACCEPTED, 7, item=3, version=1, current=2),
            _e(RESULT_ACCEPTED, 7, item=4, version=2, current=2),
            _e(BATCH_TAKEN, 8, at=2, items=[3], versions=[1], dropped=[]),
            _e(VERSION_PUBLISHED, 9, version=3, digest="d3"),
            _e(RESULT_ACCEPTED, 10, item=5, version=3, current=3),
            _e(BATCH_TAKEN, 11, at=3, items=[4], versions=[2], dropped=[]),  # version 4 lost with the process
        ],
        [
            _e(TRAINER_RESUMED, 20, version=3, digest="d3"),
            _e(RESULTS_RESTORED, 20, items=[4, 5], next=6, done=4),
            _e(BATCH_TAKEN, 21, at=3, items=[4, 5], versions=[2, 3], dropped=[]),
            _e(VERSION_PUBLISHED, 22, version=4, digest="d4"),
        ],
    ]
    relay = [
        [_e(VERSION_COMMITTED, 4, version=1, digest="d1"), _e(VERSION_COMMITTED, 7, version=2, digest="d2")],
        [
            _e(NODE_RESUMED, 12, version=2, digest="d2"),
            _e(VERSION_COMMITTED, 13, version=3, digest="d3"),
            _e(VERSION_COMMITTED, 23, version=4, digest="d4"),
        ],
    ]
    return {"trainer": trainer, "relay": relay}


def _rules(lives: dict[str, Any]) -> list[str]:
    return [v.rule for v in check(lives, "trainer", 1, 4).violations]


def test_a_history_that_keeps_every_rule_passes() -> None:
    report = check(_clean(), "trainer", 1, 4)
    assert report.violations == []
    assert report.counts["accepted"] == 6
    assert report.counts["restarts"] == 2
    assert report.counts["commits"] == 4


def test_each_rule_catches_what_it_names() -> None:
    h = _clean()
    h["trainer"][1].append(_e(RESULT_ACCEPTED, 23, item=2, version=3, current=4))
    assert _rules(h) == ["accepted once"]

    h = _clean()
    h["trainer"][0][4] = _e(RESULT_ACCEPTED, 4, item=2, version=0, current=2)  # 2 versions old, bound 1
    assert _rules(h) == ["staleness"]

    h = _clean()
    h["trainer"][1][1] = _e(RESULTS_RESTORED, 20, items=[5], next=6, done=5)  # prompt 4 forgotten
    assert _rules(h) == ["nothing acknowledged lost"]

    h = _clean()
    h["relay"][1].insert(2, _e(VERSION_COMMITTED, 14, version=3, digest="d3"))  # twice: not forward
    assert _rules(h) == ["order"]

    h = _clean()
    h["relay"][0][1] = _e(VERSION_COMMITTED, 7, version=2, digest="bad")
    assert _rules(h) == ["one history"]

    h = _clean()
    h["relay"][1].pop()  # never got version 4
    assert _rules(h) == ["the end"]


def test_a_schedule_of_four_or_more_has_every_kind_and_a_kill_of_the_trainer() -> None:
    path = ROOT / "topologies" / "tiny.yaml"
    topo = load_topology(path)
    tree = plan(topo, str(path))
    for seed in range(10):
        faults = schedule(topo, tree, 30, seed, 4)
        got = {(f.kind, f.node == "trainer") for f in faults}
        assert got == {("kill", True), ("kill", False), ("partition", False), ("not_reading", False)}
        assert len({f.node for f in faults}) == 4  # none waits for another's fault to end


# -- the faults a node injects into its own links (`aurora node --faults`)
async def test_an_injected_partition_is_silent_both_ways_until_heartbeats_find_it() -> None:
    import asyncio

    from aurora.transport.faults import FAULTS

    from aurora.protocol.link import LinkTimings
    from aurora.protocol.messages import Want
    from aurora.testing.memory import memory_channel_pair

    a, b = memory_channel_pair("child", "parent", timings=LinkTimings(0.05, 0.15, 0.3))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(a.run_link())
        tg.create_task(b.run_link())
        await b.send(Want(w="x", n=1))
        assert (await a.recv()).msg == Want(w="x", n=1)
        FAULTS.silent.add("parent")  # the child's side of its link to "parent"
        try:
            await a.send(Want(w="lost", n=1))  # lost on the way, as on a cut link
            await asyncio.wait_for(asyncio.gather(a.wait_closed(), b.wait_closed()), 10)
        finally:
            FAULTS.silent.discard("parent")
    assert "lost" in (a.close_reason or "")
    assert "lost" in (b.close_reason or "")
    assert not b._inbox[Lane.CONTROL]  # nothing the child sent arrived


async def test_a_node_that_stops_reading_leaves_its_messages_queued_until_it_reads_again() -> None:
    import asyncio

    from aurora.transport.faults import FAULTS

    from aurora.protocol.messages import Want
    from aurora.testing.memory import memory_channel_pair

    a, b = memory_channel_pair("child", "parent")
    FAULTS.unread.add("parent")
    try:
        await b.send(Want(w="x", n=1))
        reading = asyncio.ensure_future(a.recv())
        await asyncio.sleep(0.2)
        assert not reading.done()
        FAULTS.toggle(FAULTS.unread, "parent", "not_reading")  # read again
        assert (await asyncio.wait_for(reading, 5)).msg == Want(w="x", n=1)
    finally:
        FAULTS.unread.discard("parent")


def test_a_running_trainer_compacts_a_journal_grown_too_big_and_keeps_its_live_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aurora.store.journal as journal

    j, _ = ResultJournal.open(tmp_path, 0)
    for i in range(5):
        j.accepted(*_result(i, 0))
    j.taken([0, 1], at=0)
    j.taken([2], at=1)  # version 2 is being made: it is not stored yet
    monkeypatch.setattr(journal, "COMPACT_BYTES", 100)
    assert j.too_big()
    kept = j.compact(1)  # version 1 is stored: the take at 0 is in it
    assert [p.id for p, _ in kept.pending] == [2, 3, 4]
    assert [p.id for p, _ in j.replay(1).pending] == [2, 3, 4]  # a crash before version 2 is stored
    assert [p.id for p, _ in j.replay(2).pending] == [3, 4]  # after: prompt 2 is in it, never trained twice


def test_a_batch_given_back_untrained_is_pending_again(tmp_path: Path) -> None:
    j, _ = ResultJournal.open(tmp_path, 0)
    for i in range(3):
        j.accepted(*_result(i, 0))
    j.taken([0, 1], at=0)
    j.returned([0, 1])  # the learner's step failed
    j.taken([1, 2], at=0)  # the retry took others
    assert [p.id for p, _ in j.replay(1).pending] == [0]


def test_the_checker_catches_a_result_trained_twice_and_knows_a_returned_batch() -> None:
    h = _clean()
    h["trainer"][1][1] = _e(RESULTS_RESTORED, 20, items=[2, 4, 5], next=6, done=3)  # 2 is in version 2
    assert _rules(h) == ["trained once"]

    h = _clean()
    h["trainer"][0].insert(3, _e(BATCH_RETURNED, 2, items=[0, 1]))  # given back untrained, never retaken
    h["trainer"][1][1] = _e(RESULTS_RESTORED, 20, items=[0, 1, 4, 5], next=6, done=2)
    assert _rules(h) == []


def test_aurora_chaos_exits_1_with_the_first_violation_and_the_history_around_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import aurora.chaos
    from aurora.chaos import Outcome, around, line
    from aurora.cli import main

    lives = _clean()
    lives["trainer"][0][4] = _e(RESULT_ACCEPTED, 4, item=2, version=0, current=2)  # 2 versions old, bound 1
    report = check(lives, "trainer", 1, 4)
    history = [dict(e, node=n, life=k) for n, ls in lives.items() for k, life in enumerate(ls) for e in life]
    history.sort(key=lambda e: str(e["timestamp"]))
    outcome = Outcome(report, [], 0, 1.0, tmp_path, history)
    monkeypatch.setattr(aurora.chaos, "run_chaos", lambda *a, **k: outcome)

    assert main(["chaos", "topologies/tiny.yaml", "--steps", "4"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION (staleness) on trainer" in out
    shown = around(history, report.violations[0])
    assert shown
    assert all("  " + line(e) in out.splitlines() for e in shown)
    assert "  " + line(dict(lives["trainer"][0][4], node="trainer", life=0)) in out.splitlines()
    assert f"logs: {tmp_path}" in out
