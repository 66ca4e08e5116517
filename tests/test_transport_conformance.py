"""The channel conformance suite against the in-memory and ZeroMQ transports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aurora.transport.base import Channel
from aurora.transport.webrtc import RtcConfig, WebRtcTransport
from aurora.transport.zmq import LinkConfig, ZmqClient, ZmqServer

from aurora.testing.conformance import CHECKS, LinkFactory, LinkPair
from aurora.testing.memory import memory_channel_pair
from aurora.testing.webrtc import RtcPairs, loopback_ice

CFG = LinkConfig(window=16, max_frame_bytes=32 * 1024 * 1024, heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8)


@contextlib.asynccontextmanager
async def memory_link() -> AsyncIterator[LinkPair]:
    a, b = memory_channel_pair(window=CFG.window, max_frame_bytes=CFG.max_frame_bytes)

    async def kill_b() -> None:
        a._shut("peer lost: in-process peer died")

    async def restart_b() -> tuple[Channel, Channel]:
        a._shut("peer restarted")
        return memory_channel_pair(window=CFG.window, max_frame_bytes=CFG.max_frame_bytes)

    yield LinkPair(a, b, kill_b, CFG.window, CFG.max_frame_bytes, CFG.lost_after_s, restart_b)


@contextlib.asynccontextmanager
async def zmq_link() -> AsyncIterator[LinkPair]:
    server = ZmqServer("parent", cfg=CFG)
    client = ZmqClient("child", "", "parent", cfg=CFG)
    async with asyncio.TaskGroup() as tg:
        addr = await server.start_in(tg)
        client.connect_addr = addr
        b = await client.start_in(tg)
        a = await asyncio.wait_for(server.accept(), 5)

        clients = [client]

        async def kill_b() -> None:
            await client.close_abruptly()

        async def restart_b() -> tuple[Channel, Channel]:
            await clients[-1].close_abruptly()
            clients.append(ZmqClient("child", addr, "parent", cfg=CFG))
            b2 = await clients[-1].start_in(tg)
            return await asyncio.wait_for(server.accept(), 5), b2

        try:
            yield LinkPair(a, b, kill_b, CFG.window, CFG.max_frame_bytes, CFG.lost_after_s, restart_b)
        finally:
            for c in clients:
                await c.close()
            await server.close()


# Both WebRTC ends share one event loop here and aiortc's SCTP is pure Python, so a 16 MiB
# message keeps the loop busy for seconds: liveness gets a looser bound than the other links.
RTC_CFG = RtcConfig(
    window=CFG.window, max_frame_bytes=CFG.max_frame_bytes, heartbeat_s=0.25, suspect_after_s=1.0, lost_after_s=3.0
)


@contextlib.asynccontextmanager
async def webrtc_link() -> AsyncIterator[LinkPair]:
    with loopback_ice():
        async with asyncio.TaskGroup() as tg:
            ta, tb = WebRtcTransport("parent", RTC_CFG), WebRtcTransport("child", RTC_CFG)
            await ta.start_in(tg)
            await tb.start_in(tg)
            pairs = RtcPairs(tg)
            a, b = await pairs.connect(ta, tb)
            chans = [a, b]

            async def kill_b() -> None:
                await b.pc.close()  # the association ends with no close message

            async def restart_b() -> tuple[Channel, Channel]:
                await chans[-1].pc.close()
                tb2 = WebRtcTransport("child", RTC_CFG)
                await tb2.start_in(tg)
                a2, b2 = await pairs.connect(ta, tb2)
                chans.extend((a2, b2))
                return a2, b2

            try:
                yield LinkPair(a, b, kill_b, CFG.window, CFG.max_frame_bytes, RTC_CFG.lost_after_s, restart_b)
            finally:
                for c in chans:
                    await c.close()
                await pairs.close()


LINKS: dict[str, LinkFactory] = {"memory": memory_link, "zmq": zmq_link, "webrtc": webrtc_link}


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("transport", sorted(LINKS))
async def test_conformance(transport: str, check: str) -> None:
    await asyncio.wait_for(CHECKS[check](LINKS[transport]), 30)
