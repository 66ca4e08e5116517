"""WebRTC signalling: fingerprints must match what was announced; the parent stamps the sender."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from aurora.transport.webrtc import RtcConfig, WebRtcTransport, sdp_fingerprints
from structlog.testing import capture_logs

from aurora.errors import ProtocolError, TransportClosed
from aurora.events import WEBRTC_FINGERPRINT_MISMATCH
from aurora.protocol.messages import Probe, RtcAnswer, RtcOffer, RtcRefused, Signal
from aurora.testing.memory import MemoryChannel, memory_channel_pair
from aurora.testing.webrtc import loopback_ice

CFG = RtcConfig(connect_timeout_s=10)


async def _rendezvous(legs: dict[str, MemoryChannel], rewrite: Callable[[Signal], Signal]) -> None:
    """A rendezvous node: forwards what each leg sends to the leg named in ``to``."""

    async def serve(name: str, ch: MemoryChannel) -> None:
        with contextlib.suppress(TransportClosed):
            while True:
                m = (await ch.recv()).msg
                assert isinstance(m, RtcOffer | RtcAnswer | RtcRefused)
                await legs[m.to].send(rewrite(msgspec.structs.replace(m, sender=name)))

    async with asyncio.TaskGroup() as tg:
        for name, ch in legs.items():
            tg.create_task(serve(name, ch))


async def _through_rendezvous(rewrite: Callable[[Signal], Signal]) -> tuple[Any, list[str]]:
    with loopback_ice():
        async with asyncio.TaskGroup() as tg:
            a, b = WebRtcTransport("rollout-a", CFG), WebRtcTransport("rollout-b", CFG)
            await a.start_in(tg)
            await b.start_in(tg)
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
                await result.send(Probe(note="webrtc"))
                assert (await asyncio.wait_for(got.recv(), 10)).msg == Probe(note="webrtc")
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
    def tamper(h: Signal) -> Signal:
        if isinstance(h, RtcOffer):  # someone on the path swaps the announced certificate
            return msgspec.structs.replace(h, fingerprint=["sha-256 " + ":".join(["AB"] * 32)])
        return h

    with capture_logs() as logs:
        result, refused = await _through_rendezvous(tamper)
    assert isinstance(result, TransportClosed)
    assert "refused" in str(result)
    assert "fingerprint" in str(result)
    assert refused == ["rollout-a"]
    assert any(e["event"] == WEBRTC_FINGERPRINT_MISMATCH for e in logs)


async def test_the_parent_stamps_the_real_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a child signals on its channel is taken as from that child, whatever it says."""
    parent = WebRtcTransport("relay", CFG)
    seen: list[str] = []
    monkeypatch.setattr(parent, "on_signal", lambda msg, via: seen.append(msg.sender))
    mine, theirs = memory_channel_pair("relay", "rollout-a")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(parent.serve_signalling(mine, stamp=True))
        await theirs.send(RtcOffer(to="relay", sender="rollout-b", id="1", sdp="", fingerprint=["x"]))
        await theirs.close("test over")
    assert seen == ["rollout-a"]


async def test_a_garbage_offer_is_refused_and_the_transport_goes_on() -> None:
    """An offer with garbage SDP, or an SDP aiortc cannot take, never ends the transport's task group."""
    with loopback_ice():
        async with asyncio.TaskGroup() as tg:
            t = WebRtcTransport("relay", CFG)
            await t.start_in(tg)
            mine, theirs = memory_channel_pair("relay", "rollout")
            for sdp in (
                "m=audio x y z",
                "v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n" * 3,
                "\x00" * 100,
            ):
                t.on_signal(RtcOffer(to="relay", sender="rollout", id="x", sdp=sdp, fingerprint=["sha-256 AA"]), mine)
            answers = [(await asyncio.wait_for(theirs.recv(), 10)).msg for _ in range(3)]
            assert all(isinstance(a, RtcRefused) for a in answers), answers
            with pytest.raises(ProtocolError, match="session description"):
                sdp_fingerprints("m=audio x y z")  # aiortc's parser asserts on this
            await mine.close()
