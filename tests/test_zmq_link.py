"""ZeroMQ link behaviour beyond the conformance suite: a parent restarting, lost credit reports."""

from __future__ import annotations

import asyncio

import pytest
from aurora.transport.zmq import LinkConfig, ZmqChannel, ZmqClient, ZmqServer

from aurora.errors import TransportClosed

CFG = LinkConfig(window=8, heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8)


async def test_parent_restart_on_the_same_address_gives_the_child_a_fresh_channel() -> None:
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        old = await client.start_in(tg)
        first = await asyncio.wait_for(server.accept(), 5)
        await old.send({"hello": 1})  # goes once the child has heard this parent incarnation
        assert (await asyncio.wait_for(first.recv(), 5)).header == {"hello": 1}
        await server.close_abruptly()

        server2 = ZmqServer("parent", bind=addr, cfg=CFG)
        await server2.start_in(tg)
        new = await asyncio.wait_for(client.accept(), 10)
        with pytest.raises(TransportClosed, match=r"restarted|lost"):
            await asyncio.wait_for(old.recv(), 5)
        down = await asyncio.wait_for(server2.accept(), 5)
        for i in range(CFG.window * 3):  # more than a window: credit works on the new channel
            await new.send({"i": i})
            assert (await asyncio.wait_for(down.recv(), 5)).header == {"i": i}
        await client.close()
        await server2.close()


async def test_a_parent_that_dies_before_it_is_heard_leaves_nothing_half_sent() -> None:
    """The child sends nothing until it hears the parent, so when the parent dies first, the
    next parent on that address picks up the same channel with clean flow-control state."""
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        await server.close_abruptly()
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        up = await client.start_in(tg)
        server2 = ZmqServer("parent", bind=addr, cfg=CFG)
        await server2.start_in(tg)
        down = await asyncio.wait_for(server2.accept(), 5)
        for i in range(CFG.window * 3):
            await up.send({"i": i})
            assert (await asyncio.wait_for(down.recv(), 5)).header == {"i": i}
        await client.close()
        await server2.close()


async def test_lost_credit_reports_are_healed_by_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credit totals are cumulative and ride on heartbeats, so dropping every explicit
    credit frame slows a sender down but never stalls it."""
    monkeypatch.setattr(ZmqChannel, "_report_read", lambda self, total: None)
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        up = await client.start_in(tg)
        down = await asyncio.wait_for(server.accept(), 5)

        async def produce() -> None:
            for i in range(CFG.window * 4):
                await up.send({"i": i})

        tg.create_task(produce())
        for i in range(CFG.window * 4):
            assert (await asyncio.wait_for(down.recv(), 5)).header == {"i": i}
        await client.close()
        await server.close()
