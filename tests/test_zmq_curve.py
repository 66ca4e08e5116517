"""CurveZMQ: a configured client gets through; an unknown client is refused and logged."""

from __future__ import annotations

import asyncio

import pytest
from aurora.transport.base import FrameTooLarge
from aurora.transport.zmq import CurveKeys, LinkConfig, ZmqClient, ZmqServer
from structlog.testing import capture_logs

from aurora.errors import TransportClosed
from aurora.events import CURVE_CLIENT_REFUSED
from aurora.protocol.messages import Probe

CFG = LinkConfig(heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8, max_frame_bytes=1024)


async def test_known_client_talks_unknown_client_is_refused() -> None:
    server_keys, good, bad = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    server = ZmqServer("parent", cfg=CFG, curve=server_keys, clients={good.public: "good"})
    with capture_logs() as logs:
        async with asyncio.TaskGroup() as tg:
            addr = await server.start_in(tg)
            ok = ZmqClient("good", addr, "parent", cfg=CFG, curve=good, server_key=server_keys.public)
            intruder = ZmqClient("bad", addr, "parent", cfg=CFG, curve=bad, server_key=server_keys.public)
            ch = await ok.start_in(tg)
            bad_ch = await intruder.start_in(tg)
            peer = await asyncio.wait_for(server.accept(), 5)
            assert peer.peer == "good"
            await ch.send(Probe(note="hello"), b"data")
            m = await asyncio.wait_for(peer.recv(), 5)
            assert m.msg == Probe(note="hello")
            with pytest.raises(FrameTooLarge, match="max_frame_bytes"):
                await ch.send(Probe(), bytes(2048))
            # The intruder never gets a channel on the server, and its own side sees the parent lost.
            with pytest.raises(TransportClosed, match="lost"):
                await asyncio.wait_for(bad_ch.recv(), 5)
            assert "bad" not in server.channels
            assert bad.public in server.refused
            for c in (ok, intruder):
                await c.close()
            await server.close()
    assert any(e["event"] == CURVE_CLIENT_REFUSED for e in logs)


async def test_curve_needs_both_sides_keys() -> None:
    with pytest.raises(ValueError, match="server's public key"):
        ZmqClient("x", "tcp://127.0.0.1:1", "parent", curve=CurveKeys.generate())
