"""ZeroMQ link behaviour beyond the conformance suite: a parent restarting, lost credit reports."""

from __future__ import annotations

import asyncio

import pytest
from aurora.transport.zmq import CurveKeys, LinkConfig, ZmqChannel, ZmqClient, ZmqServer, ZmqTransport

from aurora.auth.keys import NodeKeys
from aurora.errors import ConfigError, TransportClosed
from aurora.protocol.messages import LinkBeat, LinkClose, LinkCredit, Probe

CFG = LinkConfig(window=8, heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8)


async def test_parent_restart_on_the_same_address_gives_the_child_a_fresh_channel() -> None:
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        old = await client.start_in(tg)
        first = await asyncio.wait_for(server.accept(), 5)
        await old.send(Probe(note="hello"))  # goes once the child has heard this parent incarnation
        assert (await asyncio.wait_for(first.recv(), 5)).msg == Probe(note="hello")
        await server.close_abruptly()

        server2 = ZmqServer("parent", bind=addr, cfg=CFG)
        await server2.start_in(tg)
        new = await asyncio.wait_for(client.accept(), 10)
        with pytest.raises(TransportClosed, match=r"restarted|lost"):
            await asyncio.wait_for(old.recv(), 5)
        down = await asyncio.wait_for(server2.accept(), 5)
        for i in range(CFG.window * 3):  # more than a window: credit works on the new channel
            await new.send(Probe(i=i))
            assert (await asyncio.wait_for(down.recv(), 5)).msg == Probe(i=i)
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
            await up.send(Probe(i=i))
            assert (await asyncio.wait_for(down.recv(), 5)).msg == Probe(i=i)
        await client.close()
        await server2.close()


async def test_lost_credit_reports_are_healed_by_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credit totals are cumulative and ride on heartbeats, so dropping every explicit
    credit frame slows a sender down but never stalls it."""
    send_control = ZmqChannel._send_control

    def drop_credit(self: ZmqChannel, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        if not isinstance(frame, LinkCredit):
            send_control(self, frame)

    monkeypatch.setattr(ZmqChannel, "_send_control", drop_credit)
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        up = await client.start_in(tg)
        down = await asyncio.wait_for(server.accept(), 5)

        async def produce() -> None:
            for i in range(CFG.window * 4):
                await up.send(Probe(i=i))

        tg.create_task(produce())
        for i in range(CFG.window * 4):
            assert (await asyncio.wait_for(down.recv(), 5)).msg == Probe(i=i)
        await client.close()
        await server.close()


async def test_transport_connects_by_node_id_and_address_both_ways() -> None:
    async with asyncio.TaskGroup() as tg:
        parent = ZmqTransport("relay-a", cfg=CFG, bind="tcp://127.0.0.1:0")
        addr = await parent.start_in(tg)
        child = ZmqTransport("rollout-1", cfg=CFG)
        assert await child.start_in(tg) == ""  # nothing to listen at
        up = await child.connect("relay-a", addr)
        down = await asyncio.wait_for(parent.accept(), 5)
        assert (up.peer, down.peer) == ("relay-a", "rollout-1")
        await up.send(Probe(note="lease"))
        assert (await asyncio.wait_for(down.recv(), 5)).msg == Probe(note="lease")
        await down.send(Probe(note="delta"), b"chunk")
        m = await asyncio.wait_for(up.recv(), 5)
        assert (m.msg, bytes(m.buffers[0])) == (Probe(note="delta"), b"chunk")
        await child.close()
        await parent.close()


async def test_curve_without_the_peers_key_is_a_config_error() -> None:
    async with asyncio.TaskGroup() as tg:
        t = ZmqTransport("rollout-1", cfg=CFG, keys=NodeKeys(CurveKeys.generate()))
        await t.start_in(tg)
        with pytest.raises(ConfigError, match="relay-a"):
            await t.connect("relay-a", "tcp://127.0.0.1:1")
        await t.close()


async def test_a_close_cancelled_while_a_channel_flushes_still_closes_the_socket() -> None:
    """A node stopping while its uplink disconnects a parent cancels the client's close midway; the
    socket must not be left open, owned by nobody (it was, until the close was made cancellation-safe)."""
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=CFG)
        addr = await server.start_in(tg)
        client = ZmqClient("child", addr, "parent", cfg=CFG)
        up = await client.start_in(tg)
        await asyncio.wait_for(server.accept(), 5)
        flushing = asyncio.Event()

        async def slow_close(reason: str = "closed") -> None:
            flushing.set()
            await asyncio.Event().wait()  # a flush that does not end before the cancellation

        up.close = slow_close  # type: ignore[method-assign]
        closing = asyncio.ensure_future(client.close())
        await asyncio.wait_for(flushing.wait(), 5)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert client.sock.closed
        await server.close()
