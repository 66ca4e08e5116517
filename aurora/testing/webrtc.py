"""Helpers for testing WebRTC links in one process.

aioice never offers loopback addresses as ICE candidates, so two peer
connections in one process on a machine without other interfaces cannot meet.
`loopback_ice` patches aioice's host-address list to ``127.0.0.1`` for the
duration of a ``with`` block — for the deterministic, in-process layer only;
tests across network namespaces use real addresses. `RtcPairs` connects
`WebRtcTransport` ends over in-memory signalling channels.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from aioice import ice

from aurora.testing.memory import MemoryChannel, memory_channel_pair
from aurora.transport.webrtc import WebRtcChannel, WebRtcTransport


@contextlib.contextmanager
def loopback_ice() -> Iterator[None]:
    original = ice.get_host_addresses
    ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"] if use_ipv4 else []
    try:
        yield
    finally:
        ice.get_host_addresses = original


class RtcPairs:
    """Connects `WebRtcTransport` ends over in-memory signalling channels, and ends those
    channels (and their receive loops) on `close`. Use inside `loopback_ice`."""

    def __init__(self, tg: asyncio.TaskGroup) -> None:
        self.tg = tg
        self.signalling: list[MemoryChannel] = []

    async def connect(self, a: WebRtcTransport, b: WebRtcTransport) -> tuple[WebRtcChannel, WebRtcChannel]:
        """``a`` dials ``b``; returns (a's end, b's end)."""
        sa, sb = memory_channel_pair(a.node_id, b.node_id)
        self.signalling += [sa, sb]
        self.tg.create_task(a.serve_signalling(sa))
        self.tg.create_task(b.serve_signalling(sb))
        ca = await a.connect_via(b.node_id, sa)
        cb = await asyncio.wait_for(b.accept(), 10)
        return ca, cb

    async def close(self) -> None:
        for s in self.signalling:
            await s.close("test over")
