"""MemoryNetwork: ordering, faults, backpressure, close."""

from __future__ import annotations

import asyncio

import pytest

from aurora.errors import TransportClosed
from aurora.testing.memory import MemoryNetwork
from aurora.testing.simnet import Faults


async def test_in_order_without_faults_and_close() -> None:
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")
    for i in range(100):
        await a.send("b", i)
    assert [(await b.recv())[1] for _ in range(100)] == list(range(100))
    b.close("test over")
    with pytest.raises(TransportClosed, match="test over"):
        await b.recv()
    with pytest.raises(TransportClosed):
        await b.send("a", 1)


async def test_backpressure_bounds_the_inbox() -> None:
    net = MemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b", capacity=3)
    for i in range(3):
        await a.send("b", i)
    blocked = asyncio.ensure_future(a.send("b", 3))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert (await b.recv())[1] == 0
    await asyncio.wait_for(blocked, 1)


async def test_partition_drop_duplicate_and_jitter_reorders() -> None:
    net = MemoryNetwork(seed=3, faults=Faults(delay_s=0.001, jitter_s=0.01))
    a, b = net.endpoint("a", capacity=1000), net.endpoint("b", capacity=1000)
    for i in range(50):
        await a.send("b", i)
    await asyncio.sleep(0.05)
    got = [(await b.recv())[1] for _ in range(50)]
    assert sorted(got) == list(range(50))
    assert got != list(range(50))  # jitter reordered some
    net.faults.partitions.add(frozenset(("a", "b")))
    await a.send("b", "lost")
    net.faults.partitions.clear()
    net.faults.duplicate = 1.0
    await a.send("b", "twice")
    await asyncio.sleep(0.05)
    assert [(await b.recv())[1] for _ in range(2)] == ["twice", "twice"]
    assert net.dropped == 1
