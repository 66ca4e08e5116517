"""Tree membership as values: who may attach where, a node's path, and its uplink's states.

Three pieces, none of which reads a clock, opens a socket or logs (``now`` comes in as an
argument; the `aurora.actors.node` driver does the I/O and logs the events returned here):

* `TreeRules` — what the topology allows, from the planned parents, the fallbacks and the
  roles: a node may attach under its planned parent or one of its fallbacks, nowhere else, and a
  pool member (`aurora.protocol.roster.member_pool`) under its pool's parents;
  the nodes that may be in a child's subtree are the ones it may speak for (a rollout only
  for itself, a relay for every node that may be below it, pool members included).
* `Place` — one node's place in the tree: its path from the trainer (None while detached;
  the trainer's is empty), and the parents it holds in quarantine. It answers a child's
  hello with the message the child is sent: `PathUpdate` (this node's path and itself), or
  `Refused` with its reason — a child the topology does not let attach here, any child while
  this node is detached, and a child that is one of this node's ancestors. When its path
  changes it says what each child is told (`Place.moved`): the new path, and nothing while
  detached.
* `Uplink` — a relay's or rollout's way up, over its parents in order (the planned parent,
  then the fallbacks). States (`UplinkState`):

  ``DETACHED`` → (the retry pause is over) ``Dial`` → ``DIALING`` → ``dialed`` → ``SendHello``
  → ``HELLO_SENT`` → the answer: a `PathUpdate` that does not run through this node attaches
  (``ATTACHED``), anything else is a refusal → ``DETACHED``. Attached, a `PathUpdate` moves
  the path (and the children are told), one through this node is a cycle and the node leaves;
  a lost parent is left, a failed one (its stream did not verify, or broke the protocol) is
  left and quarantined for `QUARANTINE_S`. Attached to a fallback, the node probes its
  planned parent every ``lost_after_s`` (``PROBING``: `Probe`, then ``probed``), and leaves
  the fallback for it once every probe for ``RETURN_AFTER_LOST × lost_after_s`` was answered
  with a path (hysteresis: a flapping parent does not pull children back and forth).

  Which parent next, decided when the node leaves one: after a return, the planned parent;
  at start — until `PLANNED_PATIENCE_S` has passed, nothing has been attached and nothing has
  failed — the planned parent again (a trainer may take a minute to load a model); otherwise
  the next in the order that is not quarantined, wrapping round (when every other one is
  quarantined, the order comes round to where it was). Every dial but the first waits
  `RETRY_PAUSE_S` after the last parent was left.

  `Uplink.next_deadline()`: when the retry pause ends (``DETACHED``), when the hello's answer
  is overdue (``HELLO_SENT``: the parent is lost), when the next probe is due (``ATTACHED`` to
  a fallback); None otherwise (a dial is bounded by the transport, a probe by its ``timeout_s``).

Invariants (tests/test_protocol_membership.py holds the shipped machines to them, a whole tree
of them under random topologies and faults): a node's path never contains itself, and a node is attached only under
a parent whose path did not contain it when it answered, so a cycle can only form through a
path still in flight, and the `PathUpdate` that closes it makes a node of the cycle leave;
every parent dialled is one the topology allows; no parent is dialled sooner than
`RETRY_PAUSE_S` after the last was left; a quarantined parent is dialled only when every
parent in the order was quarantined, and never probed; a node returns to its planned parent
only from a fallback, after answered probes spanning the hysteresis; `next_deadline()` is
never in the past after a step driven at each deadline.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aurora.protocol.messages import PathUpdate, Refused
from aurora.protocol.roster import member_pool

RETRY_PAUSE_S = 0.5
"""Between leaving one parent and dialling the next: a parent that refuses, or a network that is
down, is not dialled in a tight loop."""
PLANNED_PATIENCE_S = 60.0
"""At start, how long a node keeps trying its planned parent before it falls back (a trainer may
take a minute to load a real model before it listens)."""
QUARANTINE_S = 600.0
"""A parent whose stream failed verification (or broke the protocol) is not gone back to, nor
probed for a return, for this long: it may be compromised, and it would only fail again."""
RETURN_AFTER_LOST = 5
"""A node on a fallback returns to its planned parent once that has answered every probe for this
many ``lost_after_s`` (about five heartbeat losses' worth: long enough that a parent which comes
back only to flap again does not pull its children back and forth)."""

NOT_ALLOWED = "the topology does not let {child!r} attach to {parent!r}"
DETACHED_HERE = "not attached to the tree"
ANCESTOR = "it is an ancestor of this node"
RETURN_REASON = "the planned parent has been healthy long enough"


class TreeRules:
    """Who may attach under whom, and whom a child speaks for, from the topology's planned parents
    (``parent``: None for the trainer), ``fallbacks`` and ``roles``."""

    def __init__(
        self,
        parent: Mapping[str, str | None],
        fallbacks: Mapping[str, Sequence[str]],
        roles: Mapping[str, str],
        pools: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.parent = dict(parent)
        self.fallbacks = {n: tuple(f) for n, f in fallbacks.items()}
        self.roles = dict(roles)
        self.pools = {p: tuple(ps) for p, ps in (pools or {}).items()}
        """Each elastic pool's parents: its members (`member_pool` names) are rollouts that may attach under them."""
        under: dict[str, set[str]] = {n: set() for n in self.parent}
        for child in self.parent:
            for q in self.order(child):
                under.setdefault(q, set()).add(child)
        self._under = {n: frozenset(c) for n, c in under.items()}
        self._pools_under = {n: frozenset(p for p, ps in self.pools.items() if n in ps) for n in self.parent}
        """The pools whose members may attach directly under each node."""

    def pool_of(self, node: str) -> str | None:
        """The pool ``node`` is a member of (None: a named node, or no one)."""
        return None if node in self.parent else member_pool(node, self.pools)

    def role(self, node: str) -> str | None:
        """A named node's role; ``rollout`` for a pool member; None for a name that is neither."""
        return self.roles.get(node) or ("rollout" if self.pool_of(node) is not None else None)

    def order(self, node: str) -> tuple[str, ...]:
        """The parents ``node`` tries, in order: the planned one, then its fallbacks (none: the trainer)."""
        p = self.parent.get(node)
        return () if p is None else (p, *self.fallbacks.get(node, ()))

    def allowed_under(self, parent: str) -> frozenset[str]:
        """The nodes that may attach under ``parent`` (the planned tree and every fallback)."""
        return self._under.get(parent, frozenset())

    def may_attach(self, child: str, parent: str) -> bool:
        pool = self.pool_of(child)
        return child in self.allowed_under(parent) if pool is None else parent in self.pools[pool]

    def subtree(self, node: str) -> frozenset[str]:
        """The named nodes that may ever be below ``node`` (not itself, unless round a cycle of fallbacks)."""
        seen: set[str] = set()
        todo = [node]
        while todo:
            for c in self._under.get(todo.pop(), ()):
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return frozenset(seen)

    def pools_below(self, node: str) -> frozenset[str]:
        """The pools whose members may ever be below ``node`` (under it, or under a node of its subtree)."""
        return frozenset().union(*(self._pools_under.get(n, ()) for n in (node, *self.subtree(node))))


class Place:
    """Node ``name``'s place in the tree (see the module docstring). ``path``: its path from the
    trainer, this node's parent last (None: detached; empty: the trainer)."""

    def __init__(self, name: str, rules: TreeRules) -> None:
        self.name = name
        self.rules = rules
        self.planned = rules.parent.get(name)
        """The planned parent (None: the trainer)."""
        self.path: tuple[str, ...] | None = () if rules.roles.get(name) == "trainer" else None
        self.children_allowed = rules.allowed_under(name)
        """The named nodes that may attach here (and members of the pools whose parents include it)."""
        self._below = {c: rules.subtree(c) for c in self.children_allowed}
        self._pools_below = {c: rules.pools_below(c) for c in self.children_allowed}
        self.failed: dict[str, float] = {}
        """Parents whose stream failed, and when: quarantined for `QUARANTINE_S`."""

    @property
    def attached(self) -> bool:
        return self.path is not None

    def below(self) -> tuple[str, ...]:
        """The path a child of this node has: this node's path and itself."""
        assert self.path is not None, "a detached node has no path to give"
        return (*self.path, self.name)

    def hello(self, child: str) -> PathUpdate | Refused:
        """What a child that says hello (or probes) is answered: this node's path for it, or a refusal."""
        if not self.rules.may_attach(child, self.name):
            return Refused(reason=NOT_ALLOWED.format(child=child, parent=self.name))
        if self.path is None:
            return Refused(reason=DETACHED_HERE)
        if child in self.path:
            return Refused(reason=ANCESTOR)
        return PathUpdate(path=list(self.below()))

    def may_signal(self, child: str) -> bool:
        """May ``child`` set up a WebRTC channel here (a named node that may attach here; pool members
        come over ZeroMQ only)?"""
        return self.rules.pool_of(child) is None and self.rules.may_attach(child, self.name)

    def speaks_for(self, child: str, origin: str) -> bool:
        """May ``child`` send messages on behalf of node ``origin``? A rollout (a pool member too) only
        for itself, a relay for the nodes that may be below it (the members of pools below it too)."""
        if origin == child:
            return True
        if self.rules.roles.get(child) != "relay":
            return False
        pool = self.rules.pool_of(origin)
        return origin in self._below.get(child, ()) if pool is None else pool in self._pools_below.get(child, ())

    def speaks_for_worker(self, child: str, worker: str) -> bool:
        """May ``child`` send work messages for ``worker`` (a rollout it speaks for)?"""
        return self.speaks_for(child, worker) and self.rules.role(worker) == "rollout"

    def moved(self, path: Sequence[str] | None) -> PathUpdate | None:
        """This node's path is now ``path`` (None: detached); returns what each child is told."""
        if path is not None and self.name in path:
            raise ValueError(f"{self.name!r} cannot sit below itself ({' -> '.join(path)})")
        self.path = None if path is None else tuple(path)
        return None if self.path is None else PathUpdate(path=list(self.below()))

    def quarantine(self, parent: str, now: float) -> None:
        self.failed[parent] = now

    def quarantined(self, parent: str, now: float) -> bool:
        at = self.failed.get(parent)
        return at is not None and now - at < QUARANTINE_S


# ---------------------------------------------------------------- the uplink's outputs
# Commands (verbs: what the driver does) and events (past tense: what it logs), in the order
# they happened; the driver executes and logs them in that order.
@dataclass(frozen=True, slots=True)
class Dial:
    """Connect to ``parent`` (then say `dialed` or `unreachable`)."""

    parent: str


@dataclass(frozen=True, slots=True)
class SendHello:
    """Send ``parent`` this node's `Hello` (the version it holds); its answer is due by the deadline."""

    parent: str


@dataclass(frozen=True, slots=True)
class TellChildren:
    """Send every child this `PathUpdate` (this node's path moved)."""

    update: PathUpdate


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask ``parent`` whether it would take this node (a hello probe; no answer within ``timeout_s``:
    None), then say `probed` with the answer."""

    parent: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Leave:
    """Leave ``parent``: close the channel with ``close`` as the reason if there is one, drop what
    was in flight from it and hang up."""

    parent: str
    close: str | None = None


@dataclass(frozen=True, slots=True)
class ParentUnreachable:
    parent: str
    reason: str


@dataclass(frozen=True, slots=True)
class ParentRefused:
    parent: str
    reason: str


@dataclass(frozen=True, slots=True)
class ParentAttached:
    parent: str
    path: tuple[str, ...]
    planned: bool


@dataclass(frozen=True, slots=True)
class ParentLost:
    parent: str
    reason: str


@dataclass(frozen=True, slots=True)
class ParentFailed:
    parent: str
    error: str
    quarantine_s: float


@dataclass(frozen=True, slots=True)
class ParentReturn:
    parent: str
    to: str
    reason: str


Command = Dial | SendHello | TellChildren | Probe | Leave
Event = ParentUnreachable | ParentRefused | ParentAttached | ParentLost | ParentFailed | ParentReturn
Output = Command | Event


class UplinkState(enum.Enum):
    DETACHED = "detached"
    """No parent: waiting for the retry pause to end (at start: none), then the next parent is dialled."""
    DIALING = "dialing"
    """Connecting to the parent."""
    HELLO_SENT = "hello_sent"
    """Connected, hello sent: the answer is due within ``lost_after_s``."""
    ATTACHED = "attached"
    """Following the parent's stream (on a fallback: the next probe of the planned parent is due)."""
    PROBING = "probing"
    """Attached to a fallback, and a probe of the planned parent is out."""


class _Outcome(enum.Enum):
    """How the node left a parent (which decides the next)."""

    NOT_ATTACHED = "not attached"
    ATTACHED = "attached"
    FAILED = "failed"
    RETURN = "return"


class Uplink:
    """The uplink of node ``place.name`` over its parents in order (`TreeRules.order`: the planned
    one first); see the module docstring. Inputs take ``now`` and return the outputs, in order; `next_deadline()` is when to
    call `tick` next (None: only an event moves it)."""

    def __init__(self, place: Place, lost_after_s: float, now: float) -> None:
        order = place.rules.order(place.name)
        if not order:
            raise ValueError("a node with an uplink has a parent to dial")
        if place.name in order:
            raise ValueError(f"{place.name!r} cannot be its own parent")
        self.place = place
        self.name = place.name
        self.order = order
        self.planned = self.order[0]
        self.lost_after_s = lost_after_s
        self.return_after_s = RETURN_AFTER_LOST * lost_after_s
        self.state = UplinkState.DETACHED
        self._i = 0
        self._due: float | None = now  # the first dial: at once
        self._patient_until = now + PLANNED_PATIENCE_S
        self._attached_once = False
        self._healthy_since: float | None = None

    @property
    def parent(self) -> str:
        """The parent dialled, being greeted or followed (while detached: the one dialled next)."""
        return self.order[self._i]

    @property
    def attached(self) -> bool:
        return self.state in (UplinkState.ATTACHED, UplinkState.PROBING)

    @property
    def on_fallback(self) -> bool:
        return self.attached and self.parent != self.planned

    def next_deadline(self) -> float | None:
        return self._due

    # ------------------------------------------------------------ inputs
    def tick(self, now: float) -> list[Output]:
        """Time passed: dial once the retry pause is over; give up on an unanswered hello; probe the
        planned parent when a probe is due (a quarantined one counts as a failed probe)."""
        if self._due is None or now < self._due:
            return []
        if self.state is UplinkState.DETACHED:
            self.state, self._due = UplinkState.DIALING, None
            return [Dial(self.parent)]
        if self.state is UplinkState.HELLO_SENT:
            return self.lost("no answer", now)
        assert self.state is UplinkState.ATTACHED, self.state  # on a fallback: a probe is due
        if self.place.quarantined(self.planned, now):
            self._healthy_since, self._due = None, now + self.lost_after_s
            return []
        self.state, self._due = UplinkState.PROBING, None
        return [Probe(self.planned, self.lost_after_s)]

    def dialed(self, now: float) -> list[Output]:
        """The parent dialled is connected."""
        self._expect(UplinkState.DIALING)
        self.state, self._due = UplinkState.HELLO_SENT, now + self.lost_after_s
        return [SendHello(self.parent)]

    def unreachable(self, reason: str, now: float) -> list[Output]:
        """The parent dialled could not be reached."""
        self._expect(UplinkState.DIALING)
        return [ParentUnreachable(self.parent, reason), *self._leave(_Outcome.NOT_ATTACHED, now)]

    def answered(self, answer: object, now: float) -> list[Output]:
        """The parent answered the hello: a path that does not run through this node attaches it,
        anything else (a refusal, a cycle, another message) is a refusal."""
        self._expect(UplinkState.HELLO_SENT)
        if not isinstance(answer, PathUpdate) or self.name in answer.path:
            reason = answer.reason if isinstance(answer, Refused) else f"a cycle, or {type(answer).__name__}"
            return [ParentRefused(self.parent, reason), *self._leave(_Outcome.NOT_ATTACHED, now)]
        self.state = UplinkState.ATTACHED
        self._healthy_since = None
        self._due = now + self.lost_after_s if self.on_fallback else None
        out: list[Output] = self._tell(self.place.moved(answer.path))
        assert self.place.path is not None
        return [*out, ParentAttached(self.parent, self.place.path, planned=self.parent == self.planned)]

    def path_moved(self, path: Sequence[str], now: float) -> list[Output]:
        """The parent's path is now ``path``: follow it, or leave the parent if it runs through this node."""
        self._expect(UplinkState.ATTACHED, UplinkState.PROBING)
        if self.name in path:
            reason = f"the parent's path {' -> '.join(path)} runs through this node"
            return [ParentLost(self.parent, reason), *self._leave(_Outcome.ATTACHED, now)]
        return self._tell(self.place.moved(path))

    def lost(self, reason: str, now: float) -> list[Output]:
        """The parent went silent, closed, or did not answer the hello in time."""
        self._expect(UplinkState.HELLO_SENT, UplinkState.ATTACHED, UplinkState.PROBING)
        outcome = _Outcome.ATTACHED if self.attached else _Outcome.NOT_ATTACHED
        return [ParentLost(self.parent, reason), *self._leave(outcome, now)]

    def failed(self, error: str, kind: str, now: float) -> list[Output]:
        """The parent's answer or stream failed (verification, protocol): ``error`` says how, ``kind``
        names it to the parent. The parent is left and quarantined."""
        self._expect(UplinkState.HELLO_SENT, UplinkState.ATTACHED, UplinkState.PROBING)
        parent = self.parent
        self.place.quarantine(parent, now)
        return [
            ParentFailed(parent, error, QUARANTINE_S),
            *self._leave(_Outcome.FAILED, now, close=f"leaving this parent: {kind}"),
        ]

    def probed(self, answer: object, now: float) -> list[Output]:
        """The planned parent answered a probe with ``answer`` (None: no answer). A path that does not
        run through this node is a healthy answer; once they have spanned the hysteresis, the node
        leaves the fallback for the planned parent."""
        if self.state is not UplinkState.PROBING:
            return []  # the fallback was left while the probe was out
        ok = isinstance(answer, PathUpdate) and self.name not in answer.path
        self.state = UplinkState.ATTACHED
        if not ok:
            self._healthy_since = None
        elif self._healthy_since is None:
            self._healthy_since = now
        elif now - self._healthy_since >= self.return_after_s:
            parent = self.parent
            return [
                ParentReturn(parent, to=self.planned, reason=RETURN_REASON),
                *self._leave(_Outcome.RETURN, now, close="returning to the planned parent"),
            ]
        self._due = now + self.lost_after_s
        return []

    # ------------------------------------------------------------ internals
    def _expect(self, *states: UplinkState) -> None:
        if self.state not in states:
            raise ValueError(f"the uplink is {self.state.value}, not {' or '.join(s.value for s in states)}")

    def _tell(self, update: PathUpdate | None) -> list[Output]:
        return [] if update is None else [TellChildren(update)]

    def _leave(self, outcome: _Outcome, now: float, close: str | None = None) -> list[Output]:
        parent = self.parent
        self.place.moved(None)
        self._attached_once = self._attached_once or outcome is not _Outcome.NOT_ATTACHED
        starting = not self._attached_once and now < self._patient_until
        if outcome is _Outcome.RETURN:
            self._i = 0
        elif not (starting and parent == self.planned):  # at start: keep at the planned parent
            self._i = self._next_unquarantined(now)
        self.state, self._due, self._healthy_since = UplinkState.DETACHED, now + RETRY_PAUSE_S, None
        return [Leave(parent, close)]

    def _next_unquarantined(self, now: float) -> int:
        """The next parent in the order after this one that is not quarantined, while another is left;
        when every other one is, the order comes round to this one."""
        n = len(self.order)
        for step in range(1, n):
            i = (self._i + step) % n
            if not self.place.quarantined(self.order[i], now):
                return i
        return self._i
