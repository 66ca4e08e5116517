"""One end of a measured bulk transfer, run as its own process (so each end has its own core).

``python -m aurora.bench.transport_peer sink --kind K --bind HOST [--streams N]``
prints one JSON line ``{"address": ...}`` once it listens, receives one
payload, checks it, prints ``{"ok": true, "bytes": n}`` and exits.

``python -m aurora.bench.transport_peer source --kind K --connect ADDR --bytes B
[--streams N]`` connects (not timed), sends B random bytes, waits for the sink's
confirmation, and prints ``{"kind", "streams", "bytes", "seconds", "mb_s"}``.

Kinds: ``tcp`` (a plain socket: the baseline), ``zmq`` (``streams`` ZeroMQ
connections under `aurora.transport.bulk`), ``webrtc`` (``streams`` data
channels, each on its own peer connection, signalled over a ZeroMQ link to
the sink). Used by ``aurora bench transport`` and the network-namespace tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

import xxhash

from aurora.errors import AuroraError, TransportClosed
from aurora.logs import configure
from aurora.protocol.messages import Probe
from aurora.runtime.groups import first_error
from aurora.transport.base import Channel
from aurora.transport.bulk import receive_bulk, send_bulk
from aurora.transport.zmq import LinkConfig, ZmqClient, ZmqServer

ZMQ_CFG = LinkConfig(window=16, heartbeat_s=0.5, suspect_after_s=3.0, lost_after_s=10.0)
RTC_KW: dict[str, Any] = {"window": 16, "heartbeat_s": 0.5, "suspect_after_s": 3.0, "lost_after_s": 15.0}
TCP_CHUNK_BYTES = 1 << 20
SINK_LINGER_S = 10.0


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


# -- raw TCP -------------------------------------------------------------------------------------
async def tcp_sink(host: str) -> None:
    srv = socket.create_server((host, 0))
    _say({"address": f"{host}:{srv.getsockname()[1]}"})
    conn, _ = await asyncio.to_thread(srv.accept)
    with conn:
        size = int.from_bytes(await asyncio.to_thread(_recv_exact, conn, 8), "little")
        buf = bytearray(size)
        await asyncio.to_thread(_recv_into, conn, memoryview(buf))
        digest = await asyncio.to_thread(_recv_exact, conn, 16)
        ok = xxhash.xxh3_128_digest(buf) == digest
        conn.sendall(b"k" if ok else b"x")
    _say({"ok": ok, "bytes": size})


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:], min(TCP_CHUNK_BYTES, view.nbytes - got))
        if n == 0:
            raise TransportClosed("the TCP peer closed early")
        got += n


def tcp_source(addr: str, payload: bytes) -> float:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        t0 = time.perf_counter()
        c.sendall(len(payload).to_bytes(8, "little"))
        c.sendall(payload)
        c.sendall(xxhash.xxh3_128_digest(payload))
        if c.recv(1) != b"k":
            raise TransportClosed("the TCP sink reports a corrupt payload")
        return time.perf_counter() - t0


# -- ZeroMQ and WebRTC under the bulk layer ------------------------------------------------------
async def zmq_sink(host: str, streams: int, webrtc: bool, rtc_kw: dict[str, Any]) -> None:
    async with asyncio.TaskGroup() as tg:
        server = ZmqServer("sink", bind=f"tcp://{host}:0", cfg=ZMQ_CFG)
        addr = await server.start_in(tg)
        _say({"address": addr})
        chans: list[Channel] = []
        if webrtc:
            from aurora.transport.webrtc import RtcConfig, WebRtcTransport

            rtc = WebRtcTransport("sink", RtcConfig(**rtc_kw))
            await rtc.start_in(tg)
            sig = await server.accept()
            pump = tg.create_task(rtc.serve_signalling(sig))
            chans = [await rtc.accept() for _ in range(streams)]
        else:
            chans = [await server.accept() for _ in range(streams)]
        data = await receive_bulk(sorted(chans, key=lambda c: c.peer))
        _say({"ok": True, "bytes": data.nbytes})
        # The source closes once it has the confirmation; closing first could cut it off.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SINK_LINGER_S):
                for c in chans:
                    await _until_closed(c)
        for c in chans:
            await c.close("transfer done")
        if webrtc:
            pump.cancel()
        await server.close()


async def _until_closed(ch: Channel) -> None:
    with contextlib.suppress(TransportClosed):
        while True:
            await ch.recv()


async def zmq_source(addr: str, payload: bytes, streams: int, webrtc: bool, rtc_kw: dict[str, Any]) -> float:
    async with asyncio.TaskGroup() as tg:
        clients: list[ZmqClient] = []
        if webrtc:
            from aurora.transport.webrtc import RtcConfig, WebRtcTransport

            client = ZmqClient("source", addr, "sink", cfg=ZMQ_CFG)
            clients.append(client)
            sig = await client.start_in(tg)
            rtc = WebRtcTransport("source", RtcConfig(**rtc_kw))
            await rtc.start_in(tg)
            pump = tg.create_task(rtc.serve_signalling(sig))
            chans: list[Channel] = [await rtc.connect_via("sink", sig) for _ in range(streams)]
        else:
            clients = [ZmqClient(f"source.{i:03d}", addr, "sink", cfg=ZMQ_CFG) for i in range(streams)]
            chans = [await c.start_in(tg) for c in clients]
            for c in chans:  # wait until each link is up (not timed)
                await c.send(Probe(note="hello"))
        _say({"started": True, "streams": len(chans)})  # every link is up: the transfer begins now
        t0 = time.perf_counter()
        await send_bulk(chans, payload)
        seconds = time.perf_counter() - t0
        for c in chans:
            await c.close("transfer done")
        if webrtc:
            pump.cancel()
        for cl in clients:
            await cl.close()
        return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aurora.bench.transport_peer", description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["sink", "source"])
    ap.add_argument("--kind", choices=["tcp", "zmq", "webrtc"], required=True)
    ap.add_argument("--bind", default="127.0.0.1", help="sink: the address to listen on")
    ap.add_argument("--connect", help="source: the sink's address, as it printed it")
    ap.add_argument("--bytes", type=int, default=64 << 20, help="source: payload size")
    ap.add_argument("--streams", type=int, default=1, help="connections (zmq) or peer connections (webrtc)")
    ap.add_argument("--lost-after-s", type=float, default=15.0, help="a silent peer is lost after this long")
    ap.add_argument(
        "--sctp-rto-min-s",
        type=float,
        default=None,
        help="webrtc: minimum SCTP retransmission timeout (default: aiortc's own, 1 s)",
    )
    a = ap.parse_args(argv)
    configure(level="warning")  # stdout carries the JSON lines; logs go to stderr
    rtc_kw = {
        **RTC_KW,
        "sctp_rto_min_s": a.sctp_rto_min_s,
        "lost_after_s": a.lost_after_s,
        "suspect_after_s": a.lost_after_s / 2,
        "heartbeat_s": min(0.5, a.lost_after_s / 8),
    }
    failed: BaseException | None = None
    try:
        _run(a, ap, rtc_kw)
    except* AuroraError as eg:  # also from inside a TaskGroup
        failed = first_error(eg)
    if failed is not None:
        print(f"aurora.bench.transport_peer {a.role}: {failed}", file=sys.stderr)
        sys.exit(2)


def _run(a: argparse.Namespace, ap: argparse.ArgumentParser, rtc_kw: dict[str, Any]) -> None:
    if a.role == "sink":
        if a.kind == "tcp":
            asyncio.run(tcp_sink(a.bind))
        else:
            asyncio.run(zmq_sink(a.bind, a.streams, a.kind == "webrtc", rtc_kw))
        return
    if not a.connect:
        ap.error("source needs --connect")
    payload = os.urandom(a.bytes)
    if a.kind == "tcp":
        seconds = tcp_source(a.connect, payload)
    else:
        seconds = asyncio.run(zmq_source(a.connect, payload, a.streams, a.kind == "webrtc", rtc_kw))
    _say({"kind": a.kind, "streams": a.streams, "bytes": a.bytes, "seconds": seconds, "mb_s": a.bytes / seconds / 1e6})


if __name__ == "__main__":
    main()
