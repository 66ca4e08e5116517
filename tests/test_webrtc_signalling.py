"""WebRTC signalling: fingerprints must match what was announced; a rendezvous stamps the sender."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from aurora.transport.webrtc import RtcConfig, WebRtcTransport, relay_signal
from structlog.testing import capture_logs

from aurora.errors import ProtocolError, TransportClosed
from aurora.testing.memory import MemoryChannel, memory_channel_pair
from aurora.testing.webrtc import loopback_ice

CFG = RtcConfig(connect_timeout_s=10)


async def _rendezvous(legs: dict[str, MemoryChannel], rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A rendezvous node: forwards what each leg sends to the leg named in ``to``."""

    async def serve(name: str, ch: MemoryChannel) -> None:
        with contextlib.suppress(TransportClosed):
            while True:
                m = await ch.recv()
                dst, h = relay_signal(m.header, came_from=name)
                await legs[dst].send(rewrite(h))

    async with asyncio.TaskGroup() as tg:
        for name, ch in legs.items():
            tg.create_task(serve(name, ch))


async def _through_rendezvous(rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[Any, list[str]]:
    with loopback_ice():
        async with asyncio.TaskGroup() as tg:
            a, b = WebRtcTransport("rollout-a", CFG), WebRtcTransport("rollout-b", CFG)
            a.start_in(tg)
            b.start_in(tg)
            a_up, relay_a = memory_channel_pair("rollout-a", "relay")
            b_up, relay_b = memory_channel_pair("rollout-b", "relay")
            chans = [a_up, relay_a, b_up, relay_b]
            tg.create_task(_rendezvous({"rollout-a": relay_a, "rollout-b": relay_b}, rewrite))
            tg.create_task(a.serve_signalling(a_up))
            tg.create_task(b.serve_signalling(b_up))
            a.use_rendezvous("relay", a_up)
            try:
                result: Any = await a.connect("rollout-b", "relay")
                got = await asyncio.wait_for(b.accept(), 10)
                await result.send({"via": "webrtc"})
                assert (await asyncio.wait_for(got.recv(), 10)).header == {"via": "webrtc"}
                await result.close()
                await got.close()
            except TransportClosed as e:
                result = e
            for c in chans:
                await c.close("test over")
    return result, b.refused + a.refused


async def test_peers_meet_through_a_rendezvous() -> None:
    result, refused = await _through_rendezvous(lambda h: h)
    assert not isinstance(result, Exception)
    assert refused == []


async def test_an_offer_whose_sdp_fingerprint_differs_from_the_announced_one_is_refused() -> None:
    def tamper(h: dict[str, Any]) -> dict[str, Any]:
        if h["k"] == "rtc_offer":  # someone on the path swaps the announced certificate
            return {**h, "fingerprint": ["sha-256 " + ":".join(["AB"] * 32)]}
        return h

    with capture_logs() as logs:
        result, refused = await _through_rendezvous(tamper)
    assert isinstance(result, TransportClosed)
    assert "refused" in str(result)
    assert "fingerprint" in str(result)
    assert refused == ["rollout-a"]
    assert any(e["event"] == "webrtc_fingerprint_mismatch" for e in logs)


def test_the_rendezvous_stamps_the_real_sender() -> None:
    dst, h = relay_signal({"k": "rtc_offer", "to": "b", "from": "someone-else", "sdp": ""}, came_from="a")
    assert (dst, h["from"]) == ("b", "a")
    with pytest.raises(ProtocolError, match="not a signalling message"):
        relay_signal({"k": "delta_chunk", "to": "b"}, came_from="a")
