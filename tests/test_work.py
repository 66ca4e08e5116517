"""The coordinator on its own: the lease and staleness gates, and malformed messages rejected, not fatal."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import msgpack
from aurora.actors.flow import VersionFlow
from aurora.actors.work import Coordinator, WorkPool, arithmetic_prompts
from aurora.transport.base import Message

from aurora.config.topology import LeaseSpec
from aurora.engine import Completion


def _setup(version: int) -> tuple[Coordinator, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    async def down(header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> bool:
        sent.append(dict(header))
        return True

    pool = WorkPool(LeaseSpec(ttl_s=5.0, prompts_per_lease=2), 1, arithmetic_prompts(0))
    return Coordinator(pool, VersionFlow("trainer", None, version), down), sent


def _result(w: str, item: int, token: int, v: int, body: bytes | None = None) -> Message:
    c = Completion(item, "x", [5], [0.0], v)
    return Message({"k": "result", "w": w, "item": item, "token": token, "v": v},
                   (memoryview(body if body is not None else msgpack.packb(asdict(c))),))  # fmt: skip


async def test_results_are_gated_by_lease_and_staleness_and_bad_ones_are_rejected() -> None:
    coord, sent = _setup(version=5)
    for w in ("w1", "w2"):  # a worker not yet measured gets one prompt
        await coord.receive(Message({"k": "want", "w": w, "n": 2}, ()))
    ((a, ta, _, _),), ((b, tb, _, _),) = (g["leases"] for g in sent)
    await coord.receive(_result("w1", a, ta, 3))  # 2 versions old, bound 1: stale, prompt back to the pool
    await coord.receive(_result("w2", b, tb, 4))  # within the bound: accepted
    await coord.receive(_result("w2", b, tb, 4))  # twice: rejected
    await coord.receive(_result("w1", a, ta, 5, body=b"\xc1 not msgpack"))  # malformed: rejected, no crash
    await coord.receive(Message({"k": "result", "w": "w1"}, ()))  # fields missing: dropped, no crash
    verdicts = [(m["ok"], m["reason"]) for m in sent if m["k"] == "verdict"]
    assert verdicts[0][0] is False
    assert verdicts[0][1].startswith("stale")
    assert verdicts[1] == (True, None)
    assert verdicts[2] == (False, "duplicate")
    assert verdicts[3] == (False, "malformed")
    assert coord.pool.accepted == 1
    assert [x[:3] for x in coord.pool.log] == [(b, "w2", 4)]
    await coord.receive(Message({"k": "want", "w": "w3", "n": 1}, ()))
    (again, token, _, _) = sent[-1]["leases"][0]
    assert again == a  # the stale result's prompt is leased again first, under a new token
    assert token > ta
