"""`aurora.protocol.membership` as shipped: the hello rules against a brute-force reading of the
topology, and a whole tree of `Place`s and `Uplink`s under random topologies and fault schedules
(dials that fail, answers, refusals, lost and failing parents, paths in flight, probes, nodes
killed and restarted, time passing deadline by deadline).

Invariants held after every step: a node's path never contains itself; an attached node sits
under a parent the topology allows and its path ends with that parent; once no path is in flight
the attachments are a forest (no cycle) and each path is its parent's and the parent itself; no
parent is dialled within the retry pause of the last one left; at start only the planned parent is
dialled; a quarantined parent is never probed, and is next only when every parent is; a return
comes only from a fallback, after healthy probes spanning the hysteresis, and goes to the planned
parent; `next_deadline()` is never in the past."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aurora.protocol.membership import (
    ANCESTOR,
    DETACHED_HERE,
    NOT_ALLOWED,
    PLANNED_PATIENCE_S,
    QUARANTINE_S,
    RETRY_PAUSE_S,
    Dial,
    Leave,
    Output,
    ParentAttached,
    ParentFailed,
    ParentLost,
    ParentReturn,
    Place,
    Probe,
    TellChildren,
    TreeRules,
    Uplink,
    UplinkState,
)
from aurora.protocol.messages import PathUpdate, Refused

TRAINER = "t"
EPS = 1e-9
"""Slack for sums of floats (a deadline is ``now + pause``; ``deadline - now`` may be a hair under it)."""
Topo = tuple[dict[str, str | None], dict[str, tuple[str, ...]], dict[str, str]]


@st.composite
def topologies(draw: st.DrawFn) -> Topo:
    """A planned tree (relays under the trainer or an earlier relay, rollouts under either) and any
    fallbacks among the trainer and the relays: relays may fall back onto each other, round a cycle."""
    relays = [f"r{i}" for i in range(draw(st.integers(1, 4)))]
    rollouts = [f"w{i}" for i in range(draw(st.integers(1, 2)))]
    parent: dict[str, str | None] = {TRAINER: None}
    for i, r in enumerate(relays):
        parent[r] = draw(st.sampled_from([TRAINER, *relays[:i]]))
    for w in rollouts:
        parent[w] = draw(st.sampled_from([TRAINER, *relays]))
    fallbacks: dict[str, tuple[str, ...]] = {}
    for n in [*relays, *rollouts]:
        others = [q for q in (TRAINER, *relays) if q not in (n, parent[n])]
        fallbacks[n] = tuple(draw(st.lists(st.sampled_from(others), unique=True, max_size=2))) if others else ()
    roles = {TRAINER: "trainer", **dict.fromkeys(relays, "relay"), **dict.fromkeys(rollouts, "rollout")}
    return parent, fallbacks, roles


def _may_attach(topo: Topo, child: str, parent: str) -> bool:
    planned, fallbacks, _ = topo
    return planned[child] == parent or parent in fallbacks.get(child, ())


@given(topo=topologies(), data=st.data())
def test_a_hello_is_answered_by_the_topology_and_the_path(topo: Topo, data: st.DataObject) -> None:
    rules = TreeRules(*topo)
    names = list(topo[2])
    here = data.draw(st.sampled_from(names))
    allowed = [n for n in names if _may_attach(topo, n, here)]
    pick_allowed: bool = bool(allowed) and data.draw(st.booleans())
    child = data.draw(st.sampled_from(allowed if pick_allowed else names))
    place = Place(here, rules)
    if here != TRAINER:
        path = data.draw(st.none() | st.lists(st.sampled_from([n for n in names if n != here]), max_size=3))
        place.moved(None if path is None else [TRAINER, *path])
    answer = place.hello(child)
    if not _may_attach(topo, child, here):
        assert answer == Refused(reason=NOT_ALLOWED.format(child=child, parent=here))
        assert "the topology does not let" in answer.reason
    elif place.path is None:
        assert answer == Refused(reason=DETACHED_HERE)
    elif child in place.path:
        assert answer == Refused(reason=ANCESTOR)
    else:
        assert answer == PathUpdate(path=[*place.path, here])
        assert child not in answer.path


@given(topo=topologies(), data=st.data())
def test_a_child_speaks_for_itself_or_as_a_relay_for_what_may_be_below_it(topo: Topo, data: st.DataObject) -> None:
    rules = TreeRules(*topo)
    roles = topo[2]
    names = list(roles)
    here, child, origin = (data.draw(st.sampled_from(names)) for _ in range(3))
    place = Place(here, rules)
    below: set[str] = set()  # brute force: whatever may attach under the child, and under that, ...
    grew = True
    while grew:
        more = {n for n in names if any(_may_attach(topo, n, q) for q in below | {child})} - below
        below |= more
        grew = bool(more)
    expect = _may_attach(topo, child, here) and (origin == child or (roles[child] == "relay" and origin in below))
    assert place.speaks_for(child, origin) == (origin == child or expect)
    assert place.speaks_for_worker(child, origin) == (place.speaks_for(child, origin) and roles[origin] == "rollout")


def test_the_refusal_texts_are_the_ones_nodes_and_tests_match() -> None:
    rules = TreeRules({TRAINER: None, "r": TRAINER, "w": "r"}, {}, {TRAINER: "trainer", "r": "relay", "w": "rollout"})
    r = Place("r", rules)
    assert r.hello("x") == Refused(reason="the topology does not let 'x' attach to 'r'")
    assert r.hello("w") == Refused(reason="not attached to the tree")
    assert Place(TRAINER, rules).hello("r") == PathUpdate(path=[TRAINER])
    with pytest.raises(ValueError, match="below itself"):
        r.moved([TRAINER, "r"])


@dataclass
class Sim:
    """One node of the simulated tree: its machines, and what the test tracks beside them."""

    place: Place
    up: Uplink | None
    started: float
    inbox: deque[tuple[str, ...]] = field(default_factory=deque)
    """Paths its parent sent that have not arrived (in order, on the channel)."""
    left_at: float | None = None
    attached_once: bool = False
    healthy_since: float | None = None
    last_probe: float | None = None


class MembershipTree(RuleBasedStateMachine):
    @initialize(topo=topologies(), lost_after_s=st.sampled_from([0.5, 2.0, 30.0]))
    def setup(self, topo: Topo, lost_after_s: float) -> None:
        self.topo = topo
        self.topo_rules = TreeRules(*topo)
        self.lost_after_s = lost_after_s
        self.now = 0.0
        self.nodes: dict[str, Sim] = {}
        self.dead: set[str] = set()
        for n in topo[2]:
            self._start(n)

    def _start(self, n: str) -> None:
        place = Place(n, self.topo_rules)
        up = None if n == TRAINER else Uplink(place, self.lost_after_s, self.now)
        self.nodes[n] = Sim(place, up, started=self.now)
        self.dead.discard(n)

    def _in(self, *states: UplinkState) -> list[str]:
        return sorted(n for n, s in self.nodes.items() if s.up is not None and s.up.state in states)

    def _up(self, n: str) -> Uplink:
        up = self.nodes[n].up
        assert up is not None
        return up

    # ------------------------------------------------------------ what the driver would do
    def _run(self, n: str, outs: list[Output]) -> None:
        s, up = self.nodes[n], self._up(n)
        planned = up.planned
        for out in outs:
            if isinstance(out, Dial):
                assert self.topo_rules.may_attach(n, out.parent)
                assert _may_attach(self.topo, n, out.parent)
                assert s.left_at is None or self.now - s.left_at >= RETRY_PAUSE_S - EPS, "dialled within the pause"
                if not s.attached_once and (s.left_at is None or s.left_at < s.started + PLANNED_PATIENCE_S):
                    assert out.parent == planned, "a fallback dialled while waiting for the planned parent"
            elif isinstance(out, TellChildren):
                assert n not in out.update.path[:-1]
                assert out.update.path[-1] == n
                for cs in self.nodes.values():
                    if cs.up is not None and cs.up.attached and cs.up.parent == n:
                        cs.inbox.append(tuple(out.update.path))
            elif isinstance(out, Probe):
                assert up.on_fallback
                assert out.parent == planned
                assert not s.place.quarantined(planned, self.now), "a quarantined parent probed"
                assert s.last_probe is None or self.now - s.last_probe >= self.lost_after_s - EPS
                s.last_probe = self.now
            elif isinstance(out, Leave):
                s.inbox.clear()
                s.left_at = self.now
                nxt = up.parent
                if s.place.quarantined(nxt, self.now):
                    assert all(s.place.quarantined(q, self.now) for q in up.order), "a quarantined parent next"
            elif isinstance(out, ParentAttached):
                assert out.parent == up.parent
                assert out.planned == (out.parent == planned)
                s.attached_once, s.healthy_since, s.last_probe = True, None, None
            elif isinstance(out, ParentFailed):
                s.attached_once = True
                assert out.quarantine_s == QUARANTINE_S
            elif isinstance(out, ParentReturn):
                assert out.to == planned != out.parent, "a return from the planned parent"
                since = s.healthy_since
                assert since is not None, "returned without a healthy probe"
                assert self.now - since >= up.return_after_s - EPS, "returned before the hysteresis"
                assert up.parent == planned  # dialled next
        if any(isinstance(o, ParentReturn) for o in outs):
            assert up.state is UplinkState.DETACHED
            assert up.parent == planned

    # ------------------------------------------------------------ the network and time
    def _connect(self, n: str, reachable: bool) -> None:
        up = self._up(n)
        if reachable and up.parent not in self.dead:
            self._run(n, up.dialed(self.now))
        else:
            self._run(n, up.unreachable("no route", self.now))

    def _answer(self, n: str) -> None:
        up = self._up(n)
        self._run(n, up.answered(self.nodes[up.parent].place.hello(n), self.now))

    def _probe_answered(self, n: str) -> None:
        s, up = self.nodes[n], self._up(n)
        answer = None if up.planned in self.dead else self.nodes[up.planned].place.hello(n)
        ok = isinstance(answer, PathUpdate) and n not in answer.path
        if not ok:
            s.healthy_since = None
        elif s.healthy_since is None:
            s.healthy_since = self.now
        self._run(n, up.probed(answer, self.now))

    def _deliver(self, n: str) -> None:
        self._run(n, self._up(n).path_moved(self.nodes[n].inbox.popleft(), self.now))

    def _advance(self, target: float) -> None:
        """Time passes to ``target``; each machine is ticked at each of its deadlines on the way (as the
        driver sleeps until them)."""
        while True:
            due = [
                (d, n) for n, s in self.nodes.items() if s.up is not None and (d := s.up.next_deadline()) is not None
            ]
            if not due or min(due)[0] > target:
                break
            self.now = max(self.now, min(due)[0])
            for d, n in sorted(due):
                up = self.nodes[n].up
                if d <= self.now and up is not None:
                    self._run(n, up.tick(self.now))
        self.now = max(self.now, target)

    @precondition(lambda self: bool(self._in(UplinkState.DIALING)))
    @rule(data=st.data(), reachable=st.booleans())
    def connect(self, data: st.DataObject, reachable: bool) -> None:
        self._connect(data.draw(st.sampled_from(self._in(UplinkState.DIALING))), reachable)

    @precondition(lambda self: bool(self._in(UplinkState.HELLO_SENT)))
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        self._answer(data.draw(st.sampled_from(self._in(UplinkState.HELLO_SENT))))

    @precondition(lambda self: bool(self._in(UplinkState.HELLO_SENT, UplinkState.ATTACHED, UplinkState.PROBING)))
    @rule(data=st.data(), fails=st.booleans())
    def parent_trouble(self, data: st.DataObject, fails: bool) -> None:
        """The parent goes silent (lost), or its answer or stream does not verify (failed)."""
        n = data.draw(st.sampled_from(self._in(UplinkState.HELLO_SENT, UplinkState.ATTACHED, UplinkState.PROBING)))
        up = self._up(n)
        self._run(
            n,
            up.failed("DeltaFormatError('bad')", "DeltaFormatError", self.now)
            if fails
            else up.lost("silent", self.now),
        )

    @precondition(lambda self: any(s.inbox for s in self.nodes.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._deliver(data.draw(st.sampled_from(sorted(n for n, s in self.nodes.items() if s.inbox))))

    @precondition(lambda self: bool(self._in(UplinkState.PROBING)))
    @rule(data=st.data())
    def probe_answered(self, data: st.DataObject) -> None:
        self._probe_answered(data.draw(st.sampled_from(self._in(UplinkState.PROBING))))

    @rule(rounds=st.integers(1, 30), paths_arrive=st.booleans())
    def network_works(self, rounds: int, paths_arrive: bool) -> None:
        """A stretch where every dial to a live node connects, every hello and probe is answered and
        (or, while paths are slow, not) every path arrives, deadline by deadline."""
        for _ in range(rounds):
            for n in self._in(UplinkState.DIALING):
                self._connect(n, reachable=True)
            for n in self._in(UplinkState.HELLO_SENT):
                self._answer(n)
            for n in self._in(UplinkState.PROBING):
                self._probe_answered(n)
            while paths_arrive and (inboxes := sorted(n for n, s in self.nodes.items() if s.inbox)):
                self._deliver(inboxes[0])
            due = [d for s in self.nodes.values() if s.up is not None and (d := s.up.next_deadline()) is not None]
            if not due:
                break
            self._advance(min(due))

    def _kill(self, n: str) -> None:
        """Node ``n`` dies: channels to it close (its children and those greeting it lose it)."""
        self.dead.add(n)
        s = self.nodes[n]
        s.up, s.inbox = None, deque()
        s.place.moved(None)
        for c in self._in(UplinkState.HELLO_SENT, UplinkState.ATTACHED, UplinkState.PROBING):
            if self._up(c).parent == n:
                self._run(c, self._up(c).lost("closed", self.now))

    @precondition(lambda self: len(self.dead) < len(self.nodes) - 1)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        self._kill(data.draw(st.sampled_from(sorted(set(self.nodes) - self.dead - {TRAINER}))))

    @rule()
    def trainer_restarts(self) -> None:
        """The trainer dies and comes straight back (a trainer down for long only keeps everyone dialling)."""
        self._kill(TRAINER)
        self._start(TRAINER)

    @precondition(lambda self: bool(self.dead))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        self._start(data.draw(st.sampled_from(sorted(self.dead))))

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 5.0, 40.0, 700.0]))
    def advance(self, dt: float) -> None:
        self._advance(self.now + dt)

    # ------------------------------------------------------------ invariants
    @invariant()
    def paths_and_parents(self) -> None:
        for n, s in self.nodes.items():
            if n in self.dead:
                continue
            path = s.place.path
            assert path is None or n not in path, f"{n} below itself: {path}"
            if s.up is None:
                assert path == ()
                continue
            assert s.place.attached == s.up.attached
            if s.up.attached:
                assert path is not None
                assert self.topo_rules.may_attach(n, s.up.parent)
                assert s.up.parent not in self.dead
                assert path[0] == TRAINER
                assert path[-1] == s.up.parent

    @invariant()
    def deadlines_are_ahead(self) -> None:
        for s in self.nodes.values():
            d = None if s.up is None else s.up.next_deadline()
            assert d is None or d >= self.now

    @invariant()
    def settled_the_tree_has_no_cycle(self) -> None:
        if any(s.inbox for s in self.nodes.values()):
            return  # a path in flight may close a cycle for a moment: the node it runs through leaves on it
        parent_of = {n: s.up.parent for n, s in self.nodes.items() if s.up is not None and s.up.attached}
        for n, p in parent_of.items():
            if self.nodes[p].place.attached:
                assert self.nodes[n].place.path == self.nodes[p].place.below(), (n, p)
            seen = {n}
            while n in parent_of:
                n = parent_of[n]
                assert n not in seen, f"a cycle through {n}"
                seen.add(n)


MembershipTree.TestCase.settings = settings(stateful_step_count=60, deadline=None)
TestMembershipTree = MembershipTree.TestCase


def test_a_node_waits_for_its_planned_parent_then_returns_to_it_after_the_hysteresis() -> None:
    """The example behind the rules, step by step: patience at start, fallback, probes, return."""
    rules = TreeRules(
        {TRAINER: None, "r": TRAINER, "w": "r"}, {"w": (TRAINER,)}, {TRAINER: "trainer", "r": "relay", "w": "rollout"}
    )
    place = Place("w", rules)
    up = Uplink(place, lost_after_s=1.0, now=0.0)
    assert up.tick(0.0) == [Dial("r")]
    now = 0.0
    while now < PLANNED_PATIENCE_S:  # the relay is not up yet: the planned parent again and again
        assert up.unreachable("down", now)[-1] == Leave("r")
        now = up.next_deadline() or 0.0
        assert up.tick(now) == [Dial("r")]
    up.unreachable("down", now)
    assert up.tick(now + RETRY_PAUSE_S) == [Dial(TRAINER)]
    up.dialed(now)
    outs = up.answered(PathUpdate(path=[TRAINER]), now)
    assert place.path == (TRAINER,)
    assert up.on_fallback
    assert [type(o) for o in outs] == [TellChildren, ParentAttached]
    healthy = PathUpdate(path=[TRAINER, "r"])
    first = None
    while True:
        now = up.next_deadline() or 0.0
        assert up.tick(now) == [Probe("r", 1.0)]
        first = now if first is None else first
        outs = up.probed(healthy, now)
        if outs:
            break
    assert now - first >= 5 * 1.0
    assert [type(o) for o in outs] == [ParentReturn, Leave]
    assert up.state is UplinkState.DETACHED
    assert up.parent == "r"
    assert place.path is None


def test_a_cycle_closed_through_a_path_in_flight_is_left_when_the_path_arrives() -> None:
    """Relays a, b, c: b falls back onto a, c sits under b, a falls back onto c. b moves under a while
    the new path to c is slow; a then moves under c, whose path still reads t -> b: a cycle for a
    moment. The paths arriving break it: b sees itself in a's path and leaves."""
    topo: Topo = (
        {TRAINER: None, "a": TRAINER, "b": TRAINER, "c": "b"},
        {"a": ("c",), "b": ("a",), "c": ()},
        {TRAINER: "trainer", "a": "relay", "b": "relay", "c": "relay"},
    )
    tree = MembershipTree()
    tree.setup(topo, lost_after_s=1.0)
    checks = (tree.paths_and_parents, tree.deadlines_are_ahead, tree.settled_the_tree_has_no_cycle)

    def attach(n: str) -> None:
        tree._advance(tree._up(n).next_deadline() or tree.now)
        tree._connect(n, reachable=True)
        tree._answer(n)
        for check in checks:
            check()

    for n in ("a", "b", "c"):
        attach(n)
    assert tree.nodes["c"].place.path == (TRAINER, "b")
    tree._run("b", tree._up("b").lost("silent", tree.now))
    attach("b")  # under its fallback a; c is told t -> a -> b, slowly
    assert tree._up("b").parent == "a"
    assert tree.nodes["c"].inbox
    tree._run("a", tree._up("a").lost("silent", tree.now))
    attach("a")  # under its fallback c, whose path is still t -> b: a -> c -> b -> a
    assert tree.nodes["a"].place.path == (TRAINER, "b", "c")
    assert (tree._up("a").parent, tree._up("c").parent, tree._up("b").parent) == ("c", "b", "a")
    while inboxes := sorted(n for n, s in tree.nodes.items() if s.inbox):
        if inboxes[0] == "b":
            outs = tree._up("b").path_moved(tree.nodes["b"].inbox[0], tree.now)
            lost = [o for o in outs if isinstance(o, ParentLost)]
            assert lost
            assert "runs through this node" in lost[0].reason
            tree.nodes["b"].inbox.clear()
            tree._run("b", outs)
        else:
            tree._deliver(inboxes[0])
        for check in checks:
            check()
    assert not tree._up("b").attached
