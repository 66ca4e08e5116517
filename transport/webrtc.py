"""WebRTC data-channel links (aiortc), for peers that cannot dial each other.

A `WebRtcTransport` dials a peer by node id through a *signalling* channel —
any existing `Channel`, normally the ZeroMQ link to the parent relay, which is
the rendezvous both peers reach — and answers the offers that arrive on its
own signalling channels. Each resulting `WebRtcChannel` is one ordered,
reliable data channel on its own peer connection (so each has its own SCTP
association and congestion window, which is what striping needs: several data
channels on one association share one window).

Signalling messages are `RtcOffer` / `RtcAnswer` / `RtcRefused`
(`aurora.protocol.messages`) with ``to``, ``from``, ``id``, ``sdp`` and
``fingerprint`` (the sender's DTLS certificate fingerprint, announced apart from
the SDP). The rendezvous — the parent, answering its child — takes them with
`serve_signalling(stamp=True)`, which stamps ``from`` with the peer id of the channel
the message came in on, so a node cannot pose as another. Before a remote description is applied its DTLS fingerprint must equal
the announced one (aiortc then holds the certificate to the SDP), else the offer
is refused and nothing is set up. An offer that cannot be parsed or answered is
refused and logged; nothing a peer signals can end the transport's task group.

On the data channel, a `Channel` message travels as one or more *pieces*
(aiortc's limit is 256 KiB per data-channel message): a flags byte, then bytes
of ``[u32 link frame length][link frame][header][buffers...]`` (the link frame,
a `LinkData`, gives the sizes of the header and each buffer). Flag ``MORE`` says
another piece of the same message follows; flag ``BULK`` marks every piece of a
bulk-lane message, and flag ``CONTROL`` a self-contained control frame (credit
totals, heartbeats, close). One message of each lane is on the wire at a time
(a lock per lane), and the receiver reassembles each lane apart: a control-lane
message (a ``Have``) may go out between the pieces of a bulk one, so it never
waits behind the bulk window, and a control frame may sit anywhere. A message that grows past the channel's
``max_frame_bytes`` while it is reassembled closes the channel. What the frames
mean — credit, heartbeats, close, faults — is the channel's link machine
(`aurora.protocol.link.Link`, as under ZeroMQ); each channel's task ticks it at
its deadlines. Flow control is the link's credit window plus aiortc's
``bufferedAmount``: a sender waits while more than ``buffered_low_bytes`` sit
unsent in the association.

Loopback addresses are skipped by aioice; `aurora.testing.webrtc` patches the
host address list for in-process tests, and the netns tests use real
addresses inside namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc import rtcsctptransport as _sctp
from aiortc.sdp import SessionDescription
from aurora.transport.base import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_WINDOW,
    Channel,
    Message,
    check_timings,
    new_incarnation,
)
from aurora.transport.channel import ChannelBase

from aurora.errors import ProtocolError, TransportClosed
from aurora.events import WEBRTC_ACCEPTED, WEBRTC_FINGERPRINT_MISMATCH
from aurora.protocol.link import DEFAULT_BULK_BYTES, LinkTimings
from aurora.protocol.messages import (
    MAX_REASON_CHARS,
    AppMessage,
    BadMessage,
    Lane,
    LinkBeat,
    LinkClose,
    LinkCredit,
    LinkData,
    LinkFrame,
    RtcAnswer,
    RtcOffer,
    RtcRefused,
    Signal,
    decode_app,
    decode_link,
    encode_link,
)
from aurora.runtime.clock import Clock, LoopClock

log = structlog.get_logger("aurora.transport.webrtc")

PIECE_BYTES = 65535  # 64 KiB, the size every WebRTC stack accepts, less the flags byte; larger pieces
# only make aiortc's reassembly (which rescans a message's chunks on each arrival) slower
MORE = 0x01
CONTROL = 0x02
BULK = 0x04
MAX_LINK_FRAME = 4096
MAX_ANSWERS_PER_PEER = 4
"""Offers being answered plus channels open, per peer; more offers are refused (each costs a peer connection,
ICE gathering and an SCTP association)."""


@dataclass(frozen=True, slots=True)
class IceServer:
    """A STUN or TURN server from the topology."""

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RtcConfig:
    ice_servers: tuple[IceServer, ...] = ()
    """STUN/TURN servers; none means host candidates only (aiortc's default would reach a public server)."""
    window: int = DEFAULT_WINDOW
    bulk_bytes: int = DEFAULT_BULK_BYTES
    """Bulk-lane bytes a receiver lets a sender have unread (docs/transport.md)."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    buffered_low_bytes: int = 1 << 20
    """A sender waits while more than this many bytes sit unsent in the SCTP association."""
    heartbeat_s: float = 0.5
    suspect_after_s: float = 1.5
    lost_after_s: float = 3.0
    connect_timeout_s: float = 30.0
    close_grace_s: float = 2.0
    """How long `close` waits for queued bytes (and the close message) to leave."""
    sctp_rto_min_s: float | None = None
    """Minimum SCTP retransmission timeout; None keeps aiortc's 1 s (RFC 4960). Lowering it to
    TCP's 0.2 s was measured *slower* on the emulated 50 ms / 0.1 % loss link (aiortc drops
    its window to one packet on every timeout, so spurious timeouts cost more than they save);
    `aurora bench transport` prints both."""

    def __post_init__(self) -> None:
        check_timings(self.heartbeat_s, self.suspect_after_s, self.lost_after_s)


def tune_sctp(cfg: RtcConfig) -> None:
    """Apply what aiortc lets one tune. Its SCTP reads these module constants at call time,
    so this affects every association in the process (set once, at transport start)."""
    if cfg.sctp_rto_min_s is not None:
        _sctp.SCTP_RTO_MIN = cfg.sctp_rto_min_s  # type: ignore[assignment]
    _bound_reassembly()


REASSEMBLY_LIMIT_BYTES = 1 << 21
"""What aiortc may hold of messages still being reassembled, per stream. Aurora never sends a data-channel
message above `PIECE_BYTES`, and a well-behaved peer has at most a receive window (1 MiB in aiortc) in
flight; aiortc itself keeps any number of fragments of a message that never ends, and rescans them all
on every arrival (quadratic). Past the limit the stream's pending fragments are dropped, and the stream
goes silent, so the channel's heartbeats stop and it closes as lost."""


def _bound_reassembly() -> None:
    """Patch aiortc's `InboundStream` once: reassembly bounded by `REASSEMBLY_LIMIT_BYTES`."""
    stream = _sctp.InboundStream
    if getattr(stream, "_aurora_bounded", False):
        return
    add, pop = stream.add_chunk, stream.pop_messages

    def add_chunk(self: Any, chunk: Any) -> None:
        if getattr(self, "_aurora_poisoned", False):
            return
        pending = getattr(self, "_aurora_bytes", 0) + len(chunk.user_data)
        if pending > REASSEMBLY_LIMIT_BYTES:
            self.reassembly.clear()
            self._aurora_poisoned = True
            log.warning("webrtc_reassembly_limit", limit_bytes=REASSEMBLY_LIMIT_BYTES)
            return
        self._aurora_bytes = pending
        add(self, chunk)

    def pop_messages(self: Any) -> Any:
        yield from pop(self)
        self._aurora_bytes = sum(len(c.user_data) for c in self.reassembly)

    stream.add_chunk = add_chunk  # type: ignore[method-assign]
    stream.pop_messages = pop_messages  # type: ignore[method-assign]
    stream._aurora_bounded = True  # type: ignore[attr-defined]


def sdp_fingerprints(sdp: str) -> set[str]:
    """The DTLS fingerprints (``"sha-256 AB:CD..."``) an SDP announces; raises `ProtocolError` for
    text that is not an SDP."""
    try:
        desc = SessionDescription.parse(sdp)
        out: set[str] = set()
        for m in desc.media:
            if m.dtls is not None:
                out.update(f"{f.algorithm.lower()} {f.value.upper()}" for f in m.dtls.fingerprints)
    except Exception as e:  # noqa: BLE001  (aiortc's parser raises whatever it meets on garbage)
        raise ProtocolError(f"not a session description: {e!r}"[:300], remote=True) from None
    return out


def encode_pieces(
    frame: LinkFrame,
    parts: tuple[bytes | memoryview, ...] = (),
    *,
    last_flags: int = 0,
    flags: int = 0,
    piece_bytes: int = PIECE_BYTES,
) -> list[bytes]:
    """Split one link frame and what follows it into data-channel pieces (see the module docstring):
    every piece carries ``flags`` (``BULK`` for a bulk-lane message), every piece but the last is also
    flagged ``MORE``; the last carries ``last_flags`` (``CONTROL`` for a control frame, which always
    fits one piece)."""
    head = encode_link(frame)
    views: list[memoryview] = [memoryview(struct.pack("<I", len(head)) + head)]
    views += [memoryview(b).cast("B") for b in parts]
    groups: list[list[memoryview]] = [[]]
    room = piece_bytes
    for p in views:
        while p.nbytes:
            if room == 0:
                groups.append([])
                room = piece_bytes
            take = p[:room]
            groups[-1].append(take)
            room -= take.nbytes
            p = p[take.nbytes :]
    last = len(groups) - 1
    return [b"".join([bytes([flags | (last_flags if i == last else MORE)]), *g]) for i, g in enumerate(groups)]


def encode_message(header: bytes, buffers: tuple[bytes | memoryview, ...], lane: Lane = Lane.CONTROL) -> list[bytes]:
    """The pieces of one data message (its encoded header and buffers) of ``lane``."""
    sizes = [len(header)] + [len(b) if isinstance(b, bytes) else b.nbytes for b in buffers]
    return encode_pieces(LinkData(z=sizes), (header, *buffers), flags=BULK if lane is Lane.BULK else 0)


def decode_frame(data: bytes | bytearray) -> tuple[LinkFrame, AppMessage | None, list[memoryview]]:
    """Inverse of `encode_pieces` on the joined piece payloads: the link frame and, for data, the
    application message and its buffers; raises `BadMessage`."""
    view = memoryview(data)
    if len(view) < 4:
        raise BadMessage("data-channel message shorter than its length prefix")
    (hlen,) = struct.unpack_from("<I", view, 0)
    if hlen > MAX_LINK_FRAME or 4 + hlen > len(view):
        raise BadMessage(f"data-channel link frame of {hlen} bytes does not fit")
    frame = decode_link(view[4 : 4 + hlen])
    rest = view[4 + hlen :]
    if not isinstance(frame, LinkData):
        if len(rest):
            raise BadMessage("a control frame with bytes after it")
        return frame, None, []
    sizes = frame.z or []
    if not sizes or sum(sizes) != len(rest):
        raise BadMessage("data-channel message length does not match its sizes")
    parts, off = [], 0
    for n in sizes:
        parts.append(rest[off : off + n])
        off += n
    return frame, decode_app(parts[0], parts[1:]), parts[1:]


class Reassembly:
    """Joins a channel's pieces back into whole frames (see the module docstring): each lane's data
    message apart, a ``CONTROL`` piece on its own. Holds at most ``limit`` bytes per lane."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts = {Lane.CONTROL: bytearray(), Lane.BULK: bytearray()}

    def add(self, piece: bytes) -> bytes | bytearray | None:
        """One non-empty piece in: the payload of the frame it completes, or None while one is still
        open; raises `OverflowError` once a lane's message grows past the limit."""
        flags = piece[0]
        if flags & CONTROL:
            return piece[1:]
        lane = Lane.BULK if flags & BULK else Lane.CONTROL
        parts = self._parts[lane]
        parts += memoryview(piece)[1:]
        if len(parts) > self.limit:
            parts.clear()
            raise OverflowError(lane)
        if flags & MORE:
            return None
        self._parts[lane] = bytearray()
        return parts


class WebRtcChannel(ChannelBase):
    """One data channel on its own peer connection (see the module docstring): a `ChannelBase`
    whose frames travel as pieces."""

    def __init__(
        self,
        peer: str,
        pc: RTCPeerConnection,
        dc: RTCDataChannel,
        cfg: RtcConfig,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(
            peer,
            cfg.window,
            cfg.max_frame_bytes,
            bulk_bytes=cfg.bulk_bytes,
            timings=LinkTimings(cfg.heartbeat_s, cfg.suspect_after_s, cfg.lost_after_s),
            incarnation=new_incarnation(),
            clock=clock,
        )
        self.pc = pc
        self.dc = dc
        self.cfg = cfg
        self._assembly = Reassembly(cfg.max_frame_bytes + MAX_LINK_FRAME + PIECE_BYTES)
        self._sending = {Lane.CONTROL: asyncio.Lock(), Lane.BULK: asyncio.Lock()}
        """Held while a message of the lane is put on the wire piece by piece."""
        self._room_ev = asyncio.Event()
        self._room_ev.set()
        dc.bufferedAmountLowThreshold = cfg.buffered_low_bytes
        dc.on("message", self._on_piece)
        dc.on("bufferedamountlow", self._room_ev.set)
        self._on_close: list[Callable[[], None]] = []
        dc.on("close", lambda: self._shut(self.link.closing or "peer closed the data channel"))
        pc.on("connectionstatechange", self._on_state)

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        """Run the channel's heartbeats, and close the peer connection once the channel ends."""
        tg.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.run_link()
        finally:
            await self.pc.close()

    # -- sending
    async def _room(self) -> None:
        while self.dc.bufferedAmount > self.cfg.buffered_low_bytes:
            self._room_ev.clear()
            async with asyncio.TaskGroup() as tg:
                room = tg.create_task(self._room_ev.wait())
                closed = tg.create_task(self._closed_ev.wait())
                await asyncio.wait({room, closed}, return_when=asyncio.FIRST_COMPLETED)
                room.cancel()
                closed.cancel()
            self.link.ensure_open()

    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...], lane: Lane) -> None:
        async with self._sending[lane]:  # two messages of one lane never interleave their pieces
            for piece in encode_message(header, buffers, lane):
                await self._room()
                self._put(piece)

    def _put(self, piece: bytes) -> None:
        if self.dc.readyState != "open":
            self._shut(f"data channel is {self.dc.readyState}")
            self.link.ensure_open()
        self.dc.send(piece)

    def _send_control(self, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        if self.dc.readyState == "open":
            (piece,) = encode_pieces(frame, (), last_flags=CONTROL)
            self.dc.send(piece)

    async def _flush_close(self) -> None:
        if self.dc.bufferedAmount > 0:  # let the queued bytes and the close message leave first
            self._room_ev.clear()
            self.dc.bufferedAmountLowThreshold = 0
            await self.clock.wait_until(self._room_ev, self.clock.now() + self.cfg.close_grace_s)

    # -- receiving (aiortc callbacks)
    def _on_piece(self, piece: bytes | str) -> None:
        if isinstance(piece, str) or not piece:
            self._shut("peer sent a text or empty data-channel message")
            return
        self._heard()  # any piece shows the peer alive, even mid-message
        try:
            data = self._assembly.add(piece)
        except OverflowError:
            self._shut(f"peer sent a message larger than max_frame_bytes={self.max_frame_bytes}")
            return
        if data is None:
            return
        try:
            frame, msg, bufs = decode_frame(data)
        except BadMessage as e:
            self.fault(e.reason)
            return
        self._received(frame, None if msg is None else Message(msg, tuple(bufs)))

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._shut(f"peer connection {self.pc.connectionState}")

    def _on_shut(self) -> None:
        self._room_ev.set()
        for f in self._on_close:
            f()
        self._on_close.clear()

    def on_close(self, f: Callable[[], None]) -> None:
        """Call ``f`` once when the channel closes."""
        self._on_close.append(f)


@dataclass
class _Pending:
    peer: str
    pc: RTCPeerConnection
    dc: RTCDataChannel
    answer: asyncio.Future[RtcAnswer | RtcRefused] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class WebRtcTransport:
    """Dials peers and answers offers; channels come out of `connect` and `accept`. ``clock``: what
    its channels' links and its connect timeouts read time from (the node's)."""

    def __init__(
        self, node_id: str, cfg: RtcConfig | None = None, *, accepting: bool = True, clock: Clock | None = None
    ) -> None:
        self.node_id = node_id
        self.cfg = cfg or RtcConfig()
        self.clock: Clock = clock or LoopClock()
        self._tg: asyncio.TaskGroup | None = None
        self._accepted: asyncio.Queue[WebRtcChannel] = asyncio.Queue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self.refused: list[str] = []
        self.rendezvous: dict[str, Channel] = {}
        self._answering: dict[str, int] = {}
        """Offers being answered, per peer (with `_open`, bounded by `MAX_ANSWERS_PER_PEER`)."""
        self._open: dict[str, int] = {}
        """Channels accepted and still open, per peer."""
        self.accepting = accepting
        """Whether this node takes WebRTC children (answers offers) at all."""

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Own the transport's tasks in ``tg``. WebRTC listens nowhere itself (offers come through a
        signalling channel): returns ""."""
        tune_sctp(self.cfg)
        self._tg = tg
        return ""

    def _rtc_config(self) -> RTCConfiguration:
        servers = [RTCIceServer(list(s.urls), s.username, s.credential) for s in self.cfg.ice_servers]
        return RTCConfiguration(iceServers=servers)  # always explicit: [] means host candidates only

    def use_rendezvous(self, name: str, channel: Channel) -> None:
        """Make ``channel`` (to the rendezvous node ``name``) usable as an address in `connect`.
        (`connect` by address is the `Transport` contract; a node opens its parent's signalling
        channel per attach and dials with `connect_via`, the tests through a named rendezvous.)"""
        self.rendezvous[name] = channel

    async def connect(self, peer: str, address: str) -> WebRtcChannel:
        """`Transport.connect`: ``address`` is the node id of a rendezvous registered with
        `use_rendezvous`."""
        via = self.rendezvous.get(address)
        if via is None or via.closed:
            raise TransportClosed(f"no open signalling channel to rendezvous {address!r} for reaching {peer!r}")
        return await self.connect_via(peer, via)

    async def connect_via(self, peer: str, via: Channel) -> WebRtcChannel:
        """Open a channel to ``peer`` with signalling over ``via``. The caller's receive loop
        must pass ``rtc_*`` messages arriving on ``via`` to `on_signal`. Raises
        `TransportClosed` if the peer refuses or does not answer in time."""
        assert self._tg is not None, "start_in() first"
        cid = f"{self.node_id}/{next(self._ids)}/{secrets.token_hex(4)}"
        pc = RTCPeerConnection(self._rtc_config())
        dc = pc.createDataChannel("aurora", ordered=True)
        pending = _Pending(peer, pc, dc)
        self._pending[cid] = pending
        try:
            async with self.clock.timeout(self.cfg.connect_timeout_s):
                await pc.setLocalDescription(await pc.createOffer())  # gathers every candidate
                sdp = pc.localDescription.sdp
                await via.send(
                    RtcOffer(to=peer, sender=self.node_id, id=cid, sdp=sdp, fingerprint=sorted(sdp_fingerprints(sdp)))
                )
                ans = await pending.answer
                if isinstance(ans, RtcRefused):
                    raise TransportClosed(f"WebRTC peer {peer!r} refused the connection: {ans.reason}")
                self._check_fingerprint(peer, ans.fingerprint, ans.sdp)
                await _describe(pc, ans.sdp, "answer", peer)
                await _opened(dc)
        except (TimeoutError, TransportClosed, ProtocolError) as e:
            await pc.close()
            if isinstance(e, TimeoutError):
                raise TransportClosed(
                    f"WebRTC connection to {peer!r} timed out after {self.cfg.connect_timeout_s} s"
                ) from e
            raise
        except BaseException:
            await pc.close()
            raise
        finally:
            del self._pending[cid]
        ch = WebRtcChannel(peer, pc, dc, self.cfg, self.clock)
        ch.start_in(self._tg)
        log.info("webrtc_connected", node=self.node_id, peer=peer, id=cid)
        return ch

    async def accept(self) -> WebRtcChannel:
        return await self._accepted.get()

    def _closed_one(self, peer: str) -> None:
        left = self._open.get(peer, 1) - 1
        if left > 0:
            self._open[peer] = left
        else:
            self._open.pop(peer, None)

    async def close(self) -> None:
        """Channels close themselves (and their peer connections) when their owners close them."""

    def on_signal(self, msg: Signal, reply_via: Channel) -> None:
        """Feed one signalling message that arrived on a signalling channel (its ``sender`` already
        stamped by the rendezvous as the channel's peer)."""
        assert self._tg is not None, "start_in() first"
        if isinstance(msg, RtcOffer):
            if not self.accepting:
                reply_via.fault("a WebRTC offer to a node that takes no WebRTC children")
                return
            busy = self._answering.get(msg.sender, 0) + self._open.get(msg.sender, 0)
            if busy >= MAX_ANSWERS_PER_PEER:
                reply_via.fault(f"more than {MAX_ANSWERS_PER_PEER} WebRTC connections at once")
                return
            self._answering[msg.sender] = busy + 1
            self._tg.create_task(self._answer(msg, reply_via))
        else:
            p = self._pending.get(msg.id)
            if p is not None and not p.answer.done() and msg.sender == p.peer:
                p.answer.set_result(msg)

    async def serve_signalling(self, via: Channel, *, stamp: bool = False) -> None:
        """The receive loop of a channel that carries only signalling: every signalling message goes
        to `on_signal` until ``via`` closes; anything else is the peer's fault. ``stamp``: ``via``'s
        peer is the rendezvous *and* the only peer on it (a parent answering its child), so ``from``
        is set to it, whatever the message says. (A channel that carries other traffic too calls
        `on_signal` from its own loop.)"""
        with contextlib.suppress(TransportClosed):
            while True:
                msg = (await via.recv()).msg
                if isinstance(msg, RtcOffer | RtcAnswer | RtcRefused):
                    self.on_signal(msgspec.structs.replace(msg, sender=via.peer) if stamp else msg, via)
                else:
                    via.fault(f"a {type(msg).__name__} on a signalling channel")

    def _check_fingerprint(self, peer: str, announced_list: list[str], sdp: str) -> None:
        announced = set(announced_list)
        in_sdp = sdp_fingerprints(sdp)
        if not announced or announced != in_sdp:
            if len(self.refused) < 1000:
                self.refused.append(peer)
            log.warning(
                WEBRTC_FINGERPRINT_MISMATCH,
                node=self.node_id,
                peer=peer,
                announced=sorted(announced)[:4],
                sdp=sorted(in_sdp)[:4],
            )
            raise ProtocolError(
                f"WebRTC peer {peer!r}: DTLS fingerprint in the SDP differs from the one announced", remote=True
            )

    async def _answer(self, offer: RtcOffer, reply_via: Channel) -> None:
        """Answer one offer. Runs in the transport's task group, so nothing here may raise: an offer
        that cannot be answered is refused (or dropped) and logged."""
        peer, cid = offer.sender, offer.id
        try:
            await self._answer_or_refuse(offer, reply_via)
        except (TransportClosed, TimeoutError) as e:
            log.warning("webrtc_answer_failed", node=self.node_id, peer=peer, id=cid, error=str(e) or "timeout")
        except Exception as e:  # noqa: BLE001  (a peer's offer may break aiortc in any way; never the node)
            log.warning("webrtc_answer_failed", node=self.node_id, peer=peer, id=cid, error=repr(e)[:300])
        finally:
            left = self._answering.get(peer, 1) - 1
            if left > 0:
                self._answering[peer] = left
            else:
                self._answering.pop(peer, None)

    async def _answer_or_refuse(self, offer: RtcOffer, reply_via: Channel) -> None:
        peer, cid = offer.sender, offer.id
        try:
            self._check_fingerprint(peer, offer.fingerprint, offer.sdp)
        except ProtocolError as e:
            await reply_via.send(RtcRefused(to=peer, sender=self.node_id, id=cid, reason=str(e)[:MAX_REASON_CHARS]))
            return
        pc = RTCPeerConnection(self._rtc_config())
        got: asyncio.Future[RTCDataChannel] = asyncio.get_running_loop().create_future()
        pc.on("datachannel", lambda dc: _settle(got, dc))
        try:
            async with self.clock.timeout(self.cfg.connect_timeout_s):
                await _describe(pc, offer.sdp, "offer", peer)
                await pc.setLocalDescription(await pc.createAnswer())
                sdp = pc.localDescription.sdp
                await reply_via.send(
                    RtcAnswer(to=peer, sender=self.node_id, id=cid, sdp=sdp, fingerprint=sorted(sdp_fingerprints(sdp)))
                )
                dc = await got
                await _opened(dc)
        except BaseException:
            await pc.close()
            raise
        ch = WebRtcChannel(peer, pc, dc, self.cfg, self.clock)
        self._open[peer] = self._open.get(peer, 0) + 1
        ch.on_close(lambda: self._closed_one(peer))
        assert self._tg is not None
        ch.start_in(self._tg)
        log.info(WEBRTC_ACCEPTED, node=self.node_id, peer=peer, id=cid)
        self._accepted.put_nowait(ch)


async def _describe(pc: RTCPeerConnection, sdp: str, kind: str, peer: str) -> None:
    """Apply a peer's session description; what aiortc cannot take is the peer's `ProtocolError`."""
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp, kind))
    except (TransportClosed, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001  (aiortc raises whatever a malformed description makes it meet)
        raise ProtocolError(f"WebRTC peer {peer!r} sent an unusable {kind}: {e!r}"[:300], remote=True) from None


async def _opened(dc: RTCDataChannel) -> None:
    if dc.readyState == "open":
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    dc.on("open", lambda: _settle(fut, None))
    dc.on("close", lambda: _settle(fut, TransportClosed("data channel closed while opening")))
    await fut


def _settle(fut: asyncio.Future[Any], value: object) -> None:
    if not fut.done():
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)


__all__ = ["IceServer", "RtcConfig", "WebRtcChannel", "WebRtcTransport", "sdp_fingerprints"]
