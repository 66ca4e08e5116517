"""`PeerLiveness`: heartbeats out, silence in, as a pure state machine.

Inputs: `add_peer`, `on_heartbeat(peer, incarnation, now)`, `tick(now)`.
Outputs: `messages_to_send()` (heartbeats due), `events()` (`PeerSuspected`,
`PeerLost`, `PeerRecovered`, `PeerRejoined`), `next_deadline()`.

Rules and invariants:

* Heartbeats to each peer are sent every ``interval_s`` scaled by a factor drawn
  uniformly from ``[1 - jitter, 1 + jitter]`` (a seeded RNG: replays exactly).
* A peer silent for ``suspect_after_s`` is suspected; for ``lost_after_s`` it is
  lost (``suspect_after_s < lost_after_s``). Each event is emitted once per
  silence. A live peer whose heartbeats arrive at most ``suspect_after_s`` apart
  is never suspected or lost.
* A heartbeat from a suspected peer recovers it (same incarnation). A heartbeat
  from a lost peer, or one carrying a new incarnation, makes it a *new
  incarnation* here: `PeerRejoined` with a fresh local incarnation number, so any
  state tied to the old one (leases, routes) can be fenced.
* Heartbeats with an older incarnation than the one known are ignored.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class PeerState(enum.Enum):
    ALIVE = "alive"
    SUSPECTED = "suspected"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Wire message: ``sender`` is alive in ``incarnation``; ``seq`` counts heartbeats sent."""

    sender: str
    incarnation: int
    seq: int


@dataclass(frozen=True, slots=True)
class PeerSuspected:
    peer: str
    silent_s: float


@dataclass(frozen=True, slots=True)
class PeerLost:
    peer: str
    silent_s: float
    incarnation: int


@dataclass(frozen=True, slots=True)
class PeerRecovered:
    peer: str


@dataclass(frozen=True, slots=True)
class PeerRejoined:
    peer: str
    incarnation: int
    """The new local incarnation number of the peer."""


LivenessEvent = PeerSuspected | PeerLost | PeerRecovered | PeerRejoined


@dataclass(slots=True)
class _Peer:
    last_heard: float
    next_send: float
    remote_incarnation: int
    incarnation: int
    state: PeerState = PeerState.ALIVE


DEFAULT_JITTER = 0.1
"""Heartbeat intervals are jittered by up to this fraction (spreads peers' beats apart)."""


def timing_problem(
    interval_s: float, suspect_after_s: float, lost_after_s: float, jitter: float = DEFAULT_JITTER
) -> str | None:
    """Why these liveness timings cannot work (a beat must arrive well inside the
    suspicion bound), or None. Every config that carries timings checks with this."""
    if not 0 < interval_s * (1 + jitter) < suspect_after_s < lost_after_s:
        return (
            f"need interval_s*(1+jitter) < suspect_after_s < lost_after_s, got interval_s={interval_s}, "
            f"jitter={jitter}, suspect_after_s={suspect_after_s}, lost_after_s={lost_after_s}"
        )
    return None


class PeerLiveness:
    def __init__(
        self,
        me: str,
        *,
        incarnation: int = 0,
        interval_s: float = 1.0,
        jitter: float = DEFAULT_JITTER,
        suspect_after_s: float = 3.0,
        lost_after_s: float = 6.0,
        seed: int = 0,
    ) -> None:
        if not 0 <= jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        problem = timing_problem(interval_s, suspect_after_s, lost_after_s, jitter)
        if problem is not None:
            raise ValueError(problem)
        self.me = me
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.jitter = jitter
        self.suspect_after_s = suspect_after_s
        self.lost_after_s = lost_after_s
        self._rng = random.Random(seed)
        self._peers: dict[str, _Peer] = {}
        self._out: list[tuple[str, Heartbeat]] = []
        self._events: list[LivenessEvent] = []
        self._seq = 0

    # ------------------------------------------------------------------ inputs
    def add_peer(self, peer: str, now: float) -> None:
        """Start watching ``peer`` (counts as heard from now) and heartbeating it."""
        if peer not in self._peers:
            self._peers[peer] = _Peer(last_heard=now, next_send=now, remote_incarnation=-1, incarnation=0)

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        p = self._peers.get(hb.sender)
        if p is None:
            return
        if hb.incarnation < p.remote_incarnation:
            return  # a stale heartbeat from an old incarnation
        new_remote = p.remote_incarnation >= 0 and hb.incarnation > p.remote_incarnation
        p.remote_incarnation = hb.incarnation
        p.last_heard = max(p.last_heard, now)
        if p.state is PeerState.LOST or new_remote:
            p.incarnation += 1
            p.state = PeerState.ALIVE
            self._events.append(PeerRejoined(hb.sender, p.incarnation))
        elif p.state is PeerState.SUSPECTED:
            p.state = PeerState.ALIVE
            self._events.append(PeerRecovered(hb.sender))

    def heard(self, peer: str, now: float) -> None:
        """Any traffic from ``peer`` counts as a sign of life (a lost peer must heartbeat to rejoin)."""
        p = self._peers.get(peer)
        if p is None or p.state is PeerState.LOST:
            return
        p.last_heard = max(p.last_heard, now)
        if p.state is PeerState.SUSPECTED:
            p.state = PeerState.ALIVE
            self._events.append(PeerRecovered(peer))

    def tick(self, now: float) -> None:
        """Advance to ``now``: queue due heartbeats, turn silence into events."""
        for name, p in self._peers.items():
            if now >= p.next_send:
                self._seq += 1
                self._out.append((name, Heartbeat(self.me, self.incarnation, self._seq)))
                factor = 1 + self._rng.uniform(-self.jitter, self.jitter)
                p.next_send = now + self.interval_s * factor
            # Compare against the same sums next_deadline() returns: (a + b) - a != b in floats,
            # and a deadline that tick() does not honour would spin its driver.
            silent = now - p.last_heard
            if p.state is PeerState.ALIVE and now >= p.last_heard + self.suspect_after_s:
                p.state = PeerState.SUSPECTED
                self._events.append(PeerSuspected(name, silent))
            if p.state is PeerState.SUSPECTED and now >= p.last_heard + self.lost_after_s:
                p.state = PeerState.LOST
                self._events.append(PeerLost(name, silent, p.incarnation))

    # ------------------------------------------------------------------ outputs
    def messages_to_send(self) -> list[tuple[str, Heartbeat]]:
        out, self._out = self._out, []
        return out

    def events(self) -> list[LivenessEvent]:
        out, self._events = self._events, []
        return out

    def next_deadline(self) -> float | None:
        """Earliest time `tick` has something to do."""
        best: float | None = None
        for p in self._peers.values():
            cands = [p.next_send]
            if p.state is PeerState.ALIVE:
                cands.append(p.last_heard + self.suspect_after_s)
            elif p.state is PeerState.SUSPECTED:
                cands.append(p.last_heard + self.lost_after_s)
            m = min(cands)
            best = m if best is None else min(best, m)
        return best

    def state(self, peer: str) -> PeerState:
        return self._peers[peer].state

    def peer_incarnation(self, peer: str) -> int:
        return self._peers[peer].incarnation

    def remote_incarnation(self, peer: str) -> int | None:
        """The newest incarnation ``peer`` has announced (None: not watched, or not heard yet)."""
        p = self._peers.get(peer)
        return None if p is None or p.remote_incarnation < 0 else p.remote_incarnation

    @property
    def peers(self) -> list[str]:
        return list(self._peers)
