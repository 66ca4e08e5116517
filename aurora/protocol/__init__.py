"""Sans-IO protocol machines: no asyncio, no sockets, no clock reads, no logging.

Each machine takes messages and ``now`` and returns messages to send, events,
and its next deadline; its module docstring states its invariants.
"""

from aurora.protocol.leases import (
    Lease,
    LeaseExpired,
    LeaseHolder,
    LeaseTable,
    LocalLeaseExpired,
    ResultAccepted,
    ResultRejected,
)
from aurora.protocol.liveness import (
    Heartbeat,
    PeerLiveness,
    PeerLost,
    PeerRecovered,
    PeerRejoined,
    PeerState,
    PeerSuspected,
)
from aurora.protocol.restart import RestartBudget

__all__ = [
    "Heartbeat",
    "Lease",
    "LeaseExpired",
    "LeaseHolder",
    "LeaseTable",
    "LocalLeaseExpired",
    "PeerLiveness",
    "PeerLost",
    "PeerRecovered",
    "PeerRejoined",
    "PeerState",
    "PeerSuspected",
    "RestartBudget",
    "ResultAccepted",
    "ResultRejected",
]
