"""The coordinator's driver: typed work messages in, grants and verdicts out; the learner's take."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from aurora.actors.flow import VersionFlow
from aurora.actors.work import Coordinator, WorkBoard
from aurora.transport.base import Message

from aurora.protocol.messages import AppMessage, Grant, Result, SampleWire, Verdict, Want
from aurora.protocol.workpool import PoolSettings, ResultRules, WorkPool
from aurora.rl.types import Prompt


def _prompts() -> Iterator[Prompt]:
    i = 0
    while True:
        yield Prompt(i, "1+1=", "2", tokens=(1, 20, 4))
        i += 1


def _setup(version: int, batch: int = 0) -> tuple[Coordinator, list[AppMessage]]:
    sent: list[AppMessage] = []

    async def down(msg: AppMessage, buffers: tuple[bytes | memoryview, ...]) -> bool:
        sent.append(msg)
        return True

    settings = PoolSettings(ttl_s=5.0, prompts_per_lease=2, batch_s=1.0, ahead_steps=2, max_stale=1)
    pool = WorkPool(settings, _prompts(), ResultRules(vocab_size=128, max_new_tokens=4), group_size=2, batch=batch)
    return Coordinator(pool, WorkBoard(), VersionFlow("trainer", None, version), down), sent


def _result(w: str, item: int, token: bytes, v: int, lp: float = -0.5) -> Message:
    return Message(Result(w=w, item=item, token=token, v=v, samples=[SampleWire([5], [lp])] * 2))


async def test_grants_carry_the_trainers_tokens_and_results_get_verdicts_with_reasons() -> None:
    coord, sent = _setup(version=5)
    for w in ("w1", "w2"):
        await coord.receive(Message(Want(w=w, n=2)))
    g1, g2 = sent
    assert isinstance(g1, Grant)
    assert isinstance(g2, Grant)
    assert g1.n == 2  # the group size travels with the grant
    assert g1.leases[0].tokens == [1, 20, 4]  # the prompt as the trainer tokenized it
    assert len(g1.leases[0].token) == 16 and g1.leases[0].token != g2.leases[0].token  # noqa: PT018
    a, b = g1.leases[0], g2.leases[0]
    await coord.receive(_result("w1", a.item, a.token, 3))  # 2 versions old, bound 1: stale
    await coord.receive(_result("w2", b.item, b.token, 4))  # accepted
    await coord.receive(_result("w2", b.item, b.token, 4, lp=-1e4 + 1))  # twice, and a lie: rejected
    verdicts = [m for m in sent if isinstance(m, Verdict)]
    assert [v.ok for v in verdicts] == [False, True, False]
    assert verdicts[0].reason is not None and verdicts[0].reason.startswith("stale")  # noqa: PT018
    assert coord.board.results == 3
    assert coord.board.validate_s > 0
    assert coord.board.more.is_set()


async def test_the_learner_waits_for_enough_results_and_taking_opens_room() -> None:
    coord, sent = _setup(version=0, batch=1)
    await coord.receive(Message(Want(w="w1", n=2)))
    (g,) = sent
    assert isinstance(g, Grant)
    take = asyncio.ensure_future(coord.board.take(coord.pool, 1, 0))
    await asyncio.sleep(0.01)
    assert not take.done()  # nothing accepted yet
    await coord.receive(_result("w1", g.leases[0].item, g.leases[0].token, 0))
    (batch,) = await asyncio.wait_for(take, 1)
    assert batch[0].id == g.leases[0].item
    assert coord.board.room.is_set()
