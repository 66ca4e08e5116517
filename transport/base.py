"""The transport interface every Aurora link implements, and its wire framing.

A `Channel` is an ordered, reliable, flow-controlled message pipe to one peer.
A message is a typed application message (`aurora.protocol.messages`, encoded
as a small msgpack header) plus raw buffers, which transports pass without
copying where the library allows. Transports decode and validate every
message before a channel hands it out; what fails is the peer's fault
(`ChannelBase.fault`): dropped, and a peer that keeps at it is cut off.

Rules every implementation keeps (checked by `aurora.testing.conformance`):

* messages arrive once, in the order sent within their lane, header and
  buffers intact: a message travels in the control lane or the bulk lane
  (`aurora.protocol.messages.lane_of`: a version's stream and striped payloads
  are bulk), and a control message never waits behind bulk ones — not for
  credit, not to be read (`recv` returns control first; `recv(lane)` reads one
  lane: docs/transport.md);
* `send` waits while the peer holds ``window`` unread control messages, or
  its bulk byte window of unread bulk ones (credit-based flow control), so
  memory stays bounded whatever the peer does;
* a message above ``max_frame_bytes`` is refused at `send` with
  `FrameTooLarge`, never buffered;
* `close(reason)` is seen by the peer: its `recv` raises `TransportClosed`
  carrying the reason; after close, `send` and `recv` raise too;
* a peer that dies without closing is detected (heartbeats) and the channel
  closes with a reason saying so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from aurora.errors import AuroraError, ConfigError
from aurora.protocol.liveness import timing_problem
from aurora.protocol.messages import AppMessage, Lane

DEFAULT_WINDOW = 64
"""Unread messages a receiver lets a sender have in flight."""
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameTooLarge(AuroraError):
    """A message is larger than the link's ``max_frame_bytes``."""


@dataclass(frozen=True, slots=True)
class Message:
    msg: AppMessage
    """The decoded, validated application message."""
    buffers: Sequence[memoryview] = field(default_factory=tuple)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class Channel(Protocol):
    peer: str
    """The peer's node id."""
    peer_key: bytes | None
    """The CurveZMQ public key (Z85) the peer authenticated with, where the transport has one."""

    @property
    def closed(self) -> bool: ...

    @property
    def close_reason(self) -> str | None: ...

    async def send(self, msg: AppMessage, *buffers: bytes | memoryview) -> None:
        """Send one message; waits for flow-control credit. Cancellation-safe before the send starts."""
        ...

    async def recv(self, lane: Lane | None = None) -> Message:
        """The next message of ``lane`` (None: either, control first); raises `TransportClosed` (with
        the reason) once closed."""
        ...

    async def close(self, reason: str = "closed") -> None: ...

    def fault(self, reason: str) -> None:
        """The peer sent something malformed or out of place: counted, logged (throttled) and dropped;
        a peer that keeps at it has its channel closed."""
        ...

    def abort(self, reason: str) -> None:
        """Close now, telling the peer if that can be done without waiting."""
        ...

    async def wait_closed(self) -> None:
        """Until the channel is closed (any cause)."""
        ...


class Transport(Protocol):
    """A node's side of one kind of link: dial peers by node id and address, accept the
    peers that dial in. Channels come out of `connect` and `accept`."""

    node_id: str

    async def start_in(self, tg: asyncio.TaskGroup) -> str:
        """Start the transport's tasks in ``tg`` (their owner) and, if it has an address to listen at,
        bind it: returns the address it listens at ("" without one). One shape for every transport."""
        ...

    async def connect(self, peer: str, address: str) -> Channel:
        """A channel to ``peer`` at ``address`` (a ``tcp://`` endpoint for ZeroMQ; the node id of
        a rendezvous for WebRTC). Raises `TransportClosed` if it cannot be reached."""
        ...

    async def accept(self) -> Channel:
        """The next channel a peer opened to this node (or reopened after a restart)."""
        ...

    async def close(self) -> None: ...


def check_timings(heartbeat_s: float, suspect_after_s: float, lost_after_s: float) -> None:
    """Cross-field check for link configs (the liveness machine's own rule, as a `ConfigError`)."""
    problem = timing_problem(heartbeat_s, suspect_after_s, lost_after_s)
    if problem is not None:
        raise ConfigError(problem)


def new_incarnation() -> int:
    """A number that grows across restarts of a process: microseconds of wall-clock time."""
    # Wall-clock time on purpose, not the node's `Clock`: a monotonic clock (and a virtual one) starts
    # again from an arbitrary point with each process, so only wall time grows across restarts. It is
    # a name for this run of the process, compared with the peer's last one; nothing waits for it.
    return time.time_ns() // 1000


def check_frame(buffers: Sequence[bytes | memoryview], max_frame_bytes: int, peer: str) -> None:
    n = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
    if n > max_frame_bytes:
        raise FrameTooLarge(
            f"message of {n} bytes to {peer!r} exceeds max_frame_bytes={max_frame_bytes}; "
            "send large payloads through the bulk layer"
        )
