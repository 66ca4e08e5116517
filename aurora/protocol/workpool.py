"""`WorkPool`: the trainer's coordinator as a value — leasing, staleness, parking, and result rules.

Inputs (each with ``now``): `want` (a worker can take prompts, generating with a
version), `renew`, `result`, `take` (the learner wants a batch), `expire`; `handle`
takes the workers' messages themselves (`Want`, `Renew`, `Result`) and answers with
the message that goes back (`Grant`, `Renewed`, `Verdict`) and a result's outcome.
Outputs: what each call returns (grants, verdicts as values, a batch or None),
lease expiries from `expire`, `next_deadline()`. No clock, no I/O, no logging: the
`aurora.actors.work.Coordinator` drives it, and `aurora.testing.leasesim` simulates it.
The worker's side of the same messages, for the worker and the simulation alike: `leases_in`
(a grant or renewal as held leases) and `renew_messages`.

Rules and invariants (tests/test_workpool.py holds it to them):

* a result is accepted at most once per prompt, only under its current lease
  (`LeaseTable`), only from the worker holding it, and only if it passes the
  result rules — the group size asked for; every token id in the vocabulary;
  each sample 1..``max_new_tokens`` tokens long; behaviour log-probabilities
  finite and in [``min_logprob``, 0]; a version label within [current −
  ``max_stale``, current] — and a rejection is a `Rejected` value with its reason;
  a too-stale result gives its prompt back to the pool to be generated again;
* the learner trains on what the trainer can check: a completion's prompt is the
  trainer's own tokenization of the leased prompt (never the worker's), and its
  samples are exactly the token ids the worker returned (texts are decoded from
  them by the learner);
* the learner takes accepted results oldest version first, and never one that
  has become more than ``max_stale`` versions older than the version it trains from;
* work is leased for what the learner will train on, not for rollouts that would go
  stale in the pool: with a learner batch of B prompts, leased plus accepted-but-not-
  taken prompts stay within ``leases.ahead_steps`` × B, and a worker on version u gets
  work only while the learner's takes that may still use u's results (its next one up
  to u + ``max_stale``, never past the run's last) want more than the results, accepted
  or in flight, of versions up to u that they would take first. A ``want`` refused for
  either reason is parked and answered by `unpark` when room opens; a parked want older
  than half a lease TTL (at least 2 s) is from a worker that stopped asking, and lapses
  (its age counts from when the worker asked, however often `unpark` retried it);
* work is divided by speed, not raced for: each worker's speed is timed lease by lease
  (`aurora.protocol.speed.SpeedMeter`: prompts per second with a full lease), and a grant is this
  worker's part of the prompts that may be leased now (the room and the version's takes, above)
  among the workers waiting for work — this one, those parked with a version whose results would be
  used (or, for `ABOUT_TO_ASK_S` after a new version came, one that was of use before it: switching),
  those not parked that hold nothing and asked or had a lease's result taken within `ABOUT_TO_ASK_S`
  (between batches), and, where this worker's time grows with its prompts, those its speed says
  will be done before it would be with a full lease — given prompt by prompt to the one whose
  credit (work granted, in seconds at its speed) would end soonest. A worker whose credit leads the
  least served's among the workers at work (those that delivered a result lately: not one that
  only asks, or only holds leases) by over half a lease holds at most its speed's share of the
  ``ahead_steps`` bound. So each one's share of the work follows its speed whether generation or the
  learner sets the pace (`aurora bench leases`: within 10 % of the speeds' shares in every case it
  runs);
* `next_deadline()` is when `expire` or `unpark` next changes something by itself (a lease
  expires, a parked want lapses, a worker leaves the waiting window while a want is parked): a
  driver that sleeps until then never spins;
* prompts' answers stay in the pool (rewards are the trainer's to compute).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from aurora.protocol.leases import Lease, LeaseExpired, LeaseTable, ResultRejected, Token
from aurora.protocol.messages import (
    MAX_LEASES,
    MAX_REASON_CHARS,
    Grant,
    LeaseGrant,
    LeaseRenewal,
    Renew,
    Renewed,
    Result,
    Verdict,
    Want,
)
from aurora.protocol.speed import SpeedMeter
from aurora.rl.types import Completion, Prompt, Sample

ABOUT_TO_ASK_S = 5.0
"""A worker that holds no lease counts as about to ask for work this long after it last asked or
returned a result (between batches, or switching to a new version: about 2 s on the development
machine's CPU). Capped at the lapse time of a parked want."""

MIN_BEHAVIOUR_LOGPROB = -50.0
"""A sampled token had at least this log-probability under the weights that sampled it (e^-50 ≈ 2e-22:
no sampler picks such a token); a lower one is a lie that would blow up the importance ratio."""


def leases_in(msg: Grant | Renewed, worker: str, now: float) -> list[Lease]:
    """The worker's side of a `Grant` or `Renewed`: its leases as ``worker`` holds them, each TTL
    counted from ``now``, when it arrived (the `LeaseHolder` is given these)."""
    return [Lease(x.item, worker, x.token, now, now + x.ttl_s) for x in msg.leases]


def renew_messages(worker: str, tokens: Sequence[Token]) -> list[Renew]:
    """``tokens`` due for renewal (`LeaseHolder.renewals_due`), as `Renew` messages of at most
    `MAX_LEASES` each."""
    return [Renew(w=worker, tokens=list(tokens[i : i + MAX_LEASES])) for i in range(0, len(tokens), MAX_LEASES)]


@dataclass(frozen=True, slots=True)
class ResultRules:
    """What a result must satisfy besides its lease."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    max_new_tokens: int
    """A sample has 1..max_new_tokens tokens."""
    min_logprob: float = MIN_BEHAVIOUR_LOGPROB


@dataclass(frozen=True, slots=True)
class Accepted:
    prompt: Prompt
    completion: Completion


@dataclass(frozen=True, slots=True)
class Rejected:
    kind: str
    """A short reason ('stale', 'malformed', 'expired', 'fenced', ...): what the counters count."""
    reason: str
    """What was wrong, for the log and the worker."""


@dataclass(frozen=True, slots=True)
class SampleIn:
    """A sample as a worker returned it (token ids, behaviour log-probabilities, version spans)."""

    tokens: Sequence[int]
    logprobs: Sequence[float]
    spans: Sequence[tuple[int, int]] = ()


@dataclass(frozen=True, slots=True)
class Answer:
    """What `WorkPool.handle` makes of one work message."""

    reply: Grant | Renewed | Verdict | None
    """The message back to the worker (None: none — a want parked, no lease renewed)."""
    outcome: Accepted | Rejected | None = None
    """A result's verdict as a value (None for a want or a renewal)."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    ttl_s: float
    prompts_per_lease: int
    batch_s: float
    ahead_steps: int
    max_stale: int
    max_life_s: float | None = None
    """A lease's lifetime bound while its holder is unmeasured (None: `LeaseTable`'s default, 8 TTLs)."""


@dataclass
class WorkPool:
    """The coordinator's state (see the module docstring). Outlives actor restarts."""

    settings: PoolSettings
    prompts: Iterator[Prompt]
    """The task's prompts, each already tokenized by the trainer (``tokens`` set)."""
    rules: ResultRules
    group_size: int = 1
    batch: int = 0
    """The learner's prompts per step (0: it does not take batches; leasing is not bounded)."""
    steps: int | None = None
    """The run's versions: the learner's last take is at ``steps - 1`` (None: no end)."""
    mint: Callable[[], Token] | None = None
    """Lease tokens (default: a counter; a node mints 128 random bits)."""
    table: LeaseTable = field(init=False)
    open: dict[int, Prompt] = field(default_factory=dict)
    samples: list[tuple[Prompt, Completion]] = field(default_factory=list)
    accepted: int = 0
    dropped_stale: int = 0
    """Accepted results that grew too stale before the learner took them."""
    last_dropped: list[int] = field(default_factory=list)
    """The prompt ids of the results the last `take` dropped as too stale (a driver journals them)."""
    rejected: Counter[str] = field(default_factory=Counter)
    log: deque[tuple[int, str, int, int]] = field(default_factory=lambda: deque(maxlen=100_000))
    """Recent acceptances: (prompt id, worker, result's version, trainer's version then)."""
    made_with: dict[int, int | None] = field(default_factory=dict)
    """Per leased prompt, the version its worker said it generates with (stale entries, of
    prompts no longer in flight, are pruned as they are met)."""
    taken_at: int | None = None
    """The learner's version at its last take (its next take is at the next version); None
    before the first take of this coordinator."""
    parked: dict[str, tuple[int, int | None, float]] = field(default_factory=dict)
    """Workers whose ``want`` got nothing: worker -> (prompts asked for, their version, when)."""
    asked: dict[str, float] = field(default_factory=dict)
    """When each worker last asked for work or returned a result (`_split`: who is waiting for some)."""
    version_seen: int | None = None
    """The trainer's version as the pool was last told it."""
    switching_until: float | None = None
    """Until when, after that version came, a worker parked with an older one counts as switching to
    it (`_waiting`); None once over."""
    granted_at: dict[str, float] = field(default_factory=dict)
    """When each worker was last granted prompts (`_finishing`: when it will ask again)."""
    delivered: dict[str, float] = field(default_factory=dict)
    """When each worker last had a result accepted (`_active`: who is at work)."""
    speeds: SpeedMeter = field(init=False)
    """Each worker's generation speed, timed lease by lease (`_split` divides work by it)."""
    credit: dict[str, float] = field(default_factory=dict)
    """Per worker, the work it was granted in seconds at its speed (`_split` gives the next prompt to
    the worker whose credit would end soonest with it: shares follow speed)."""

    def __post_init__(self) -> None:
        s = self.settings
        self.table = LeaseTable(
            ttl_s=s.ttl_s, max_batch=s.prompts_per_lease, batch_s=s.batch_s, mint=self.mint, max_life_s=s.max_life_s
        )
        self.speeds = SpeedMeter(full=max(1, s.prompts_per_lease))

    @property
    def max_stale(self) -> int:
        return self.settings.max_stale

    def room(self) -> int | None:
        """Prompts that may still be leased under the ``ahead_steps`` bound (None: unbounded)."""
        if not self.batch or not self.settings.ahead_steps:
            return None
        return max(0, self.settings.ahead_steps * self.batch - self.table.in_flight - len(self.samples))

    def _useful(self, version: int | None, current: int) -> bool:
        """Would results of ``version`` be trained on? (The leasing rule of the module docstring.)"""
        more = self._wanted(version, current)
        return more is None or more > 0

    def _wanted(self, version: int | None, current: int) -> int | None:
        """How many more prompts of ``version`` the learner's takes would use (None: no bound)."""
        if not self.batch or version is None:
            return None
        # the learner takes once per version: next at the version after its last take (it may
        # already be training on that take while the version before is still being published)
        first = current if self.taken_at is None else max(current, self.taken_at + 1)
        last = version + self.max_stale if self.steps is None else min(version + self.max_stale, self.steps - 1)
        takes = last - first + 1
        if takes <= 0:
            return 0
        supply = sum(1 for v in self._supply(current) if first - self.max_stale <= v <= version)
        return max(0, takes * self.batch - supply)

    def _supply(self, current: int) -> Iterator[int]:
        """The versions of the results the learner will be offered: accepted ones, then those in
        flight (a worker that named no version counts as on ``current``)."""
        for _, c in self.samples:
            yield c.version
        for item, v in list(self.made_with.items()):
            if self.table.current(item) is None:
                del self.made_with[item]
            else:
                yield current if v is None else v

    def want(
        self, worker: str, n: int, now: float, version: int | None = None, current: int = 0
    ) -> list[tuple[Lease, Prompt]]:
        """Grant up to ``n`` prompts to a worker generating with ``version`` while the trainer is
        at ``current``; a want that gets nothing is parked until `unpark`."""
        return self._want(worker, n, now, version, current, asked_at=now)

    def _want(
        self, worker: str, n: int, now: float, version: int | None, current: int, asked_at: float
    ) -> list[tuple[Lease, Prompt]]:
        asked = max(0, min(n, self.settings.prompts_per_lease))
        room = self.room()
        wanted = self._wanted(version, current)
        free = room if wanted is None else (wanted if room is None else min(room, wanted))
        n = asked if free is None else min(asked, self._split(worker, free, now, current))
        self.asked[worker] = max(asked_at, self.asked.get(worker, asked_at))
        self.parked.pop(worker, None)
        if n and room is not None and self._ahead(worker, now):  # got more than its speed's share: hold it to that
            n = min(n, self._fair_hold(worker, now) - self.table.holds(worker))
            if n <= 0:
                return []  # it holds its share already, and asks again as it delivers (not parked: not idle)
        if n == 0:
            if asked:
                self.parked[worker] = (asked, version, asked_at)
            return []
        while self.table.pending < n:  # the pool is endless: top it up on demand
            p = next(self.prompts)
            self.open[p.id] = p
            self.table.add_items([p.id])
        held = self.table.holds(worker)
        granted = self.table.grant(worker, now, n)
        if not granted:
            return []  # at its quota (`LeaseTable.quota`): it asks again as it delivers
        self.granted_at[worker] = now
        # it starts on them at once if it holds nothing else, or (a continuous worker) if it asked for them
        # with room for them beside what it runs
        at_once = not held or held + asked <= self.settings.prompts_per_lease
        self.speeds.granted(worker, [lease.item for lease in granted], now, at_once)
        self.credit[worker] = self.credit.get(worker, 0.0) + len(granted) / self._speeds([worker])[worker]
        if self.batch:  # only `_useful` reads it (and prunes it as it does)
            for lease in granted:
                self.made_with[cast(int, lease.item)] = version
        return [(lease, self.open[cast(int, lease.item)]) for lease in granted]

    def handle(self, msg: Want | Renew | Result, now: float, current: int) -> Answer:
        """Answer one work message from a worker at ``now``, the trainer at version ``current``: the
        rules of `want`, `renew` and `result`, with the wire messages in and out."""
        if isinstance(msg, Want):
            granted = self.want(msg.w, msg.n, now, msg.v, current)
            return Answer(self.grant_message(msg.w, granted) if granted else None)
        if isinstance(msg, Renew):
            # a renewed lease runs from now to its new expiry: one TTL, or less at its lifetime bound (its
            # `Lease.ttl_s` counts from the first grant)
            ttl_s = self.table.ttl_s
            renewed = [
                LeaseRenewal(cast(int, x.item), x.token, ttl_s if x.expires_at == now + ttl_s else x.expires_at - now)
                for x in self.renew(msg.w, msg.tokens, now)
            ]
            return Answer(Renewed(w=msg.w, leases=renewed) if renewed else None)
        samples = [SampleIn(s.tokens, s.logprobs, s.spans) for s in msg.samples]
        outcome = self.result(msg.w, msg.item, msg.token, msg.v, current, samples, now)
        if isinstance(outcome, Accepted):
            return Answer(Verdict(w=msg.w, item=msg.item, ok=True), outcome)
        return Answer(Verdict(w=msg.w, item=msg.item, ok=False, reason=outcome.reason[:MAX_REASON_CHARS]), outcome)

    def grant_message(self, worker: str, granted: Sequence[tuple[Lease, Prompt]]) -> Grant:
        """The `Grant` that tells ``worker`` of its new leases (from `want` or `unpark`)."""
        leases = [LeaseGrant(cast(int, lease.item), lease.token, lease.ttl_s, list(p.tokens)) for lease, p in granted]
        return Grant(w=worker, n=self.group_size, leases=leases)

    def unpark(self, now: float, current: int = 0) -> dict[str, list[tuple[Lease, Prompt]]]:
        """Grant parked wants where there is room for them now, oldest first. A want parked since its
        worker asked `_lapse_s` ago is dropped first: that worker stopped asking (a retry here
        that gets nothing again leaves the want as old as it was)."""
        for worker, (_, _, since) in list(self.parked.items()):
            if now >= since + self._lapse_s():  # as `next_deadline` adds it up (floats)
                del self.parked[worker]  # its worker stopped asking: do not lease to it
        for worker, t in list(self.asked.items()):
            if worker not in self.parked and now >= t + self._waiting_s():
                del self.asked[worker]  # no longer about to ask (it will be again when it asks)
        if self.switching_until is not None and now >= self.switching_until:
            self.switching_until = None  # (as `next_deadline` gives it)
        out = {}
        for worker, (n, version, since) in list(self.parked.items()):
            if self.room() == 0:
                break
            granted = self._want(worker, n, now, version, current, asked_at=since)
            if granted:
                out[worker] = granted
        return out

    def _split(self, worker: str, free: int, now: float, current: int) -> int:
        """``worker``'s part of ``free`` useful prompts among it and the other workers waiting for work,
        in proportion to their speeds (`SpeedMeter`), so that the first to ask does not take what the
        others wait for. Prompt by prompt, each goes to the worker whose credit (its work granted, in
        seconds at its speed) would end soonest with it — a worker with no credit yet starts a prompt
        behind the least, and one far behind catches up at most a lease's worth — so that over many
        grants each one's share follows its speed; ``worker`` first among equals. Waiting: parked with a version
        whose results would be used (or, for `ABOUT_TO_ASK_S` after the trainer's version changed, one
        whose version was of use before: it is switching to the new one; one that lags longer waits
        for nothing), or not parked, holding no lease and heard from (a want, a result under its own
        lease) within `ABOUT_TO_ASK_S`: between batches. `next_deadline` wakes the coordinator when
        either window ends, so a want held back for such a worker is answered then. (A busy worker
        counts as about to finish until twice its time is past; a want held back for it is retried
        at the next message, or when its worker asks again.)"""
        them = [worker, *(w for w in self._waiting(now, current) if w != worker)]
        lease_s = self.speeds.time_for(worker, self.settings.prompts_per_lease)
        one_s = self.speeds.time_for(worker, 1)
        if lease_s is not None and one_s is not None and lease_s >= 2 * one_s:
            # a worker whose time grows with its prompts loses nothing by a smaller lease: share with
            # those busy that will ask before it is done with a full one (a batched one would lose a batch)
            them += [w for w in self._finishing(now, lease_s) if w not in them]
        if len(them) == 1 or free == 0:
            return free
        full = self.settings.prompts_per_lease
        speed = self._speeds(them)
        known = [self.credit[w] for w in them if w in self.credit]
        floor = min(known, default=0.0)
        for w in them:  # one granted nothing yet: a prompt behind the least served
            self.credit.setdefault(w, floor - 1 / speed[w])
        top = max(self.credit[w] for w in them)
        for w in them:  # a worker far behind (away, or slow to ask) catches up at most a lease's worth
            self.credit[w] = max(self.credit[w], top - full / speed[w])
        got = dict.fromkeys(them, 0)
        for _ in range(free):
            open_ = [w for w in them if got[w] < full]
            if not open_:
                break
            w = min(open_, key=lambda w: (self.credit[w] + (got[w] + 1) / speed[w], w != worker, w))
            got[w] += 1
        return got[worker]

    def _active(self, worker: str, now: float) -> set[str]:
        """The workers at work: ``worker``, and those that delivered a result within the waiting window or
        within twice their own time for a full lease (one that only asks, or only holds leases, is not)."""
        out = {worker}
        for w, t in self.delivered.items():
            lease_s = self.speeds.time_for(w, self.settings.prompts_per_lease) or 0.0
            if now < t + max(self._waiting_s(), 2 * lease_s):
                out.add(w)
        return out

    def _ahead(self, worker: str, now: float) -> bool:
        """Has ``worker`` been granted more than half a full lease's worth (in seconds at its speed) beyond
        the least served of the other workers at work?"""
        others = [self.credit[w] for w in self._active(worker, now) if w != worker and w in self.credit]
        if not others or worker not in self.credit:
            return False
        lead_s = self.credit[worker] - min(others)
        return lead_s > self.settings.prompts_per_lease / 2 / self._speeds([worker])[worker]

    def _fair_hold(self, worker: str, now: float) -> int:
        """The most ``worker`` may hold under the ``ahead_steps`` bound: its speed's share of the bound
        among the workers at work (at least one prompt)."""
        speed = self._speeds(sorted(self._active(worker, now)))
        bound = self.settings.ahead_steps * self.batch
        return max(1, math.ceil(bound * speed[worker] / sum(speed.values())))

    def _finishing(self, now: float, within_s: float) -> list[str]:
        """The workers busy with leases that their measured speed says they finish within ``within_s``
        of ``now`` (or finished less than that time again ago: not yet overdue)."""
        out = []
        for w, since in self.granted_at.items():
            held = self.table.holds(w)
            took = self.speeds.time_for(w, held) if held else None
            if took is not None and -took <= since + took - now <= within_s:
                out.append(w)
        return out

    def _speeds(self, workers: Sequence[str]) -> dict[str, float]:
        """Each worker's measured speed; an unmeasured one's, the median of the measured workers' (1: none
        is)."""
        out: dict[str, float] = {}
        default: float | None = None
        for w in workers:
            s = self.speeds.speed(w)
            if s is None:
                if default is None:
                    known = sorted(x for x in map(self.speeds.speed, list(self.speeds.samples)) if x is not None)
                    default = known[len(known) // 2] if known else 1.0
                s = default
            out[w] = s
        return out

    def _waiting(self, now: float, current: int) -> list[str]:
        """The workers waiting for work at ``now`` (see `_split`)."""
        if self.version_seen != current:  # a new version: workers switch to it (not at the first one seen)
            if self.version_seen is not None:
                self.switching_until = now + self._waiting_s()
            self.version_seen = current
        switching = self.switching_until is not None and now < self.switching_until
        out = []
        for w, t in self.asked.items():
            if w in self.parked:
                version = self.parked[w][1]
                # switching: its version was of use before the newest one came (one stuck further back,
                # or asking with an old version on purpose, waits for nothing)
                recent = version is None or version >= current - 1 - self.max_stale
                if (switching and recent) or self._useful(version, current):
                    out.append(w)
            elif now < t + self._waiting_s() and not self.table.holds(w):
                out.append(w)
        return out

    def _waiting_s(self) -> float:
        return min(ABOUT_TO_ASK_S, self._lapse_s())

    def _lapse_s(self) -> float:
        """How long a parked want lasts: half a lease TTL, at least 2 s (a worker asks again sooner)."""
        return max(2.0, self.settings.ttl_s / 2)

    def renew(self, worker: str, tokens: Sequence[Token], now: float) -> list[Lease]:
        return self.table.renew(worker, tokens, now)

    def check(self, samples: Sequence[SampleIn], version: int, current: int) -> Rejected | None:
        """The result rules that do not depend on the lease (cheap: O(tokens))."""
        r = self.rules
        if len(samples) != self.group_size:
            return Rejected("malformed", f"malformed: {len(samples)} samples, the group size is {self.group_size}")
        if version > current:
            return Rejected("malformed", f"malformed: labelled version {version}, the trainer is at {current}")
        for k, s in enumerate(samples):
            if not 1 <= len(s.tokens) <= r.max_new_tokens or len(s.logprobs) != len(s.tokens):
                return Rejected(
                    "malformed",
                    f"malformed: sample {k} has {len(s.tokens)} tokens and "
                    f"{len(s.logprobs)} log-probabilities (1..{r.max_new_tokens}, equal)",
                )
            if not all(0 <= t < r.vocab_size for t in s.tokens):
                return Rejected("malformed", f"malformed: sample {k} has a token id outside [0, {r.vocab_size})")
            if not all(r.min_logprob <= lp <= 0.0 and math.isfinite(lp) for lp in s.logprobs):
                return Rejected(
                    "malformed", f"malformed: sample {k} has a behaviour log-probability outside [{r.min_logprob}, 0]"
                )
        return None

    def result(
        self, worker: str, item: int, token: Token, version: int, current: int, samples: Sequence[SampleIn], now: float
    ) -> Accepted | Rejected:
        """Offer a result (see the rules in the module docstring)."""
        mine = worker in self.asked or self.table.holds(worker)
        bad = self.check(samples, version, current)
        if bad is None and current - version > self.max_stale:
            outcome = self.table.release(worker, item, token, now)
            if isinstance(outcome, ResultRejected):  # not its lease to give back: say why, as a result would
                bad = Rejected(outcome.reason, outcome.reason)
            else:
                bad = Rejected(
                    "stale", f"stale: made with version {version}, the trainer is at {current} (bound {self.max_stale})"
                )
        if bad is None:
            done = self.table.complete(worker, item, token, now)
            if isinstance(done, ResultRejected):
                bad = Rejected(done.reason, done.reason)
        if mine and (bad is None or bad.kind == "stale"):  # its own lease, answered: about to ask again
            self.asked[worker] = max(now, self.asked.get(worker, now))
        if bad is not None:
            self.rejected[bad.kind] += 1
            if bad.kind == "stale":
                self.speeds.lost(worker, item)
            return bad
        self.speeds.accepted(worker, item, now)
        self.delivered[worker] = now
        prompt = self.open.pop(item)
        c = Completion(
            item,
            list(prompt.tokens),
            [Sample(list(s.tokens), list(s.logprobs), [(int(v), int(i)) for v, i in s.spans]) for s in samples],
            version,
        )
        self.log.append((item, worker, version, current))
        self.samples.append((prompt, c))
        self.accepted += 1
        return Accepted(prompt, c)

    def expire(self, now: float) -> list[LeaseExpired]:
        self.table.tick(now)
        out = self.table.events()
        for e in out:  # a worker that let a lease lapse is unmeasured until it delivers again (as its rate)
            self.speeds.forget(e.lease.worker)
        return out

    def leave(self, worker: str, now: float) -> list[LeaseExpired]:
        """``worker`` is gone for good (a revoked pool member): its leases end now and their prompts go
        back to the pool (returned, with any that expired meanwhile), and what the pool kept about it
        is forgotten."""
        self.table.revoke(worker, now)
        for table in (self.parked, self.asked, self.credit, self.granted_at, self.delivered):
            table.pop(worker, None)
        self.speeds.forget(worker)
        return self.expire(now)

    def take(self, n: int, current: int = 0) -> list[tuple[Prompt, Completion]] | None:
        """``n`` accepted results made within ``max_stale`` of version ``current``, oldest version
        first (a newer result can wait for the next step, an older one could not), in order of
        acceptance within a version; older ones are dropped. None: not enough yet."""
        fresh = [s for s in self.samples if current - s[1].version <= self.max_stale]
        self.last_dropped = [c.prompt_id for _, c in self.samples if current - c.version > self.max_stale]
        self.dropped_stale += len(self.last_dropped)
        self.samples = fresh
        if len(fresh) < n:
            return None
        fresh.sort(key=lambda s: s[1].version)  # stable: acceptance order within a version
        out, self.samples = fresh[:n], fresh[n:]
        self.taken_at = current
        return out

    def next_deadline(self) -> float | None:
        """When `expire` or `unpark` next has something to do on its own."""
        lapse = [since + self._lapse_s() for _, _, since in self.parked.values()]
        if self.parked:  # a worker leaving the waiting window may free what a parked want was held back from
            lapse += [
                t + self._waiting_s() for w, t in self.asked.items() if w not in self.parked and not self.table.holds(w)
            ]
            if self.switching_until is not None:
                lapse.append(self.switching_until)
        cands = [d for d in (self.table.next_deadline(), min(lapse, default=None)) if d is not None]
        return min(cands, default=None)

    def measured(self) -> dict[str, float]:
        """Each measured worker's speed (prompts per second with a full lease), as `_split` divides by it."""
        got = {w: self.speeds.speed(w) for w in self.speeds.samples}
        return {w: round(s, 4) for w, s in got.items() if s is not None and s > 0}

    def stats(self) -> dict[str, int | dict[str, int]]:
        return {
            "accepted": self.accepted,
            "rejected": dict(self.rejected),
            "in_flight": self.table.in_flight,
            "pending": self.table.pending,
            "dropped_stale": self.dropped_stale,
            "parked": len(self.parked),
        }
