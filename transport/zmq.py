"""ZeroMQ links: the parent binds a ROUTER (`ZmqServer`), children dial a DEALER (`ZmqClient`).

Children always dial out (what NAT allows). Each link carries `Channel`
semantics (`aurora.transport.base`) on top of ZeroMQ's ordered delivery:

* frames: ``[header(msgpack), *buffers]`` (the ROUTER adds the peer identity in
  front); header ``k`` is ``d`` data, ``c`` flow-control credit, ``hb``
  heartbeat, ``x`` close. Buffers go out with ``copy=False``.
* flow control: `ChannelBase`'s cumulative credit window; the read total goes
  in ``c`` frames and rides on every heartbeat; a peer that overruns the
  window is cut off.
* liveness: `PeerLiveness` drives heartbeats both ways; a silent peer closes
  its channel ("peer lost"); a peer that comes back with a new incarnation
  gets a fresh channel (the old one closes with "peer restarted"), which
  `accept` hands out — on either side, since a restarted server is a new
  incarnation too (incarnations are start times).
* ``linger=0`` everywhere, so closing never hangs; DEALERs reconnect by
  themselves with exponential backoff (``reconnect_ivl`` .. ``reconnect_ivl_max``).
* CurveZMQ when keys are given: the server's secret key, and the set of client
  public keys it accepts; any other client is refused by ZAP and logged.
* frames above ``max_frame_bytes`` are refused at `send` (`FrameTooLarge`) and
  by the receiving socket (``ZMQ_MAXMSGSIZE``), never buffered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio
from aurora.transport.base import DEFAULT_MAX_FRAME_BYTES, DEFAULT_WINDOW, Message, check_timings, new_incarnation
from aurora.transport.channel import ChannelBase
from zmq.auth.asyncio import AsyncioAuthenticator

from aurora.errors import ConfigError, ProtocolError, TransportClosed
from aurora.protocol import Heartbeat, PeerLiveness, PeerLost, PeerRejoined

log = structlog.get_logger("aurora.transport.zmq")


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CurveZMQ key pair, Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        pub, sec = zmq.curve_keypair()
        return cls(pub, sec)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    window: int = DEFAULT_WINDOW
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    hwm: int = 1000
    heartbeat_s: float = 0.5
    suspect_after_s: float = 1.5
    lost_after_s: float = 3.0
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5000

    def __post_init__(self) -> None:
        check_timings(self.heartbeat_s, self.suspect_after_s, self.lost_after_s)


def _pack(h: Mapping[str, Any]) -> bytes:
    return msgpack.packb(h, use_bin_type=True)  # type: ignore[no-any-return]


class ZmqChannel(ChannelBase):
    """One peer's end of a ZeroMQ link (see the module docstring)."""

    def __init__(self, link: _Endpoint, peer: str, route: bytes | None) -> None:
        super().__init__(peer, link.cfg.window, link.cfg.max_frame_bytes)
        self._link = link
        self._route = route  # ROUTER side: the peer's identity frame

    def _frames(self, header: Mapping[str, Any], bufs: tuple[bytes | memoryview, ...]) -> list[Any]:
        frames: list[Any] = [_pack(header), *bufs]
        return [self._route, *frames] if self._route is not None else frames

    async def _transmit(self, header: Mapping[str, Any], buffers: tuple[bytes | memoryview, ...]) -> None:
        frames = self._frames({"k": "d", "h": dict(header)}, buffers)
        try:
            await self._link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        # The socket is full or has no live connection: wait, unless the channel closes meanwhile.
        send = asyncio.ensure_future(self._link.sock.send_multipart(frames, copy=False))
        closed = asyncio.ensure_future(self._closed_ev.wait())
        try:
            await asyncio.wait({send, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not send.done():
                send.cancel()
        if not send.done() or send.cancelled():
            raise TransportClosed(f"channel to {self.peer!r} closed while sending ({self._reason})")
        send.result()

    def _report_read(self, total: int) -> None:
        self._control({"k": "c", "n": total})

    async def _send_close(self, reason: str) -> None:
        self._control({"k": "x", "reason": reason})

    def _control(self, header: Mapping[str, Any]) -> None:
        """Best effort, never blocks: a control frame that cannot go now is dropped (credit
        totals are cumulative and repeat with every heartbeat; a lost close is made moot by
        liveness)."""
        try:
            fut: asyncio.Future[Any] = self._link.sock.send_multipart(  # type: ignore[assignment]
                self._frames(header, ()), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as e:
            self._shut(f"send failed: {e}")
            return
        fut.add_done_callback(self._control_sent)  # pyzmq settles a NOBLOCK send at once

    def _control_sent(self, fut: asyncio.Future[Any]) -> None:
        e = None if fut.cancelled() else fut.exception()
        if e is not None and not isinstance(e, zmq.Again):
            self._shut(f"send failed: {e}")

    # -- called by the endpoint's receive loop
    def _on_frame(self, header: Mapping[str, Any], bufs: list[memoryview]) -> None:
        k = header.get("k")
        if k == "d":
            self._deliver(Message(header.get("h", {}), tuple(bufs)))
        elif k == "c":
            self._peer_read(int(header.get("n", 0)))
        elif k == "x":
            self._shut(str(header.get("reason", "closed by peer")))

    def _on_shut(self) -> None:
        self._link._forget(self)


class _Endpoint:
    """Shared machinery: the socket, the receive and heartbeat loops, liveness."""

    sock: zmq.asyncio.Socket

    def __init__(self, node_id: str, cfg: LinkConfig, incarnation: int) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.live = PeerLiveness(node_id, incarnation=incarnation, interval_s=cfg.heartbeat_s, jitter=0.1,
                                 suspect_after_s=cfg.suspect_after_s, lost_after_s=cfg.lost_after_s)  # fmt: skip
        self.channels: dict[str, ZmqChannel] = {}
        self._accepted: asyncio.Queue[ZmqChannel] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    def _setup(self, sock: zmq.asyncio.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        sock.setsockopt(zmq.RCVHWM, self.cfg.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes + 64 * 1024)

    def _forget(self, ch: ZmqChannel) -> None:
        if self.channels.get(ch.peer) is ch:
            del self.channels[ch.peer]
            self.live.remove_peer(ch.peer)

    async def accept(self) -> ZmqChannel:
        """The next new channel: on a server, a child that said hello (or came back after a
        restart or loss); on a client, a fresh channel after the server restarted."""
        return await self._accepted.get()

    def _spawn(self, tg: asyncio.TaskGroup) -> None:
        self._tasks = [tg.create_task(self._recv_loop()), tg.create_task(self._heartbeat_loop())]

    async def _beat(self) -> None:
        """One liveness round: send due heartbeats, act on events."""
        self.live.tick(asyncio.get_running_loop().time())
        for peer, hb in self.live.messages_to_send():
            ch = self.channels.get(peer)
            if ch is not None:
                ch._control({"k": "hb", "i": hb.incarnation, "s": hb.seq, "r": ch._read})
        self._on_events()

    def _on_events(self) -> None:
        for ev in self.live.events():
            ch = self.channels.get(ev.peer)
            if ch is None:
                continue
            if isinstance(ev, PeerLost):
                log.warning("peer_lost", node=self.node_id, peer=ev.peer, silent_s=round(ev.silent_s, 2))
                ch._shut(f"peer lost: silent for {ev.silent_s:.1f} s")
            elif isinstance(ev, PeerRejoined):
                log.info("peer_restarted", node=self.node_id, peer=ev.peer, incarnation=ev.incarnation)
                route = ch._route
                ch._shut("peer restarted")
                self._open(ev.peer, route)
                self.live.add_peer(ev.peer, asyncio.get_running_loop().time())

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._beat()
            await asyncio.sleep(self.cfg.heartbeat_s / 4)

    async def _recv_loop(self) -> None:
        raise NotImplementedError

    def _handle(self, peer: str, route: bytes | None, frames: list[zmq.Frame]) -> None:
        try:
            header = msgpack.unpackb(frames[0].buffer, raw=False)
            if not isinstance(header, dict):
                raise ValueError("header is not a map")
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            log.warning("bad_frame", peer=peer, error=str(e))
            return
        now = asyncio.get_running_loop().time()
        ch = self.channels.get(peer)
        if header.get("k") == "hb":
            if ch is None:  # a new peer, or one back after being lost: a fresh channel
                ch = self._open(peer, route)
                self.live.add_peer(peer, now)
            self.live.on_heartbeat(Heartbeat(peer, int(header.get("i", 0)), int(header.get("s", 0))), now)
            self._on_events()
            ch = self.channels.get(peer)
            if ch is not None:
                ch._peer_heard()
                ch._peer_read(int(header.get("r", 0)))
            return
        if ch is None:
            return  # a stray frame for a channel already closed
        self.live.heard(peer, now)
        ch._on_frame(header, [f.buffer for f in frames[1:]])

    def _open(self, peer: str, route: bytes | None) -> ZmqChannel:
        raise NotImplementedError

    async def close_abruptly(self) -> None:
        """Stop everything without telling peers (what a killed process looks like)."""
        for ch in list(self.channels.values()):
            ch._shut("endpoint killed")
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ch in list(self.channels.values()):
            await ch.close("endpoint closing")
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(linger=0)
        self._before_term()
        self.ctx.destroy(linger=0)  # closes any socket left (never hangs, unlike term())

    def _before_term(self) -> None:
        """Hook for endpoint-specific teardown that must precede the context's end."""


class ZmqServer(_Endpoint):
    """The binding side (a parent). `accept` yields a channel per child that says hello."""

    def __init__(self, node_id: str, bind: str = "tcp://127.0.0.1:0", *, cfg: LinkConfig | None = None,
                 curve: CurveKeys | None = None, allowed_clients: set[bytes] | None = None) -> None:  # fmt: skip
        super().__init__(node_id, cfg or LinkConfig(), new_incarnation())
        self.bind_addr = bind
        self.curve = curve
        self.allowed_clients = allowed_clients
        self.address = ""
        self._auth: AsyncioAuthenticator | None = None
        self.refused: list[bytes] = []

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials check (CurveZMQ): only configured client keys get in."""
        ok = self.allowed_clients is not None and key in self.allowed_clients
        if not ok:
            self.refused.append(key)
            log.warning("curve_client_refused", server=self.node_id, client_key=key.decode(errors="replace"))
        return ok

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Bind and start serving; returns the bound address (``tcp://host:port``)."""
        if self.curve is not None:
            self._auth = AsyncioAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._setup(self.sock)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.curve is not None:
            self.sock.curve_secretkey = self.curve.secret
            self.sock.curve_publickey = self.curve.public
            self.sock.curve_server = True
        try:
            self.sock.bind(self.bind_addr)
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            self._before_term()
            self.ctx.destroy(linger=0)
            raise TransportClosed(f"{self.node_id}: cannot listen on {self.bind_addr}: {e}") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._spawn(tg)
        log.info("zmq_listening", node=self.node_id, address=self.address, curve=self.curve is not None)
        return self.address

    def _open(self, peer: str, route: bytes | None) -> ZmqChannel:
        ch = ZmqChannel(self, peer, route)
        self.channels[peer] = ch
        self._accepted.put_nowait(ch)
        log.info("channel_opened", node=self.node_id, peer=peer)
        return ch

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            route = frames[0].bytes
            self._handle(route.decode(errors="replace"), route, frames[1:])

    def _before_term(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class ZmqClient(_Endpoint):
    """The dialling side (a child): one channel to its parent."""

    def __init__(self, node_id: str, connect: str, server_id: str, *, cfg: LinkConfig | None = None,
                 curve: CurveKeys | None = None, server_key: bytes | None = None, incarnation: int | None = None) -> None:  # fmt: skip
        if (curve is None) != (server_key is None):
            raise ValueError("CurveZMQ needs both the client's keys and the server's public key")
        super().__init__(node_id, cfg or LinkConfig(), new_incarnation() if incarnation is None else incarnation)
        self.connect_addr = connect
        self.server_id = server_id
        self.curve = curve
        self.server_key = server_key

    async def start_in(self, tg: asyncio.TaskGroup) -> ZmqChannel:
        self.sock = self.ctx.socket(zmq.DEALER)
        self._setup(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, self.node_id.encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, self.cfg.reconnect_ivl_ms)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.cfg.reconnect_ivl_max_ms)
        if self.curve is not None:
            assert self.server_key is not None
            self.sock.curve_secretkey = self.curve.secret
            self.sock.curve_publickey = self.curve.public
            self.sock.curve_serverkey = self.server_key
        self.sock.connect(self.connect_addr)
        ch = self._open(self.server_id, None)
        self._accepted.get_nowait()  # the first channel is returned here, not through accept()
        self.live.add_peer(self.server_id, asyncio.get_running_loop().time())
        await self._beat()  # the hello: the server opens our channel on the first heartbeat
        self._spawn(tg)
        return ch

    def _open(self, peer: str, route: bytes | None) -> ZmqChannel:
        ch = ZmqChannel(self, peer, None)
        ch._await_peer()  # send nothing until this server incarnation has been heard
        self.channels[peer] = ch
        self._accepted.put_nowait(ch)
        return ch

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if frames:
                self._handle(self.server_id, None, frames)


class ZmqTransport:
    """A node's ZeroMQ side (`aurora.transport.base.Transport`): an optional listening server
    for its children, and one dialling client per parent it connects to."""

    def __init__(self, node_id: str, *, cfg: LinkConfig | None = None, bind: str | None = None,
                 curve: CurveKeys | None = None, allowed_clients: set[bytes] | None = None,
                 server_keys: Mapping[str, bytes] | None = None) -> None:  # fmt: skip
        self.node_id = node_id
        self.cfg = cfg or LinkConfig()
        self.server = (
            ZmqServer(node_id, bind, cfg=self.cfg, curve=curve, allowed_clients=allowed_clients) if bind else None
        )
        self.curve = curve
        self.server_keys = dict(server_keys or {})
        self.clients: dict[str, ZmqClient] = {}
        self.address = ""
        self._tg: asyncio.TaskGroup | None = None
        self._accepted: asyncio.Queue[ZmqChannel] = asyncio.Queue()
        self._forwards: list[asyncio.Task[None]] = []

    async def listen_in(self, tg: asyncio.TaskGroup) -> str:
        """`start_in`, and bind the server; returns its address ("" without one)."""
        self.start_in(tg)
        if self.server is not None:
            self.address = await self.server.start_in(tg)
            self._forwards.append(tg.create_task(self._forward(self.server)))
        return self.address

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg

    async def _forward(self, ep: _Endpoint) -> None:
        while True:
            self._accepted.put_nowait(await ep.accept())

    async def connect(self, peer: str, address: str) -> ZmqChannel:
        """Dial ``peer`` at ``address``; the channel is usable at once (sends wait until the
        peer is heard). A second call for the same peer replaces the first link."""
        assert self._tg is not None, "start_in() first"
        old = self.clients.pop(peer, None)
        if old is not None:
            await old.close()
        key = self.server_keys.get(peer)
        if (key is None) != (self.curve is None):
            raise ConfigError(f"CurveZMQ to {peer!r} needs this node's keys and the peer's public key")
        client = ZmqClient(self.node_id, address, peer, cfg=self.cfg, curve=self.curve, server_key=key)
        self.clients[peer] = client
        ch = await client.start_in(self._tg)
        self._forwards.append(self._tg.create_task(self._forward(client)))  # fresh channels after a restart
        return ch

    async def accept(self) -> ZmqChannel:
        return await self._accepted.get()

    async def disconnect(self, peer: str) -> None:
        """Close the link to ``peer`` (its channel closes; the peer sees it go)."""
        client = self.clients.pop(peer, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for t in self._forwards:
            t.cancel()
        for c in self.clients.values():
            await c.close()
        if self.server is not None:
            await self.server.close()


__all__ = ["CurveKeys", "LinkConfig", "ProtocolError", "ZmqChannel", "ZmqClient", "ZmqServer", "ZmqTransport"]
