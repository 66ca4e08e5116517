"""`VersionRouter` under random interleavings: no child gets a delta for a base it lacks, no chunk
twice, and once the flow stops every attached child holds the latest version. `choose_catch_up`
against a brute-force reference."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aurora.protocol import routing
from aurora.protocol.routing import Command, DeltaInfo, SendCatchUp, SendChunk, SendManifest, VersionRouter

CHILDREN = ["c0", "c1", "c2"]


@dataclass
class Child:
    """A model child: applies what it is sent on an ordered channel and reports its commits."""

    version: int | None
    staging: DeltaInfo | None = None
    got: set[int] = field(default_factory=set)
    inbox: deque[Command] = field(default_factory=deque)
    reports: deque[int] = field(default_factory=deque)
    attached: bool = False

    def take(self, cmd: Command) -> None:
        if isinstance(cmd, SendCatchUp):
            assert cmd.from_version == self.version, (cmd, self.version)
            self.version, self.staging = cmd.to_version, None
            self.reports.append(cmd.to_version)
        elif isinstance(cmd, SendManifest):
            assert cmd.delta.base == self.version, f"delta {cmd.delta} sent to a child at {self.version}"
            self.staging, self.got = cmd.delta, set()
        else:
            assert self.staging is not None, "a chunk before its manifest"
            assert cmd.target == self.staging.target
            assert cmd.index not in self.got, "the same chunk twice"
            self.got.add(cmd.index)
            if len(self.got) == self.staging.chunks:
                self.version, self.staging = self.staging.target, None
                self.reports.append(self.version)


class Routing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.router = VersionRouter(latest=0)
        self.kids = {c: Child(version=None) for c in CHILDREN}

    def _route(self) -> None:
        for cmd in self.router.commands():
            kid = self.kids[cmd.child]
            assert kid.attached, f"{cmd} to a detached child"
            kid.inbox.append(cmd)

    @rule(chunks=st.integers(1, 4))
    def publish(self, chunks: int) -> None:
        if self.router.inflight is None:
            v = self.router.latest
            assert v is not None
            self.router.delta_started(DeltaInfo(v, v + 1, chunks))
            self._route()

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        d = self.router.inflight
        if d is not None:
            self.router.chunk_arrived(d.target, data.draw(st.integers(0, d.chunks - 1)))
            self._route()

    @rule()
    def commit(self) -> None:
        d = self.router.inflight
        if d is not None and len(self.router.arrived) == d.chunks:
            self.router.version_committed(d.target)
            self._route()

    @rule(child=st.sampled_from(CHILDREN))
    def attach(self, child: str) -> None:
        kid = self.kids[child]
        if not kid.attached:
            kid.attached, kid.staging = True, None
            self.router.child_attached(child, kid.version)
            self._route()

    @rule(child=st.sampled_from(CHILDREN))
    def detach(self, child: str) -> None:
        kid = self.kids[child]
        if kid.attached:
            kid.attached = False
            kid.inbox.clear()
            kid.reports.clear()
            kid.staging = None
            self.router.child_detached(child)

    @rule(child=st.sampled_from(CHILDREN))
    def deliver(self, child: str) -> None:
        kid = self.kids[child]
        if kid.inbox:
            kid.take(kid.inbox.popleft())

    @rule(child=st.sampled_from(CHILDREN))
    def report(self, child: str) -> None:
        kid = self.kids[child]
        if kid.reports:
            self.router.child_version(child, kid.reports.popleft())
            self._route()

    @precondition(lambda self: any(k.attached for k in self.kids.values()))
    @rule()
    def settle(self) -> None:
        """Let the flow stop: finish the in-flight delta and drain every channel both ways."""
        d = self.router.inflight
        if d is not None:
            for i in range(d.chunks):
                self.router.chunk_arrived(d.target, i)
            self._route()
            self.router.version_committed(d.target)
            self._route()
        while any(k.inbox or k.reports for k in self.kids.values()):
            for name, kid in self.kids.items():
                while kid.inbox:
                    kid.take(kid.inbox.popleft())
                while kid.reports:
                    self.router.child_version(name, kid.reports.popleft())
                    self._route()
        for name, kid in self.kids.items():
            if kid.attached:
                assert kid.version == self.router.latest, (name, kid.version, self.router.latest)

    @invariant()
    def no_child_is_ahead_of_what_exists(self) -> None:
        """Cut-through lets a child commit the in-flight version before this node does, never more."""
        top = self.router.inflight.target if self.router.inflight else self.router.latest
        for kid in self.kids.values():
            if kid.version is not None and top is not None:
                assert kid.version <= top


TestRouting = Routing.TestCase
TestRouting.settings = settings(stateful_step_count=60)


def test_cut_through_sends_chunks_before_the_relay_holds_the_whole_delta() -> None:
    r = VersionRouter(latest=3)
    r.child_attached("c", 3)
    r.delta_started(DeltaInfo(3, 4, chunks=3))
    r.chunk_arrived(4, 1)
    assert r.commands() == [SendManifest("c", DeltaInfo(3, 4, 3)), SendChunk("c", 4, 1)]
    r.child_attached("late", 3)  # joins mid-delta: gets what already arrived
    r.chunk_arrived(4, 0)
    assert r.commands() == [
        SendManifest("late", DeltaInfo(3, 4, 3)),
        SendChunk("late", 4, 1),
        SendChunk("c", 4, 0),
        SendChunk("late", 4, 0),
    ]


def test_a_child_behind_gets_one_catch_up_then_joins_the_stream() -> None:
    r = VersionRouter(latest=7)
    r.delta_started(DeltaInfo(7, 8, chunks=2))
    r.chunk_arrived(8, 0)
    r.commands()
    r.child_attached("old", 5)
    assert r.commands() == [SendCatchUp("old", 5, 7)]
    r.child_attached("new", None)
    assert r.commands() == [SendCatchUp("new", None, 7)]
    r.child_version("old", 7)
    assert r.commands() == [SendManifest("old", DeltaInfo(7, 8, 2)), SendChunk("old", 8, 0)]


def _chains(have: int | None, to: int, history: dict[int, bool]) -> list[int]:
    """Reference: every first version of a chain the history holds that brings ``have`` to ``to``."""
    return [
        first
        for first in range(to + 1)
        if all(v in history for v in range(first, to + 1)) and (history[first] or first - 1 == have)
    ]


@given(
    st.none() | st.integers(0, 12),
    st.integers(0, 12),
    st.dictionaries(st.integers(0, 12), st.sampled_from([False, False, False, True]), max_size=10),
    st.booleans(),
)
def test_a_catch_up_replays_the_shortest_chain_composes_only_from_the_store_else_a_snapshot(
    have: int | None, to: int, history: dict[int, bool], stored: bool
) -> None:
    """Whatever the history holds: a replay is the shortest chain the history holds from ``have`` to
    ``to``; a chain is never passed over for a snapshot; a composed delta comes only from a stored
    version, never for a child one delta behind, and falls back to what the choice is without the
    store; a snapshot only when nothing else can serve."""
    if have is not None and have >= to:
        return  # the router sends a catch-up only to a child behind
    stored = stored and have is not None
    got = routing.choose_catch_up(have, to, history, stored=stored)
    chains = _chains(have, to, history)
    alone = routing.choose_catch_up(have, to, history, stored=False)
    if isinstance(got, routing.Compose):
        assert stored
        assert got.base == have
        assert got.to == to
        assert not chains or max(chains) < to, "a child one delta behind gets the history's delta"
    else:
        assert got == alone
        assert not stored or (chains and max(chains) == to)
    if chains:
        assert isinstance(alone, routing.Replay)
        assert (alone.first, alone.to) == (max(chains), to)  # the shortest: latest start
    else:
        assert isinstance(alone, routing.Snapshot)
        assert alone.to == to


def test_catch_up_choices_and_their_reasons() -> None:
    history = {5: False, 6: False, 7: False}
    assert routing.choose_catch_up(6, 7, history, stored=True) == routing.Replay(
        7, 7, "the history holds v7..v7, from the delta on v6"
    )
    composed = routing.choose_catch_up(4, 7, history, stored=True)
    assert isinstance(composed, routing.Compose)
    assert composed.reason == "v4 is stored, 3 versions to replay: one composed delta"
    assert routing.choose_catch_up(4, 7, history, stored=False) == routing.Replay(
        5, 7, "the history holds v5..v7, from the delta on v4"
    )
    far = routing.choose_catch_up(1, 7, history, stored=True)
    assert isinstance(far, routing.Compose)
    assert routing.choose_catch_up(1, 7, history, stored=False) == routing.Snapshot(
        7, "the history holds no way from v1 to v7"
    )
    assert routing.choose_catch_up(None, 7, history, stored=False) == routing.Snapshot(7, "the child holds nothing")
    full = {5: True, 6: True, 7: True}  # full-weight mode: one snapshot, not the chain of them
    assert routing.choose_catch_up(2, 7, full, stored=False) == routing.Replay(
        7, 7, "the history holds v7..v7, from a snapshot"
    )


def test_the_seal_is_its_own_command_after_every_chunk_and_reaches_a_late_joiner() -> None:
    from aurora.protocol.routing import DeltaInfo, SendChunk, SendManifest, SendSeal, VersionRouter

    r = VersionRouter(3)
    r.child_attached("a", 3)
    r.commands()
    d = DeltaInfo(3, 4, 2)
    r.delta_started(d)
    r.seal_arrived(4)  # before the chunks: not yet (the seal follows them)
    r.chunk_arrived(4, 0)
    r.chunk_arrived(4, 1)
    assert r.commands() == [SendManifest("a", d), SendChunk("a", 4, 0), SendChunk("a", 4, 1)]
    r.seal_arrived(4)
    r.seal_arrived(4)  # once
    assert r.commands() == [SendSeal("a", 4)]
    r.child_attached("b", 3)  # joins the stream after the seal: the whole delta, seal last
    assert r.commands() == [SendManifest("b", d), SendChunk("b", 4, 0), SendChunk("b", 4, 1), SendSeal("b", 4)]
