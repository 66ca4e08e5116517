"""Bulk transfer: one payload striped over several channels, checked per frame, resumable.

`send_bulk` and `receive_bulk` take *exclusive* use of the channels they are
given for the duration of one transfer (they read them). The first channel
carries the control messages; every channel carries frames.

A transfer runs in rounds (state in `aurora.protocol.bulk`):

1. the sender sends ``bulk_offer`` (id, size, frame size, whole digest, round
   number, number of streams) on the control channel; the receiver answers at
   once with ``bulk_want`` (the missing frame ranges) or ``bulk_done``. An
   offer for an id the receiver already partly holds is the *resume*: only the
   missing frames are asked for;
2. the sender's stream tasks take missing frames from one shared queue — a
   slow stream takes fewer, a stalled one holds only the frame it is on — and
   each stream ends the round with ``bulk_end``;
3. once the receiver has every stream's ``bulk_end`` for the round it answers
   ``bulk_done`` or ``bulk_incomplete``; the sender starts another round until done.

A stream whose send fails or stalls past ``stall_s`` is dropped and the round
restarts on the others; with no stream left `send_bulk` raises
`TransportClosed`, and a later call with the same id (on new channels, to a
receiver keeping its `BulkReceiver`) resumes from what arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence

import structlog
from aurora.transport.base import Channel, Message

from aurora.errors import ProtocolError, TransportClosed
from aurora.events import BULK_FRAME_REJECTED, BULK_RESUMED, BULK_STREAM_DROPPED
from aurora.protocol import messages as wire
from aurora.protocol.bulk import (
    DEFAULT_FRAME_BYTES,
    BulkAssembly,
    BulkOffer,
    digest_of_frames,
    frame_digests,
    from_ranges,
)
from aurora.runtime.clock import Clock, LoopClock

log = structlog.get_logger("aurora.transport.bulk")


async def send_bulk(
    channels: Sequence[Channel],
    payload: bytes | memoryview,
    *,
    transfer_id: str | None = None,
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    answer_timeout_s: float = 60.0,
    stall_s: float = 60.0,
    clock: Clock | None = None,
) -> str:
    """Deliver ``payload`` (see the module docstring); returns the transfer id. Not
    cancellation-safe for the channels: a cancelled transfer may leave them mid-message. The
    timeouts run on ``clock`` (default: the event loop's)."""
    clock = clock or LoopClock()
    view = memoryview(payload).cast("B")
    digests = frame_digests(view, frame_bytes)  # the only pass over the bytes on this side
    offer = BulkOffer(transfer_id or secrets.token_hex(8), view.nbytes, frame_bytes, digest_of_frames(digests))
    live = [c for c in channels if not c.closed]
    rnd = 0
    while True:
        rnd += 1
        if not live:
            raise TransportClosed(f"bulk {offer.id!r}: every stream closed ({offer.size} bytes not confirmed)")
        ctl = live[0]
        offer_msg = wire.BulkOffer(
            id=offer.id,
            size=offer.size,
            frame_bytes=offer.frame_bytes,
            digest=offer.digest,
            round=rnd,
            streams=len(live),
        )
        reply = await _exchange(ctl, offer.id, answer_timeout_s, clock, offer_msg)
        if reply is not None and not isinstance(reply, wire.BulkDone):
            want = from_ranges(reply.missing if isinstance(reply, wire.BulkWant) else [], offer.frames)
            survivors = await _stripe(live, view, offer, digests, want, rnd, stall_s, clock)
            if len(survivors) < len(live):  # the receiver waits for every stream's end: start over
                live = survivors
                continue
            reply = await _exchange(ctl, offer.id, answer_timeout_s, clock)
        if reply is None:
            live.remove(ctl)
        elif isinstance(reply, wire.BulkDone):
            return offer.id


_Reply = wire.BulkWant | wire.BulkDone | wire.BulkIncomplete


async def _exchange(
    ctl: Channel, tid: str, timeout_s: float, clock: Clock, msg: wire.BulkOffer | None = None
) -> _Reply | None:
    """Send ``msg`` (if any) and wait for the receiver's answer; None if ``ctl`` failed or fell silent."""
    try:
        if msg is not None:
            await ctl.send(msg)
        return await _reply(ctl, tid, timeout_s, clock)
    except (TransportClosed, TimeoutError):
        return None


async def _reply(ctl: Channel, tid: str, timeout_s: float, clock: Clock) -> _Reply:
    async with clock.timeout(timeout_s):
        while True:
            m = (await ctl.recv()).msg
            if isinstance(m, wire.BulkWant | wire.BulkDone | wire.BulkIncomplete) and m.id == tid:
                return m


async def _stripe(
    live: list[Channel],
    view: memoryview,
    offer: BulkOffer,
    digests: list[int],
    want: list[int],
    rnd: int,
    stall_s: float,
    clock: Clock,
) -> list[Channel]:
    """Send the wanted frames over every live stream; returns the streams still usable."""
    queue = list(reversed(want))
    dead: list[Channel] = []

    async def stream(ch: Channel) -> None:
        try:
            while queue:
                i = queue.pop()
                start, end = offer.span(i)
                frame = view[start:end]
                try:
                    async with clock.timeout(stall_s):
                        await ch.send(wire.BulkFrame(id=offer.id, i=i, d=digests[i]), frame)
                except (TransportClosed, TimeoutError):
                    queue.append(i)  # another stream takes it
                    raise
            await ch.send(wire.BulkEnd(id=offer.id, round=rnd))
        except (TransportClosed, TimeoutError) as e:
            dead.append(ch)
            log.warning(BULK_STREAM_DROPPED, transfer=offer.id, peer=ch.peer, error=str(e) or "stalled")

    async with asyncio.TaskGroup() as tg:
        for ch in live:
            tg.create_task(stream(ch))
    return [c for c in live if c not in dead]  # frames left in the queue go in the next round


class BulkReceiver:
    """A receiver's transfers by id; keep it across connections so transfers can resume.

    Holds at most ``max_transfers`` incomplete transfers (the oldest is dropped first)."""

    def __init__(self, max_transfers: int = 4) -> None:
        self.max_transfers = max_transfers
        self.partial: dict[str, BulkAssembly] = {}
        self._round: dict[str, tuple[int, int, int]] = {}  # id -> (round, streams, ends seen)
        self._ctl: dict[str, Channel] = {}  # id -> the channel its latest offer came on

    async def handle(self, ch: Channel, msg: Message) -> memoryview | None:
        """Feed one message that arrived on ``ch``. Returns the payload when a transfer completes. Raises `ProtocolError` for a malformed
        offer; a bad frame is logged and left missing (it will be asked for again)."""
        m = msg.msg
        if isinstance(m, wire.BulkOffer):
            return await self._offer(ch, m)
        if not isinstance(m, wire.BulkFrame | wire.BulkEnd):
            return None
        asm = self.partial.get(m.id)
        if asm is None:
            return None
        if isinstance(m, wire.BulkFrame):
            try:
                asm.add(m.i, msg.buffers[0], m.d)
            except ProtocolError as e:
                log.warning(BULK_FRAME_REJECTED, transfer=m.id, peer=ch.peer, error=str(e))
        else:
            rnd, streams, ends = self._round.get(m.id, (0, 0, 0))
            if m.round == rnd:
                ends += 1
                self._round[m.id] = (rnd, streams, ends)
                if ends >= streams:
                    ctl = self._ctl[m.id]
                    if asm.complete:
                        return await self._finish(ctl, asm)
                    await ctl.send(wire.BulkIncomplete(id=m.id))
        return None

    async def _offer(self, ch: Channel, h: wire.BulkOffer) -> memoryview | None:
        offer = BulkOffer(h.id, h.size, h.frame_bytes, h.digest)
        asm = self.partial.get(offer.id)
        if asm is None or asm.offer != offer:
            while len(self.partial) >= self.max_transfers:
                oldest = next(iter(self.partial))
                del self.partial[oldest]
                self._round.pop(oldest, None)
                self._ctl.pop(oldest, None)
            asm = self.partial[offer.id] = BulkAssembly(offer)
        elif asm.held_frames:
            log.info(BULK_RESUMED, transfer=offer.id, held_frames=asm.held_frames, frames=offer.frames)
        self._round[offer.id] = (h.round, h.streams, 0)
        self._ctl[offer.id] = ch
        if asm.complete:
            return await self._finish(ch, asm)
        await ch.send(wire.BulkWant(id=offer.id, missing=asm.missing()))
        return None

    async def _finish(self, ctl: Channel, asm: BulkAssembly) -> memoryview:
        data = asm.payload()
        del self.partial[asm.offer.id]
        self._round.pop(asm.offer.id, None)
        self._ctl.pop(asm.offer.id, None)
        await ctl.send(wire.BulkDone(id=asm.offer.id))
        return data


async def receive_bulk(channels: Sequence[Channel], receiver: BulkReceiver | None = None) -> memoryview:
    """Read ``channels`` until one transfer completes; returns its payload. Raises `TransportClosed` if every channel closes first."""
    receiver = receiver or BulkReceiver()
    inbox: asyncio.Queue[tuple[Channel, Message | None]] = asyncio.Queue()

    async def read(ch: Channel) -> None:
        try:
            while True:
                inbox.put_nowait((ch, await ch.recv()))
        except TransportClosed:
            inbox.put_nowait((ch, None))

    open_ = len(channels)
    async with asyncio.TaskGroup() as tg:
        readers = [tg.create_task(read(ch)) for ch in channels]
        try:
            while open_:
                ch, msg = await inbox.get()
                if msg is None:
                    open_ -= 1
                    continue
                with contextlib.suppress(TransportClosed):
                    done = await receiver.handle(ch, msg)
                    if done is not None:
                        return done
        finally:
            for r in readers:
                r.cancel()
    raise TransportClosed("every bulk stream closed before the transfer completed")
