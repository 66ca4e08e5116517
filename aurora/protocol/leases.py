"""Work leases: `LeaseTable` (coordinator side) and `LeaseHolder` (worker side).

A work item is handed out as a `Lease` with a TTL and a *fencing token*: an
opaque byte string minted fresh for every grant (by default a 16-byte counter
that only grows; a coordinator facing the network mints 128 random bits, so a
token cannot be guessed). The holder renews it while working and returns the
result with the token.

Invariants (each has a property test in tests/test_protocol_*.py):

* At any instant an item has at most one valid lease: the table keeps one
  current lease per item, and a grant or re-grant always mints a new token
  (a minted token that was ever used before is refused: `ValueError`).
* A result is accepted only under the item's current, unexpired lease and
  from its holder; a late result from an expired or fenced holder is
  rejected, and an item is accepted at most once (``done``).
* An expired lease returns its item to the front of the pool; so does a lease
  whose result the coordinator cannot use (`release`). The TTL is the only loss
  detector: a worker talks to the coordinator through relays, so no link of the
  coordinator's says that a worker is gone (one whose relay is lost attaches
  elsewhere and goes on renewing under the same tokens).
* A lease has a lifetime bound: renewals never carry it past ``granted_at +``
  `life_s`, which is derived from the work it covers — ``life_factor`` times
  what the holder's measured rate says its held prompts take, clamped to
  [2 TTL, ``max_life_s``] (``max_life_s`` while the holder is unmeasured, 2 TTL
  once one of its leases lapsed and until it delivers again). A
  worker that renews without answering (a hoarder) loses the lease at that
  bound, and a lease that expires unanswered resets its holder's measured
  rate, so its next grants are the floor until it delivers again: a worker's
  leases are bounded by what it delivers (docs/security.md).
* Work is shared by measured throughput: a grant gives a worker
  ``clamp(ceil(rate * batch_s), floor, max_batch)`` items minus what it holds,
  where ``rate`` is an EMA of its accepted results per second; a worker with no
  measurement yet gets ``floor`` items so that it gets measured.

No clock reads: every method takes ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

Item = Hashable

MAX_LIFE_TTLS = 8
"""A lease's lifetime bound while its holder is unmeasured, in TTLs (the default ``max_life_s``): long
enough for a first batch of several TTLs (tests/test_simulation.py's slow worker takes 5)."""
LIFE_FACTOR = 4.0
"""A measured holder's lease may live this many times what its rate says its held prompts take."""


Token = bytes


def counter_tokens(first: int = 1) -> Callable[[], Token]:
    """A deterministic mint: 16-byte big-endian counts from ``first`` (sorted as they grow)."""
    state = [first]

    def mint() -> Token:
        state[0] += 1
        return (state[0] - 1).to_bytes(16, "big")

    return mint


@dataclass(frozen=True, slots=True)
class Lease:
    item: Item
    worker: str
    token: Token
    granted_at: float
    expires_at: float

    @property
    def ttl_s(self) -> float:
        return self.expires_at - self.granted_at


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    lease: Lease


@dataclass(frozen=True, slots=True)
class ResultAccepted:
    lease: Lease
    at: float


@dataclass(frozen=True, slots=True)
class ResultRejected:
    item: Item
    worker: str
    token: Token
    reason: str
    """'expired', 'fenced', 'duplicate', 'unknown' or 'not-holder'."""


@dataclass(frozen=True, slots=True)
class LeaseReleased:
    lease: Lease


LeaseEvent = LeaseExpired
"""What the table queues for `events()`: only what happens by itself (a TTL passing). Completing,
renewing and releasing return their outcome to the caller instead."""


@dataclass(slots=True)
class _Worker:
    rate: float | None = None
    last_accept: float | None = None
    held: set[Item] = field(default_factory=set)
    lapsed: bool = False
    """A lease of this worker expired unanswered since its last accepted result."""


class LeaseTable:
    def __init__(
        self,
        *,
        ttl_s: float = 30.0,
        floor: int = 1,
        max_batch: int = 64,
        batch_s: float = 10.0,
        ema_alpha: float = 0.3,
        mint: Callable[[], Token] | None = None,
        max_life_s: float | None = None,
        life_factor: float = LIFE_FACTOR,
    ) -> None:
        if ttl_s <= 0 or floor < 1 or max_batch < floor or not 0 < ema_alpha <= 1:
            raise ValueError("need ttl_s > 0, 1 <= floor <= max_batch, 0 < ema_alpha <= 1")
        self.max_life_s = MAX_LIFE_TTLS * ttl_s if max_life_s is None else max_life_s
        if self.max_life_s < 2 * ttl_s or life_factor < 1:
            raise ValueError("need max_life_s >= 2 * ttl_s and life_factor >= 1")
        self.life_factor = life_factor
        self.ttl_s = ttl_s
        self.floor = floor
        self.max_batch = max_batch
        self.batch_s = batch_s
        self.ema_alpha = ema_alpha
        self._pool: deque[Item] = deque()
        self._known: set[Item] = set()
        self._current: dict[Item, Lease] = {}
        self._done: set[Item] = set()
        self._workers: dict[str, _Worker] = {}
        self._mint = mint or counter_tokens()
        """Fresh tokens: a coordinator that restarts must not mint its old ones again (random ones do not)."""
        self._past: dict[Item, set[Token]] = {}
        """Per item still open, the tokens of its earlier leases (a result under one is 'fenced')."""
        self._events: list[LeaseEvent] = []

    # ------------------------------------------------------------------ inputs
    def add_items(self, items: Iterable[Item]) -> None:
        for it in items:
            if it in self._known:
                raise ValueError(f"item {it!r} was already added")
            self._known.add(it)
            self._pool.append(it)

    def quota(self, worker: str) -> int:
        """How many more items ``worker`` may hold now."""
        w = self._workers.setdefault(worker, _Worker())
        if w.rate is None:
            target = self.floor
        else:
            target = min(self.max_batch, max(self.floor, math.ceil(w.rate * self.batch_s)))
        return max(0, target - len(w.held))

    def grant(self, worker: str, now: float, want: int | None = None) -> list[Lease]:
        """Lease up to ``min(want, quota)`` pooled items to ``worker``."""
        self.tick(now)
        n = self.quota(worker) if want is None else min(want, self.quota(worker))
        w = self._workers[worker]
        out: list[Lease] = []
        while self._pool and len(out) < n:
            it = self._pool.popleft()
            token = self._mint()
            if token in self._past.get(it, ()):
                raise ValueError("the token mint repeated a token")
            lease = Lease(it, worker, token, now, now + self.ttl_s)
            self._current[it] = lease
            w.held.add(it)
            out.append(lease)
        return out

    def renew(self, worker: str, tokens: Iterable[Token], now: float) -> list[Lease]:
        """Extend the named, still-valid leases of ``worker`` by a TTL from ``now``, but never past their
        lifetime bound (`life_s`); returns the leases renewed (one at its bound is not)."""
        self.tick(now)
        wanted = set(tokens)
        w = self._workers.get(worker, _Worker())
        life_s = self.life_s(worker)
        out = []
        for it in list(w.held):
            cur = self._current.get(it)
            if cur is not None and cur.token in wanted and cur.worker == worker:
                expires_at = min(now + self.ttl_s, cur.granted_at + life_s)
                if expires_at <= cur.expires_at:
                    continue  # at its lifetime bound: it ends when it expires
                new = Lease(it, worker, cur.token, cur.granted_at, expires_at)
                self._current[it] = new
                out.append(new)
        return out

    def life_s(self, worker: str) -> float:
        """How long a lease of ``worker``'s may live from its grant (the lifetime bound of the invariants)."""
        w = self._workers.get(worker)
        if w is not None and w.lapsed and w.rate is None:
            return 2 * self.ttl_s  # it let a lease lapse: no more slack until it delivers again
        if w is None or w.rate is None or w.rate <= 0:
            return self.max_life_s
        expected_s = max(1, len(w.held)) / w.rate
        return min(self.max_life_s, max(2 * self.ttl_s, self.life_factor * expected_s))

    def complete(self, worker: str, item: Item, token: Token, now: float) -> ResultAccepted | ResultRejected:
        """Offer a result; its outcome (see the invariants)."""
        self.tick(now)
        reason = self._reject_reason(worker, item, token, now)
        if reason is not None:
            return ResultRejected(item, worker, token, reason)
        lease = self._current.pop(item)
        self._done.add(item)
        self._past.pop(item, None)
        w = self._workers[worker]
        w.held.discard(item)
        if w.last_accept is not None and now > w.last_accept:
            sample = 1.0 / (now - w.last_accept)
            w.rate = sample if w.rate is None else (1 - self.ema_alpha) * w.rate + self.ema_alpha * sample
        elif w.rate is None and now > lease.granted_at:
            w.rate = 1.0 / (now - lease.granted_at)
        w.last_accept = now
        w.lapsed = False
        return ResultAccepted(lease, now)

    def _reject_reason(self, worker: str, item: Item, token: Token, now: float) -> str | None:
        if item in self._done:
            return "duplicate"
        if item not in self._known:
            return "unknown"
        cur = self._current.get(item)
        if cur is None:
            return "expired" if token in self._past.get(item, ()) else "unknown"
        if cur.token != token:
            return "fenced" if token in self._past.get(item, ()) else "unknown"
        if cur.worker != worker:
            return "not-holder"
        if now >= cur.expires_at:
            return "expired"
        return None

    def release(self, worker: str, item: Item, token: Token, now: float) -> LeaseReleased | ResultRejected:
        """Give ``item`` back (its result is unusable, e.g. too stale): if ``worker`` holds its current
        lease, the lease ends now and the item returns to the front of the pool, to be leased anew."""
        self.tick(now)
        reason = self._reject_reason(worker, item, token, now)
        if reason is not None:
            return ResultRejected(item, worker, token, reason)
        lease = self._current[item]
        self._end(item, lease)
        return LeaseReleased(lease)

    def tick(self, now: float) -> None:
        """Expire leases whose TTL (or lifetime bound) passed; their items go back to the front of the
        pool, and their holders' measured rates are reset (they did not deliver)."""
        for it, lease in list(self._current.items()):
            if now >= lease.expires_at:
                self._end(it, lease)
                w = self._workers.get(lease.worker)
                if w is not None:
                    w.rate = w.last_accept = None
                    w.lapsed = True
                self._events.append(LeaseExpired(lease))

    def revoke(self, worker: str, now: float) -> None:
        """``worker`` is gone (a pool member that left): its leases end now as if they had expired —
        their items go back to the front of the pool, and `events` reports each `LeaseExpired`."""
        self.tick(now)
        for it, lease in list(self._current.items()):
            if lease.worker == worker:
                self._end(it, lease)
                self._events.append(LeaseExpired(lease))
        self._workers.pop(worker, None)

    def _end(self, it: Item, lease: Lease) -> None:
        del self._current[it]
        self._past.setdefault(it, set()).add(lease.token)
        w = self._workers.get(lease.worker)
        if w is not None:
            w.held.discard(it)
        self._pool.appendleft(it)

    # ------------------------------------------------------------------ outputs
    def events(self) -> list[LeaseEvent]:
        """The leases that expired since the last call."""
        out, self._events = self._events, []
        return out

    def next_deadline(self) -> float | None:
        return min((lease.expires_at for lease in self._current.values()), default=None)

    def current(self, item: Item) -> Lease | None:
        return self._current.get(item)

    def valid_leases(self, now: float) -> list[Lease]:
        """The leases not expired at ``now``: the table's invariant, at most one per item and none for
        an item done, is stated over these (the property tests read it; the drivers need only events)."""
        return [lease for lease in self._current.values() if now < lease.expires_at]

    def holds(self, worker: str) -> int:
        """How many leases ``worker`` holds now."""
        w = self._workers.get(worker)
        return 0 if w is None else len(w.held)

    def rate(self, worker: str) -> float | None:
        w = self._workers.get(worker)
        return None if w is None else w.rate

    @property
    def pending(self) -> int:
        return len(self._pool)

    @property
    def in_flight(self) -> int:
        return len(self._current)

    @property
    def done(self) -> frozenset[Item]:
        return frozenset(self._done)

    @property
    def finished(self) -> bool:
        return len(self._done) == len(self._known)


@dataclass(frozen=True, slots=True)
class HeldLease:
    lease: Lease
    local_expiry: float
    """When this holder must stop counting on the lease, in its own clock."""


@dataclass(frozen=True, slots=True)
class LocalLeaseExpired:
    lease: Lease


class LeaseHolder:
    """Worker side: track leases by local time, renew before expiry, stop working after it.

    The holder computes expiry from *its* receive time and the lease's TTL minus
    ``safety_s``, so clock offsets between nodes do not matter; a network delay
    only makes it give up earlier than the table would.
    """

    def __init__(self, worker: str, *, renew_fraction: float = 0.5, safety_s: float = 0.0) -> None:
        self.worker = worker
        self.renew_fraction = renew_fraction
        self.safety_s = safety_s
        self._held: dict[Item, HeldLease] = {}
        self._renew_sent: dict[Item, float] = {}
        self._events: list[LocalLeaseExpired] = []

    def on_granted(self, leases: Iterable[Lease], now: float) -> None:
        for lease in leases:
            self._held[lease.item] = HeldLease(lease, now + lease.ttl_s - self.safety_s)
            self._renew_sent.pop(lease.item, None)

    def on_renewed(self, leases: Iterable[Lease], now: float) -> list[float]:
        """The coordinator renewed ``leases``; returns each renewal's round trip (seconds from when
        `renewals_due` asked for it), for the held leases whose renewal it answers."""
        rtts = []
        for lease in leases:
            if lease.item in self._held and self._held[lease.item].lease.token == lease.token:
                sent = self._renew_sent.get(lease.item)
                if sent is not None:
                    rtts.append(now - sent)
                self.on_granted([Lease(lease.item, lease.worker, lease.token, now, now + lease.ttl_s)], now)
        return rtts

    def renewals_due(self, now: float) -> list[Token]:
        """Tokens to renew now (each asked once per lease period)."""
        out = []
        for it, h in self._held.items():
            start = h.local_expiry - (h.lease.ttl_s - self.safety_s)
            due = start + (h.local_expiry - start) * self.renew_fraction
            if now >= due and it not in self._renew_sent:
                self._renew_sent[it] = now
                out.append(h.lease.token)
        return out

    def tick(self, now: float) -> None:
        for it, h in list(self._held.items()):
            if now >= h.local_expiry:
                del self._held[it]
                self._renew_sent.pop(it, None)
                self._events.append(LocalLeaseExpired(h.lease))

    def take(self, item: Item) -> Lease | None:
        """Finish ``item``: the lease to send its result under (None if no longer held)."""
        h = self._held.pop(item, None)
        self._renew_sent.pop(item, None)
        return None if h is None else h.lease

    def drop_all(self) -> list[Lease]:
        """Forget everything (crash/restart): leases are the coordinator's to reclaim."""
        out = [h.lease for h in self._held.values()]
        self._held.clear()
        self._renew_sent.clear()
        return out

    def events(self) -> list[LocalLeaseExpired]:
        out, self._events = self._events, []
        return out

    def next_deadline(self) -> float | None:
        cands = []
        for it, h in self._held.items():
            cands.append(h.local_expiry)
            if it not in self._renew_sent:
                start = h.local_expiry - (h.lease.ttl_s - self.safety_s)
                cands.append(start + (h.local_expiry - start) * self.renew_fraction)
        return min(cands, default=None)

    @property
    def items(self) -> list[Item]:
        return list(self._held)

    def lease(self, item: Item) -> Lease | None:
        h = self._held.get(item)
        return None if h is None else h.lease
