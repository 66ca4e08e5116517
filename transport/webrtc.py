"""WebRTC data-channel links (aiortc), for peers that cannot dial each other.

A `WebRtcTransport` dials a peer by node id through a *signalling* channel —
any existing `Channel`, normally the ZeroMQ link to the parent relay, which is
the rendezvous both peers reach — and answers the offers that arrive on its
own signalling channels. Each resulting `WebRtcChannel` is one ordered,
reliable data channel on its own peer connection (so each has its own SCTP
association and congestion window, which is what striping needs: several data
channels on one association share one window).

Signalling messages (headers only) are ``rtc_offer`` / ``rtc_answer`` /
``rtc_refused`` with ``to``, ``from``, ``id``, ``sdp`` and ``fingerprint``
(the sender's DTLS certificate fingerprint, announced apart from the SDP).
A rendezvous forwards them with `relay_signal`, which stamps ``from`` with the
peer id of the channel the message came in on, so a node cannot pose as
another. Before a remote description is applied its DTLS fingerprint must
equal the announced one (aiortc then holds the certificate to the SDP), else
the offer is refused and nothing is set up.

On the data channel, a `Channel` message travels as one or more *pieces*
(aiortc's limit is 256 KiB per data-channel message): a flags byte, then
bytes of ``[u32 header length][msgpack envelope][buffers...]``. Flag ``MORE``
says another piece of the same message follows; flag ``CONTROL`` marks a
self-contained control message (credit totals, heartbeats, close), which may
sit between the pieces of a data message. Flow control is `ChannelBase`'s
credit window plus aiortc's ``bufferedAmount``: a sender waits while more than
``buffered_low_bytes`` sit unsent in the association.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
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
from aurora.protocol import Heartbeat, PeerLiveness, PeerLost

log = structlog.get_logger("aurora.transport.webrtc")

PIECE_BYTES = 65535  # 64 KiB, the size every WebRTC stack accepts, less the flags byte; larger pieces
# only make aiortc's reassembly (which rescans a message's chunks on each arrival) slower
MORE = 0x01
CONTROL = 0x02
SIGNAL_KINDS = frozenset({"rtc_offer", "rtc_answer", "rtc_refused"})


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


def sdp_fingerprints(sdp: str) -> set[str]:
    """The DTLS fingerprints (``"sha-256 AB:CD..."``) an SDP announces."""
    desc = SessionDescription.parse(sdp)
    out: set[str] = set()
    for m in desc.media:
        if m.dtls is not None:
            out.update(f"{f.algorithm.lower()} {f.value.upper()}" for f in m.dtls.fingerprints)
    return out


def _pack(h: Mapping[str, Any]) -> bytes:
    return msgpack.packb(h, use_bin_type=True)  # type: ignore[no-any-return]


def encode_pieces(envelope: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...], *,
                  last_flags: int = 0, piece_bytes: int = PIECE_BYTES) -> list[bytes]:  # fmt: skip
    """Split one message into data-channel pieces (see the module docstring): every piece
    but the last is flagged ``MORE``; the last carries ``last_flags`` (``CONTROL`` for a
    control message, which always fits one piece)."""
    head = _pack(envelope)
    parts: list[memoryview] = [memoryview(struct.pack("<I", len(head)) + head)]
    parts += [memoryview(b).cast("B") for b in buffers]
    groups: list[list[memoryview]] = [[]]
    room = piece_bytes
    for p in parts:
        while p.nbytes:
            if room == 0:
                groups.append([])
                room = piece_bytes
            take = p[:room]
            groups[-1].append(take)
            room -= take.nbytes
            p = p[take.nbytes :]
    last = len(groups) - 1
    return [b"".join([bytes([last_flags if i == last else MORE]), *g]) for i, g in enumerate(groups)]


def decode_message(data: bytes | bytearray) -> tuple[dict[str, Any], list[memoryview]]:
    """Inverse of `encode_pieces` on the joined piece payloads; raises `ProtocolError`."""
    view = memoryview(data)
    try:
        (hlen,) = struct.unpack_from("<I", view, 0)
        env = msgpack.unpackb(view[4 : 4 + hlen], raw=False)
        sizes = env.get("z", [])
        bufs, off = [], 4 + hlen
        for n in sizes:
            bufs.append(view[off : off + int(n)])
            off += int(n)
    except (struct.error, ValueError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError) as e:
        raise ProtocolError(f"malformed data-channel message: {e}", remote=True) from e
    if off != len(view) or not isinstance(env, dict):
        raise ProtocolError("data-channel message length does not match its header", remote=True)
    return env, bufs


class WebRtcChannel(ChannelBase):
    """One data channel on its own peer connection (see the module docstring)."""

    def __init__(self, node_id: str, peer: str, pc: RTCPeerConnection, dc: RTCDataChannel, cfg: RtcConfig) -> None:
        super().__init__(peer, cfg.window, cfg.max_frame_bytes)
        self.pc = pc
        self.dc = dc
        self.cfg = cfg
        self._assembly = bytearray()
        self._room_ev = asyncio.Event()
        self._room_ev.set()
        self.live = PeerLiveness(node_id, incarnation=new_incarnation(), interval_s=cfg.heartbeat_s,
                                 jitter=0.1, suspect_after_s=cfg.suspect_after_s, lost_after_s=cfg.lost_after_s)  # fmt: skip
        dc.bufferedAmountLowThreshold = cfg.buffered_low_bytes
        dc.on("message", self._on_piece)
        dc.on("bufferedamountlow", self._room_ev.set)
        self._closing: str | None = None
        dc.on("close", lambda: self._shut(self._closing or "peer closed the data channel"))
        pc.on("connectionstatechange", self._on_state)

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        """Run the channel's heartbeats, and close the peer connection once the channel ends."""
        self.live.add_peer(self.peer, asyncio.get_running_loop().time())
        tg.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.closed:
                self.live.tick(loop.time())
                for _, hb in self.live.messages_to_send():
                    self._control({"k": "hb", "i": hb.incarnation, "s": hb.seq, "r": self._read})
                for ev in self.live.events():
                    if isinstance(ev, PeerLost):
                        log.warning("peer_lost", peer=self.peer, silent_s=round(ev.silent_s, 2))
                        self._shut(f"peer lost: silent for {ev.silent_s:.1f} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.cfg.heartbeat_s / 4):
                        await self._closed_ev.wait()
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
            self._check_open()

    async def _transmit(self, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> None:
        sizes = [len(b) if isinstance(b, bytes) else b.nbytes for b in buffers]
        for piece in encode_pieces({"k": "d", "h": dict(header), "z": sizes}, buffers):
            await self._room()
            self._put(piece)

    def _put(self, piece: bytes) -> None:
        if self.dc.readyState != "open":
            self._shut(f"data channel is {self.dc.readyState}")
            self._check_open()
        self.dc.send(piece)

    def _control(self, envelope: Mapping[str, Any]) -> None:
        if self.dc.readyState == "open":
            (piece,) = encode_pieces(envelope, (), last_flags=CONTROL)
            self.dc.send(piece)

    def _report_read(self, total: int) -> None:
        self._control({"k": "c", "n": total})

    async def _send_close(self, reason: str) -> None:
        self._closing = reason
        self._control({"k": "x", "reason": reason})
        if self.dc.bufferedAmount > 0:  # let the queued bytes and the close message leave first
            self._room_ev.clear()
            self.dc.bufferedAmountLowThreshold = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.close_grace_s):
                    await self._room_ev.wait()

    # -- receiving (aiortc callbacks)
    def _on_piece(self, piece: bytes | str) -> None:
        if isinstance(piece, str) or not piece:
            self._shut("peer sent a text or empty data-channel message")
            return
        flags = piece[0]
        now = asyncio.get_running_loop().time()
        self.live.heard(self.peer, now)  # any piece shows the peer alive, even mid-message
        try:
            if flags & CONTROL:
                env, _ = decode_message(piece[1:])
            else:
                self._assembly += memoryview(piece)[1:]
                if flags & MORE:
                    return
                data, self._assembly = self._assembly, bytearray()
                env, bufs = decode_message(data)
        except ProtocolError as e:
            log.warning("bad_frame", peer=self.peer, error=str(e))
            self._shut(f"peer sent a malformed message: {e}")
            return
        k = env.get("k")
        if k == "d":
            self._deliver(Message(env.get("h", {}), tuple(bufs)))
        elif k == "c":
            self._peer_read(int(env.get("n", 0)))
        elif k == "hb":
            self.live.on_heartbeat(Heartbeat(self.peer, int(env.get("i", 0)), int(env.get("s", 0))), now)
            self._peer_read(int(env.get("r", 0)))
        elif k == "x":
            self._shut(str(env.get("reason", "closed by peer")))

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._shut(f"peer connection {self.pc.connectionState}")

    def _on_shut(self) -> None:
        self._room_ev.set()


@dataclass
class _Pending:
    peer: str
    pc: RTCPeerConnection
    dc: RTCDataChannel
    answer: asyncio.Future[Mapping[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class WebRtcTransport:
    """Dials peers and answers offers; channels come out of `connect` and `accept`."""

    def __init__(self, node_id: str, cfg: RtcConfig | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg or RtcConfig()
        self._tg: asyncio.TaskGroup | None = None
        self._accepted: asyncio.Queue[WebRtcChannel] = asyncio.Queue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self.refused: list[str] = []
        self.rendezvous: dict[str, Channel] = {}

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        tune_sctp(self.cfg)
        self._tg = tg

    def _rtc_config(self) -> RTCConfiguration:
        servers = [RTCIceServer(list(s.urls), s.username, s.credential) for s in self.cfg.ice_servers]
        return RTCConfiguration(iceServers=servers)  # always explicit: [] means host candidates only

    def use_rendezvous(self, name: str, channel: Channel) -> None:
        """Make ``channel`` (to the rendezvous node ``name``) usable as an address in `connect`."""
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
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                await pc.setLocalDescription(await pc.createOffer())  # gathers every candidate
                sdp = pc.localDescription.sdp
                await via.send({"k": "rtc_offer", "to": peer, "from": self.node_id, "id": cid, "sdp": sdp,
                                "fingerprint": sorted(sdp_fingerprints(sdp))})  # fmt: skip
                ans = await pending.answer
                if ans["k"] == "rtc_refused":
                    raise TransportClosed(f"WebRTC peer {peer!r} refused the connection: {ans.get('reason')}")
                self._check_fingerprint(peer, ans)
                await pc.setRemoteDescription(RTCSessionDescription(str(ans["sdp"]), "answer"))
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
        ch = WebRtcChannel(self.node_id, peer, pc, dc, self.cfg)
        ch.start_in(self._tg)
        log.info("webrtc_connected", node=self.node_id, peer=peer, id=cid)
        return ch

    async def accept(self) -> WebRtcChannel:
        return await self._accepted.get()

    async def close(self) -> None:
        """Channels close themselves (and their peer connections) when their owners close them."""

    def on_signal(self, header: Mapping[str, Any], reply_via: Channel) -> None:
        """Feed one ``rtc_*`` message that arrived on a signalling channel."""
        assert self._tg is not None, "start_in() first"
        k = header.get("k")
        if k == "rtc_offer":
            self._tg.create_task(self._answer(dict(header), reply_via))
        elif k in ("rtc_answer", "rtc_refused"):
            p = self._pending.get(str(header.get("id")))
            if p is not None and not p.answer.done() and header.get("from") == p.peer:
                p.answer.set_result(header)

    async def serve_signalling(self, via: Channel) -> None:
        """The receive loop of a channel that carries only signalling: every message goes to
        `on_signal` until ``via`` closes. (A channel that carries other traffic too calls
        `on_signal` from its own loop.)"""
        with contextlib.suppress(TransportClosed):
            while True:
                self.on_signal((await via.recv()).header, via)

    def _check_fingerprint(self, peer: str, h: Mapping[str, Any]) -> None:
        announced = {str(f) for f in h.get("fingerprint", [])}
        in_sdp = sdp_fingerprints(str(h.get("sdp", "")))
        if not announced or announced != in_sdp:
            self.refused.append(peer)
            log.warning("webrtc_fingerprint_mismatch", node=self.node_id, peer=peer, announced=sorted(announced),
                        sdp=sorted(in_sdp))  # fmt: skip
            raise ProtocolError(f"WebRTC peer {peer!r}: DTLS fingerprint in the SDP differs from the one announced",
                                remote=True)  # fmt: skip

    async def _answer(self, offer: dict[str, Any], reply_via: Channel) -> None:
        peer, cid = str(offer.get("from")), str(offer.get("id"))
        try:
            self._check_fingerprint(peer, offer)
        except ProtocolError as e:
            await reply_via.send({"k": "rtc_refused", "to": peer, "from": self.node_id, "id": cid, "reason": str(e)})
            return
        pc = RTCPeerConnection(self._rtc_config())
        got: asyncio.Future[RTCDataChannel] = asyncio.get_running_loop().create_future()
        pc.on("datachannel", lambda dc: _settle(got, dc))
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                await pc.setRemoteDescription(RTCSessionDescription(str(offer["sdp"]), "offer"))
                await pc.setLocalDescription(await pc.createAnswer())
                sdp = pc.localDescription.sdp
                await reply_via.send({"k": "rtc_answer", "to": peer, "from": self.node_id, "id": cid, "sdp": sdp,
                                      "fingerprint": sorted(sdp_fingerprints(sdp))})  # fmt: skip
                dc = await got
                await _opened(dc)
        except (TimeoutError, TransportClosed) as e:
            log.warning("webrtc_answer_failed", node=self.node_id, peer=peer, error=str(e) or "timeout")
            await pc.close()
            return
        except BaseException:
            await pc.close()
            raise
        ch = WebRtcChannel(self.node_id, peer, pc, dc, self.cfg)
        assert self._tg is not None
        ch.start_in(self._tg)
        log.info("webrtc_accepted", node=self.node_id, peer=peer, id=cid)
        self._accepted.put_nowait(ch)


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


def relay_signal(header: Mapping[str, Any], came_from: str) -> tuple[str, dict[str, Any]]:
    """What a rendezvous does with an ``rtc_*`` message from the channel of peer
    ``came_from``: forward it to ``to``, with ``from`` stamped as the real sender."""
    if header.get("k") not in SIGNAL_KINDS or not isinstance(header.get("to"), str):
        raise ProtocolError(f"not a signalling message from {came_from!r}: {header.get('k')!r}", remote=True)
    return str(header["to"]), {**header, "from": came_from}


__all__ = ["IceServer", "RtcConfig", "WebRtcChannel", "WebRtcTransport", "relay_signal", "sdp_fingerprints"]
