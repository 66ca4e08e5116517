"""ZeroMQ links: the parent binds a ROUTER (`ZmqServer`), children dial a DEALER (`ZmqClient`).

Children always dial out (what NAT allows). Each link carries `Channel`
semantics (`aurora.transport.base`) on top of ZeroMQ's ordered delivery:

* frames: ``[link frame, *rest]`` (the ROUTER adds the connection's routing id in
  front); the link frame is a `aurora.protocol.messages.LinkFrame`: ``d`` data
  (then the application message's header and its buffers), ``c`` credit, ``hb``
  heartbeat, ``x`` close. Buffers go out with ``copy=False``. Every frame is
  decoded and validated before anything acts on it; what fails is dropped and
  counted against the peer (`ChannelBase.fault`), never raised. What a frame
  means — credit, heartbeats, close, faults — is each channel's link machine
  (`aurora.protocol.link.Link`, the same under every transport); the endpoint
  routes frames to channels and sleeps until their next deadline.
* identity: every DEALER sets a random 128-bit routing id, so no honest connection
  depends on the ROUTER generating one (libzmq aborts the process when a generated id
  collides with one a client chose), and the generated ids start at a random point (libc's
  ``rand`` is seeded from the OS at import: unseeded, every process generates the same).
  No client can take over another's route: the routing id is a route, never a name. Who a peer *is* comes from
  its CurveZMQ key when keys are on (the ZAP handler's User-Id, mapped to a node
  name by the topology's keys; a heartbeat naming another node is refused), and
  from the name in its heartbeats otherwise. Frames from a connection other than
  the one a peer's channel is on are dropped, unless they are heartbeats of a
  newer incarnation (the peer restarted): then the channel moves to the new
  connection, as a fresh channel.
* flow control: the link's cumulative credit window; the read total goes
  in ``c`` frames and rides on every heartbeat; a peer that overruns the
  window is cut off.
* liveness: each link heartbeats its peer; a silent peer closes
  its channel ("peer lost"); a peer that comes back with a new incarnation
  gets a fresh channel (the old one closes with "peer restarted"), which
  `accept` hands out — on either side, since a restarted server is a new
  incarnation too (incarnations are start times).
* ``linger=0`` everywhere, so closing never hangs; DEALERs reconnect by
  themselves with exponential backoff (``reconnect_ivl`` .. ``reconnect_ivl_max``).
* CurveZMQ when keys are given: the server's secret key, and the map of client
  public keys to node names; any other client is refused by ZAP and logged — except at a
  parent of an elastic pool, where an unknown key gets in but is heard only under the pool
  member name it is the key of (its certificate is then checked at its hello, `aurora.auth.pool`).
* frames above ``max_frame_bytes`` are refused at `send` (`FrameTooLarge`) and
  by the receiving socket (``ZMQ_MAXMSGSIZE``), never buffered; a message of more frames
  than any message has is dropped as malformed (libzmq bounds each frame, not their number).
* a peer whose channel was cut off for bad messages, or that keeps sending frames no
  channel takes, is banned for `BAN_S`: its heartbeats open no new channel meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
import zmq.asyncio
from aurora.transport.base import DEFAULT_MAX_FRAME_BYTES, DEFAULT_WINDOW, check_timings, new_incarnation
from aurora.transport.channel import ChannelBase
from zmq.auth.asyncio import AsyncioAuthenticator

from aurora.auth.keys import CurveKeys, NodeKeys
from aurora.errors import ConfigError, ProtocolError, TransportClosed
from aurora.events import BAD_FRAME, CURVE_CLIENT_REFUSED
from aurora.logs import Throttle
from aurora.protocol.link import DEFAULT_BULK_BYTES, FAULT_WINDOW_S, FaultBudget, LinkTimings
from aurora.protocol.messages import (
    MAX_PROBE_BUFFERS,
    BadMessage,
    Lane,
    LinkBeat,
    LinkClose,
    LinkCredit,
    LinkData,
    LinkFrame,
    decode_link,
    encode_link,
)
from aurora.runtime.clock import Clock, LoopClock
from aurora.runtime.groups import wait_first

log = structlog.get_logger("aurora.transport.zmq")


def _seed_libc_rand() -> None:
    """libzmq picks the first routing id a ROUTER generates with libc's ``rand()``; seed it from the OS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))


_seed_libc_rand()
MAX_FRAMES = 2 + 1 + MAX_PROBE_BUFFERS
"""Routing id (ROUTER side), link frame, header, and at most this many buffers."""
BAN_S = 60.0
BAD_FRAMES_TO_BAN = 64
"""Frames that reach no channel (malformed, or from a connection it does not own) a known peer may
send within `FAULT_WINDOW_S` before it is banned."""

_DATA = encode_link(LinkData())
_quiet = Throttle(every_s=5.0)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    window: int = DEFAULT_WINDOW
    """Control-lane messages a receiver lets a sender have unread."""
    bulk_bytes: int = DEFAULT_BULK_BYTES
    """Bulk-lane bytes a receiver lets a sender have unread (what a control message waits behind at most)."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    hwm: int = 1000
    heartbeat_s: float = 0.5
    suspect_after_s: float = 1.5
    lost_after_s: float = 3.0
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5000

    def __post_init__(self) -> None:
        check_timings(self.heartbeat_s, self.suspect_after_s, self.lost_after_s)


class ZmqChannel(ChannelBase):
    """One peer's end of a ZeroMQ link (see the module docstring): a `ChannelBase` whose frames go
    through its endpoint's socket."""

    def __init__(self, link: _Endpoint, peer: str, route: bytes | None, *, await_peer: bool = False) -> None:
        cfg = link.cfg
        super().__init__(
            peer,
            cfg.window,
            cfg.max_frame_bytes,
            bulk_bytes=cfg.bulk_bytes,
            timings=LinkTimings(cfg.heartbeat_s, cfg.suspect_after_s, cfg.lost_after_s),
            incarnation=link.incarnation,
            name=link.node_id,
            await_peer=await_peer,
            seed=next(link.seeds),
            clock=link.clock,
        )
        self._link = link
        self._route = route  # ROUTER side: the connection's routing id
        self.rejoined = False
        """Closed because the peer restarted (its endpoint opens a fresh channel)."""

    def _frames(self, first: bytes, rest: tuple[bytes | memoryview, ...]) -> list[Any]:
        frames: list[Any] = [first, *rest]
        return [self._route, *frames] if self._route is not None else frames

    async def _transmit(self, header: bytes, buffers: tuple[bytes | memoryview, ...], lane: Lane) -> None:
        frames = self._frames(_DATA, (header, *buffers))
        try:
            await self._link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        # The socket is full or has no live connection: wait, unless the channel closes meanwhile.
        send, _ = await wait_first(self._link.sock.send_multipart(frames, copy=False), self._closed_ev.wait())
        if send.cancelled():
            raise TransportClosed(f"channel to {self.peer!r} closed while sending ({self.close_reason})")
        send.result()

    def _send_control(self, frame: LinkCredit | LinkBeat | LinkClose) -> None:
        """Best effort, never blocks: a control frame that cannot go now is dropped (credit
        totals are cumulative and repeat with every heartbeat; a lost close is made moot by
        liveness)."""
        try:
            fut: asyncio.Future[Any] = self._link.sock.send_multipart(  # type: ignore[assignment]
                self._frames(encode_link(frame), ()), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as e:
            self._shut(f"send failed: {e}")
            return
        fut.add_done_callback(self._control_sent)  # pyzmq settles a NOBLOCK send at once

    def _control_sent(self, fut: asyncio.Future[Any]) -> None:
        e = None if fut.cancelled() else fut.exception()
        if e is not None and not isinstance(e, zmq.Again):
            self._shut(f"send failed: {e}")

    # -- called by the endpoint's receive loop, with a decoded link frame
    def _on_frame(self, link: LinkFrame, rest: list[memoryview]) -> None:
        if not isinstance(link, LinkData):
            self._received(link)
        elif not rest:
            self.fault("a data frame without its message")
        else:
            self._received_app(link, rest[0], tuple(rest[1:]))

    def _rejoined(self, incarnation: int) -> None:
        log.info("peer_restarted", node=self._link.node_id, peer=self.peer, incarnation=incarnation)
        self.rejoined = True

    def _on_shut(self) -> None:
        self._link._forget(self)


class _Endpoint:
    """Shared machinery: the socket, the receive loop, and the heartbeat loop that ticks every
    channel's link at the earliest of their deadlines."""

    sock: zmq.asyncio.Socket

    def __init__(self, node_id: str, cfg: LinkConfig, incarnation: int, clock: Clock | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.incarnation = incarnation
        self.clock: Clock = clock or LoopClock()
        """What the endpoint and its channels read time from and wait on."""
        self.seeds = itertools.count()
        """Each channel's heartbeat jitter seed (channels' beats spread apart)."""
        self.ctx = zmq.asyncio.Context()
        self.channels: dict[str, ZmqChannel] = {}
        self._wake = asyncio.Event()
        """A channel opened: the heartbeat loop has a new deadline."""
        self._accepted: asyncio.Queue[ZmqChannel] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.dropped = 0
        """Frames dropped before reaching a channel (malformed, from an unknown or stale connection)."""
        self.banned: dict[str, float] = {}
        """Peers whose heartbeats open no channel until the time given (on `clock`)."""
        self._bad: dict[str, FaultBudget] = {}

    def _setup(self, sock: zmq.asyncio.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        sock.setsockopt(zmq.RCVHWM, self.cfg.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes + 64 * 1024)

    def _forget(self, ch: ZmqChannel) -> None:
        if self.channels.get(ch.peer) is ch:
            del self.channels[ch.peer]
            if ch.cut_off:
                self._ban(ch.peer, "its channel was cut off for bad messages")

    def _ban(self, peer: str, why: str) -> None:
        self.banned[peer] = self.clock.now() + BAN_S
        while len(self.banned) > 4096:
            del self.banned[next(iter(self.banned))]
        log.warning("peer_banned", node=self.node_id, peer=peer, ban_s=BAN_S, reason=why)

    def _is_banned(self, peer: str, now: float) -> bool:
        until = self.banned.get(peer)
        if until is None:
            return False
        if now >= until:
            del self.banned[peer]
            return False
        return True

    def _drop(self, source: str, reason: str, *, peer: str | None = None) -> None:
        """A frame that reaches no channel: counted, logged at most every few seconds per source; a
        known ``peer`` that keeps sending them is banned."""
        self.dropped += 1
        now = self.clock.now()
        suppressed = _quiet.allow(f"{self.node_id}/{source}", now)
        if suppressed is not None:
            log.warning(BAD_FRAME, node=self.node_id, source=source, reason=reason[:300], suppressed=suppressed)
        if peer is not None:
            budget = self._bad.setdefault(peer, FaultBudget(BAD_FRAMES_TO_BAN, FAULT_WINDOW_S))
            if budget.spend(now):
                budget.reset()
                self._ban(peer, f"{BAD_FRAMES_TO_BAN} frames no channel takes within {FAULT_WINDOW_S:g} s")
                ch = self.channels.get(peer)
                if ch is not None:
                    ch.abort("banned")

    async def accept(self) -> ZmqChannel:
        """The next new channel: on a server, a child that said hello (or came back after a
        restart or loss); on a client, a fresh channel after the server restarted."""
        return await self._accepted.get()

    def _spawn(self, tg: asyncio.TaskGroup) -> None:
        self._tasks = [tg.create_task(self._recv_loop()), tg.create_task(self._heartbeat_loop())]

    def _tick(self) -> float | None:
        """Tick the links whose deadline has come (heartbeats due go out, a silent peer is lost);
        returns the earliest deadline left."""
        now, earliest = self.clock.now(), None
        for ch in list(self.channels.values()):
            due = ch.link.next_deadline()
            if due is not None and due <= now:
                ch._tick(now)
                due = ch.link.next_deadline()
            if due is not None and (earliest is None or due < earliest):
                earliest = due
        return earliest

    async def _heartbeat_loop(self) -> None:
        while True:
            self._wake.clear()
            await self.clock.wait_until(self._wake, self._tick())

    async def _recv_loop(self) -> None:
        raise NotImplementedError

    def _beat_from(self, peer: str, route: bytes | None, hb: LinkBeat, now: float) -> None:
        """A valid heartbeat from ``peer`` (identified already) on connection ``route``."""
        if self._is_banned(peer, now):
            return
        ch = self.channels.get(peer)
        if ch is None:  # a new peer, or one back after being lost: a fresh channel
            ch = self._open(peer, route)
        ch._received(hb)
        if ch.rejoined:  # it restarted: a fresh channel, which this heartbeat opens
            self._open(peer, route if route is not None else ch._route)._received(hb)

    def _open(self, peer: str, route: bytes | None) -> ZmqChannel:
        raise NotImplementedError

    async def close_abruptly(self) -> None:
        """Stop everything without telling peers (what a killed process looks like)."""
        for ch in list(self.channels.values()):
            ch._shut("endpoint killed")
        await self.close()

    async def close(self) -> None:
        """Close every channel (telling its peer), then the socket and the context. Cancellation-safe:
        a close cancelled midway (its owner stopping while a channel flushes) still closes the socket
        and the context, or the socket would be left open, owned by nobody."""
        if self._closed:
            return
        self._closed = True
        try:
            for ch in list(self.channels.values()):
                await ch.close("endpoint closing")
        finally:
            for t in self._tasks:
                t.cancel()
            try:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                self.sock.close(linger=0)
                self._before_term()
                self.ctx.destroy(linger=0)  # closes any socket left (never hangs, unlike term())

    def _before_term(self) -> None:
        """Hook for endpoint-specific teardown that must precede the context's end."""


class ZmqServer(_Endpoint):
    """The binding side (a parent). `accept` yields a channel per child that says hello.

    ``clients``: with CurveZMQ, every client public key (Z85) this server lets in, mapped to
    the node name it belongs to; a key not in it is refused by ZAP — unless ``members`` is given
    (this node is a pool's parent): then any key passes ZAP, and one not in ``clients`` is heard only
    under the pool member name it is the key of."""

    def __init__(
        self,
        node_id: str,
        bind: str = "tcp://127.0.0.1:0",
        *,
        cfg: LinkConfig | None = None,
        curve: CurveKeys | None = None,
        clients: Mapping[bytes, str] | None = None,
        members: Callable[[str, bytes], bool] | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(node_id, cfg or LinkConfig(), new_incarnation(), clock)
        if (curve is None) != (clients is None):
            raise ValueError("CurveZMQ needs both the server's keys and the clients' keys")
        if members is not None and curve is None:
            raise ValueError("pool members are known by their CurveZMQ keys: members needs curve")
        self.bind_addr = bind
        self.curve = curve
        self.clients = dict(clients) if clients is not None else None
        self.members = members
        """Pool members (`aurora.auth.pool`): ``members(name, key)`` says whether ``key`` (Z85) is the key of
        the pool member ``name`` of a pool whose members attach here; such a key gets in under that name."""
        self.address = ""
        self._auth: AsyncioAuthenticator | None = None
        self.refused: list[bytes] = []
        self._routes: dict[bytes, ZmqChannel] = {}
        """Each open channel by the routing id of its connection."""

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials check (CurveZMQ): only configured client keys get in."""
        ok = self.clients is not None and (key in self.clients or self.members is not None)
        if not ok:
            if len(self.refused) < 1000:
                self.refused.append(key)
            suppressed = _quiet.allow(f"{self.node_id}/zap", self.clock.now())
            if suppressed is not None:
                log.warning(
                    CURVE_CLIENT_REFUSED,
                    server=self.node_id,
                    client_key=key.decode(errors="replace"),
                    suppressed=suppressed,
                )
        return ok

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Bind and start serving; returns the bound address (``tcp://host:port``)."""
        if self.curve is not None:
            self._auth = AsyncioAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._setup(self.sock)
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
        assert route is not None
        self._routes[route] = ch
        self._accepted.put_nowait(ch)
        self._wake.set()
        log.info("channel_opened", node=self.node_id, peer=peer)
        return ch

    def _forget(self, ch: ZmqChannel) -> None:
        super()._forget(ch)
        if ch._route is not None and self._routes.get(ch._route) is ch:
            del self._routes[ch._route]

    def _beat_from(self, peer: str, route: bytes | None, hb: LinkBeat, now: float) -> None:
        ch = self.channels.get(peer)
        if ch is not None and ch._route != route:
            known = ch.link.remote_incarnation
            if known is not None and hb.i < known:
                self._drop(peer, "a heartbeat of an older incarnation from another connection")
                return
            # the peer reconnected (or restarted): what was in flight on the old connection is
            # gone, so the channel starts afresh on the new one
            log.info("peer_reconnected", node=self.node_id, peer=peer)
            ch._shut("peer reconnected")
        super()._beat_from(peer, route, hb, now)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            if len(frames) > MAX_FRAMES:
                self._drop(frames[0].bytes.hex(), f"a message of {len(frames)} frames")
                continue
            self._handle(frames[0].bytes, frames[1:])

    def _handle(self, route: bytes, frames: list[zmq.Frame]) -> None:
        source = route.hex()
        try:
            link = decode_link(frames[0].buffer)
        except BadMessage as e:
            known = self._routes.get(route)
            self._drop(source, e.reason, peer=None if known is None else known.peer)
            return
        key_name = None
        key = b""
        if self.clients is not None:
            try:
                uid = frames[0].get("User-Id")
                key = uid.encode() if isinstance(uid, str) else b""
            except (zmq.ZMQError, UnicodeError):
                key = b""
            key_name = self.clients.get(key)
            if key_name is None:
                # a pool member's key (the name it claims must be the one its key decides); else ZAP let
                # in no such key, so this cannot happen short of a bug
                claimed = link.n if isinstance(link, LinkBeat) else getattr(self._routes.get(route), "peer", None)
                if self.members is not None and key and claimed is not None and self.members(claimed, key):
                    key_name = claimed
                else:
                    self._drop(source, "a frame from a CurveZMQ key that is no node's nor that pool member's")
                    return
        now = self.clock.now()
        if isinstance(link, LinkBeat):
            claimed = link.n
            if key_name is not None and claimed is not None and claimed != key_name:
                self._drop(key_name, f"the key of {key_name!r} sent heartbeats as {claimed!r}: refused", peer=key_name)
                return
            peer = key_name or claimed
            if peer is None:
                self._drop(source, "a heartbeat that names no node")
                return
            self._beat_from(peer, route, link, now)
            opened = self._routes.get(route)
            if opened is not None and key:
                opened.peer_key = key
            return
        ch = self._routes.get(route)
        if ch is None and isinstance(link, LinkClose | LinkCredit):
            return  # the close of, or the last credit for, a channel this end closed first: a race, not a fault
        if ch is None or (key_name is not None and ch.peer != key_name):
            self._drop(source, "a frame from a connection with no channel (a stale or unknown one)", peer=key_name)
            return
        ch._heard()
        ch._on_frame(link, [f.buffer for f in frames[1:]])

    def _before_term(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class ZmqClient(_Endpoint):
    """The dialling side (a child): one channel to its parent."""

    def __init__(
        self,
        node_id: str,
        connect: str,
        server_id: str,
        *,
        cfg: LinkConfig | None = None,
        curve: CurveKeys | None = None,
        server_key: bytes | None = None,
        incarnation: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        if (curve is None) != (server_key is None):
            raise ValueError("CurveZMQ needs both the client's keys and the server's public key")
        super().__init__(node_id, cfg or LinkConfig(), new_incarnation() if incarnation is None else incarnation, clock)
        self.connect_addr = connect
        self.server_id = server_id
        self.curve = curve
        self.server_key = server_key

    async def start_in(self, tg: asyncio.TaskGroup) -> ZmqChannel:
        self.sock = self.ctx.socket(zmq.DEALER)
        self._setup(self.sock)
        self.sock.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(16))  # never one a ROUTER generates
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
        self._tick()  # the hello: the server opens our channel on the first heartbeat
        self._spawn(tg)
        return ch

    def _open(self, peer: str, route: bytes | None) -> ZmqChannel:
        ch = ZmqChannel(self, peer, None, await_peer=True)  # nothing goes until this server incarnation is heard
        self.channels[peer] = ch
        self._accepted.put_nowait(ch)
        self._wake.set()
        return ch

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) > MAX_FRAMES - 1:
                self._drop(self.server_id, f"a message of {len(frames)} frames")
            elif frames:
                self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            link = decode_link(frames[0].buffer)
        except BadMessage as e:
            self._drop(self.server_id, e.reason)
            return
        if isinstance(link, LinkBeat):
            self._beat_from(self.server_id, None, link, self.clock.now())
            return
        ch = self.channels.get(self.server_id)
        if ch is None:
            return  # a stray frame for a channel already closed
        ch._heard()
        ch._on_frame(link, [f.buffer for f in frames[1:]])


class ZmqTransport:
    """A node's ZeroMQ side (`aurora.transport.base.Transport`): an optional listening server
    for its children, and one dialling client per parent it connects to. ``keys``: the node's
    keys (CurveZMQ on when they hold a pair); ``clock``: what its links read time from (the node's)."""

    def __init__(
        self,
        node_id: str,
        *,
        cfg: LinkConfig | None = None,
        bind: str | None = None,
        keys: NodeKeys | None = None,
        members: Callable[[str, bytes], bool] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.node_id = node_id
        self.cfg = cfg or LinkConfig()
        self.keys = keys or NodeKeys()
        self.clock: Clock = clock or LoopClock()
        curve = self.keys.curve
        clients = {k: n for n, k in self.keys.public.items()} if curve is not None else None
        self.server = (
            ZmqServer(
                node_id,
                bind,
                cfg=self.cfg,
                curve=curve,
                clients=clients,
                members=members if curve is not None else None,
                clock=self.clock,
            )
            if bind
            else None
        )
        self.clients: dict[str, ZmqClient] = {}
        self.address = ""
        self._tg: asyncio.TaskGroup | None = None
        self._accepted: asyncio.Queue[ZmqChannel] = asyncio.Queue()
        self._forwards: dict[str, asyncio.Task[None]] = {}

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Own the transport's tasks in ``tg``; bind the server, if any: its address ("" without one)."""
        self._tg = tg
        if self.server is not None:
            self.address = await self.server.start_in(tg)
            self._forwards[""] = tg.create_task(self._forward(self.server))
        return self.address

    async def _forward(self, ep: _Endpoint) -> None:
        while True:
            self._accepted.put_nowait(await ep.accept())

    async def connect(self, peer: str, address: str) -> ZmqChannel:
        """Dial ``peer`` at ``address``; the channel is usable at once (sends wait until the
        peer is heard). A second call for the same peer replaces the first link."""
        assert self._tg is not None, "start_in() first"
        await self.disconnect(peer)
        key = self.keys.public.get(peer) if self.keys.curve is not None else None
        if self.keys.curve is not None and key is None:
            raise ConfigError(f"CurveZMQ to {peer!r} needs its public key")
        client = ZmqClient(
            self.node_id, address, peer, cfg=self.cfg, curve=self.keys.curve, server_key=key, clock=self.clock
        )
        self.clients[peer] = client
        ch = await client.start_in(self._tg)
        self._forwards[peer] = self._tg.create_task(self._forward(client))  # fresh channels after a restart
        return ch

    async def accept(self) -> ZmqChannel:
        return await self._accepted.get()

    async def disconnect(self, peer: str) -> None:
        """Close the link to ``peer`` (its channel closes; the peer sees it go)."""
        fwd = self._forwards.pop(peer, None)
        if fwd is not None:
            fwd.cancel()
        client = self.clients.pop(peer, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        """Close every endpoint; one cancelled midway still leaves none of the others open."""
        for t in self._forwards.values():
            t.cancel()
        await _close_all([*self.clients.values(), *([self.server] if self.server is not None else [])])


async def _close_all(endpoints: list[_Endpoint]) -> None:
    """Close each of ``endpoints`` in turn, the rest even when one's close is cancelled or fails."""
    if endpoints:
        try:
            await endpoints[0].close()
        finally:
            await _close_all(endpoints[1:])


__all__ = ["CurveKeys", "LinkConfig", "ProtocolError", "ZmqChannel", "ZmqClient", "ZmqServer", "ZmqTransport"]
