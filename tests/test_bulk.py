"""Bulk transfer: striping, per-frame checks, streams dying, resume — pure core and drivers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from aurora.transport.base import Message
from aurora.transport.bulk import BulkReceiver, receive_bulk, send_bulk
from aurora.transport.zmq import LinkConfig, ZmqClient, ZmqServer
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from aurora.errors import ProtocolError, TransportClosed
from aurora.events import BULK_FRAME_REJECTED, BULK_RESUMED, BULK_STREAM_DROPPED
from aurora.protocol.bulk import BulkAssembly, BulkOffer, frame_digest, payload_digest, to_ranges
from aurora.protocol.link import bulk_size
from aurora.protocol.messages import AppMessage, BulkFrame, Lane
from aurora.testing.memory import MemoryChannel, memory_channel_pair


def _offer(data: bytes, frame_bytes: int, tid: str = "t") -> BulkOffer:
    return BulkOffer(tid, len(data), frame_bytes, payload_digest(data, frame_bytes))


@given(
    data=st.binary(min_size=0, max_size=2000),
    frame_bytes=st.integers(1, 300),
    order=st.randoms(use_true_random=False),
    corrupt=st.sets(st.integers(0, 50), max_size=5),
)
def test_assembly_holds_exactly_the_good_frames_in_any_order(
    data: bytes, frame_bytes: int, order: Any, corrupt: set[int]
) -> None:
    offer = _offer(data, frame_bytes)
    asm = BulkAssembly(offer)
    idx = list(range(offer.frames)) * 2  # every frame twice: duplicates are harmless
    order.shuffle(idx)
    seen: set[int] = set()
    for n, i in enumerate(idx):
        start, end = offer.span(i)
        frame = data[start:end]
        if n in corrupt:  # a wrong digest is refused and changes nothing
            before = (asm.missing(), asm.contiguous_bytes)
            with pytest.raises(ProtocolError):
                asm.add(i, frame, frame_digest(frame) ^ 1)
            assert (asm.missing(), asm.contiguous_bytes) == before
            continue
        assert asm.add(i, frame, frame_digest(frame)) == (i not in seen)
        seen.add(i)
        assert asm.missing() == to_ranges(sorted(set(range(offer.frames)) - seen))
        prefix = 0
        while prefix in seen:
            prefix += 1
        assert asm.contiguous_bytes == min(len(data), prefix * frame_bytes)
    if asm.complete:
        assert bytes(asm.payload()) == data
    else:
        with pytest.raises(ProtocolError):
            asm.payload()


def test_frames_of_the_wrong_size_or_index_are_refused() -> None:
    data = bytes(range(100))
    asm = BulkAssembly(_offer(data, 30))
    with pytest.raises(ProtocolError, match="expected 30"):
        asm.add(0, data[:29], frame_digest(data[:29]))
    with pytest.raises(ProtocolError, match="out of range"):
        asm.add(4, data[:10], frame_digest(data[:10]))
    assert asm.held_frames == 0


class FlakyChannel:
    """Wraps a channel: dies after ``die_after`` frames, or corrupts the ``corrupt``-th frame it
    sends; counts frames."""

    def __init__(self, inner: MemoryChannel, die_after: int | None = None, corrupt: int | None = None) -> None:
        self.inner = inner
        self.peer = inner.peer
        self.die_after = die_after
        self.corrupt = corrupt
        self.frames = 0

    @property
    def closed(self) -> bool:
        return self.inner.closed

    @property
    def close_reason(self) -> str | None:
        return self.inner.close_reason

    async def send(self, header: AppMessage, *buffers: bytes | memoryview) -> None:
        if isinstance(header, BulkFrame):
            if self.die_after is not None and self.frames >= self.die_after:
                await self.inner.close("link cut")
                raise TransportClosed("link cut")
            self.frames += 1
            if self.frames == self.corrupt:
                bad = bytearray(buffers[0])
                bad[0] ^= 0xFF
                buffers = (bytes(bad),)
        await self.inner.send(header, *buffers)

    async def recv(self, lane: Lane | None = None) -> Message:
        return await self.inner.recv(lane)

    async def close(self, reason: str = "closed") -> None:
        await self.inner.close(reason)

    def fault(self, reason: str) -> None:
        self.inner.fault(reason)


def _pairs(n: int, **flaky: Any) -> tuple[list[FlakyChannel], list[MemoryChannel]]:
    senders, receivers = [], []
    for _ in range(n):
        a, b = memory_channel_pair(window=8, bulk_bytes=8 * bulk_size(FRAME))
        senders.append(FlakyChannel(a, **flaky))
        receivers.append(b)
    return senders, receivers


PAYLOAD = os.urandom(5 * 1024 * 1024 + 123)
FRAME = 128 * 1024


async def test_striped_transfer_survives_a_dying_stream_and_a_corrupt_frame() -> None:
    senders, receivers = _pairs(3)
    senders[1].die_after = 4
    senders[2].corrupt = 3
    with capture_logs() as logs:
        async with asyncio.TaskGroup() as tg:
            got = tg.create_task(receive_bulk(receivers))
            await send_bulk(senders, PAYLOAD, frame_bytes=FRAME)
    assert bytes(got.result()) == PAYLOAD
    assert all(s.frames > 0 for s in senders), "every stream carried frames"
    events = {e["event"] for e in logs}
    assert {BULK_STREAM_DROPPED, BULK_FRAME_REJECTED} <= events


async def test_an_interrupted_transfer_resumes_from_what_arrived() -> None:
    receiver = BulkReceiver()
    frames = -(-len(PAYLOAD) // FRAME)
    senders, receivers = _pairs(2, die_after=5)
    first = asyncio.ensure_future(receive_bulk(receivers, receiver))
    with pytest.raises(TransportClosed, match="every stream closed"):
        await send_bulk(senders, PAYLOAD, transfer_id="snap-7", frame_bytes=FRAME)
    with pytest.raises(TransportClosed, match="before the transfer completed"):
        await first
    held = receiver.partial["snap-7"].held_frames
    assert held == 10

    senders, receivers = _pairs(2)  # a new connection
    with capture_logs() as logs:
        async with asyncio.TaskGroup() as tg:
            got = tg.create_task(receive_bulk(receivers, receiver))
            await send_bulk(senders, PAYLOAD, transfer_id="snap-7", frame_bytes=FRAME)
    assert bytes(got.result()) == PAYLOAD
    assert sum(s.frames for s in senders) == frames - held, "only the missing frames were sent again"
    assert any(e["event"] == BULK_RESUMED for e in logs)
    assert receiver.partial == {}


async def test_bulk_over_several_zeromq_connections() -> None:
    cfg = LinkConfig(window=8, heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8)
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("parent", cfg=cfg)
        addr = await server.start_in(tg)
        clients = [ZmqClient(f"child.{i}", addr, "parent", cfg=cfg) for i in range(3)]
        ups = [await c.start_in(tg) for c in clients]
        downs = sorted([await asyncio.wait_for(server.accept(), 5) for _ in clients], key=lambda c: c.peer)
        got = tg.create_task(receive_bulk(downs))
        await send_bulk(ups, PAYLOAD)
        assert bytes(await got) == PAYLOAD
        for c in clients:
            await c.close()
        await server.close()
