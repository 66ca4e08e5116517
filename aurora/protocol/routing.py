"""`VersionRouter`: what a trainer or relay sends each child as weight versions flow down the tree.

A node holds committed versions up to ``latest`` and at most one delta in
flight, ``latest → latest + 1``, whose chunks arrive in any order (from the
parent, or from the local publisher on the trainer). Children report the
version they hold when they attach and whenever they commit one.

Rules (outputs are drained with `commands()`):

* **cut-through**: a child that holds the in-flight delta's base gets its
  manifest, then every chunk that has already arrived, then each new chunk the
  moment it arrives — it never waits for this node to hold the whole delta — and
  the delta's seal (`SendSeal`, its own command) once this node has it
  (`seal_arrived`: after every chunk, and only once checked);
* **catch-up**: a child that is behind ``latest`` (or holds nothing) gets one
  `SendCatchUp` from its version to ``latest`` (what it is sent, `choose_catch_up`
  decides: below); once it reports ``latest`` it joins the stream of the in-flight delta;
* a child ahead of this node (it had a faster parent before) is sent nothing
  until this node catches up with it.

Invariants (checked by property tests): a child is sent chunks of a delta
only if the last version it reported — or the target of the catch-up sent to
it — is that delta's base, and only after the delta's manifest; each chunk
goes to each child at most once per attachment, and the seal at most once, after
all of the delta's chunks; when the flow stops, every attached child has been sent
what brings it to ``latest``.

**What a catch-up sends** (`choose_catch_up`, from the child's version ``have``, the
target ``to``, the complete versions the node's history holds and whether its store
holds ``have``):

* `Replay`: the history's own versions, in order, when they lead from ``have`` to
  ``to`` — the shortest such chain, from the delta made on ``have`` or from the newest
  snapshot the history holds (full-weight mode: one snapshot, not a chain of them);
* `Compose`: one delta from ``have`` made from the store, when the store holds
  ``have`` and no chain leads there or the chain is two versions or longer — a child
  one version behind is sent the history's delta, never a composed one;
* `Snapshot`: the weights whole, when neither can.

A composed delta that comes out about as big as a snapshot (the encoder's
``prefer_snapshot``: only the driver, holding the weights, can know) is not sent:
the driver chooses again with ``stored=False`` (from the history as it is by then)
and sends that. A composed delta or a snapshot is made from the version the node holds
when it makes it, which may be newer than ``to``.

Invariants (tests/test_protocol_routing.py, against a brute-force reference): a
`Replay` names versions the history holds, each from the one before, starting
from a snapshot or the delta on ``have``, and no shorter chain exists; whenever a
chain exists and the store cannot serve, it is replayed, never a snapshot; a
`Compose` is chosen only from a version the store holds.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DeltaInfo:
    base: int
    target: int
    chunks: int
    """Its chunks (the seal follows them: `SendSeal`)."""


@dataclass(frozen=True, slots=True)
class SendManifest:
    child: str
    delta: DeltaInfo


@dataclass(frozen=True, slots=True)
class SendChunk:
    child: str
    target: int
    index: int


@dataclass(frozen=True, slots=True)
class SendSeal:
    """The seal of the delta to ``target``, after its chunks."""

    child: str
    target: int


@dataclass(frozen=True, slots=True)
class SendCatchUp:
    child: str
    from_version: int | None
    """None: the child holds nothing (send an anchor)."""
    to_version: int


Command = SendManifest | SendChunk | SendSeal | SendCatchUp


@dataclass
class _Child:
    version: int | None
    catching_up_to: int | None = None
    streaming: int | None = None  # target of the delta it is being streamed
    sent: set[int] = field(default_factory=set)

    @property
    def effective(self) -> int | None:
        """The version the child will hold once what it was sent has landed."""
        return self.catching_up_to if self.catching_up_to is not None else self.version


class VersionRouter:
    def __init__(self, latest: int | None) -> None:
        self.latest = latest
        self.inflight: DeltaInfo | None = None
        self.arrived: set[int] = set()
        self.sealed = False
        """The in-flight delta's seal has arrived (checked)."""
        self.children: dict[str, _Child] = {}
        self._out: list[Command] = []

    def commands(self) -> list[Command]:
        out, self._out = self._out, []
        return out

    # -- this node's own versions
    def delta_started(self, delta: DeltaInfo) -> None:
        if self.latest is None or delta.base != self.latest:
            raise ValueError(f"delta {delta.base}->{delta.target} does not start at the latest version {self.latest}")
        if delta.target != delta.base + 1:
            raise ValueError("versions advance one at a time")
        if self.inflight is not None and self.inflight != delta:
            raise ValueError(f"delta to {self.inflight.target} is still in flight")
        self.inflight, self.arrived, self.sealed = delta, set(), False
        for name in sorted(self.children):
            self._update(name)

    def chunk_arrived(self, target: int, index: int) -> None:
        d = self.inflight
        if d is None or target != d.target or not 0 <= index < d.chunks or index in self.arrived:
            return
        self.arrived.add(index)
        for name in sorted(self.children):
            c = self.children[name]
            if c.streaming == target and index not in c.sent:
                c.sent.add(index)
                self._out.append(SendChunk(name, target, index))

    def seal_arrived(self, target: int) -> None:
        """The in-flight delta's seal is here and checked (after all its chunks): every child it streams
        to gets it."""
        d = self.inflight
        if d is None or target != d.target or self.sealed or len(self.arrived) != d.chunks:
            return
        self.sealed = True
        for name in sorted(self.children):
            if self.children[name].streaming == target:
                self._out.append(SendSeal(name, target))

    def delta_abandoned(self, target: int) -> None:
        """The in-flight delta to ``target`` will not complete here (its source is gone): forget it.
        Children that were streamed part of it get it again whole with the next delta or catch-up."""
        if self.inflight is None or self.inflight.target != target:
            return
        self.inflight, self.arrived, self.sealed = None, set(), False
        for c in self.children.values():
            if c.streaming == target:
                c.streaming, c.sent = None, set()

    def version_committed(self, version: int) -> None:
        """This node now holds ``version`` (its in-flight delta committed, or it caught up)."""
        if self.latest is not None and version <= self.latest:
            return
        self.latest = version
        self.inflight, self.arrived, self.sealed = None, set(), False  # committed, or a catch-up jumped past it
        for name in sorted(self.children):
            self._update(name)

    # -- children
    def child_attached(self, child: str, version: int | None) -> None:
        self.children[child] = _Child(version)
        self._update(child)

    def child_detached(self, child: str) -> None:
        self.children.pop(child, None)

    def child_version(self, child: str, version: int) -> None:
        c = self.children.get(child)
        if c is None or (c.version is not None and version <= c.version):
            return
        c.version = version
        if c.catching_up_to is not None and version >= c.catching_up_to:
            c.catching_up_to = None
        if c.streaming is not None and version >= c.streaming:
            c.streaming, c.sent = None, set()
        self._update(child)

    def _update(self, name: str) -> None:
        c = self.children[name]
        if self.latest is None or c.streaming is not None:
            return
        have = c.effective
        if have is not None and have > self.latest:
            return  # ahead of us: nothing to send until we catch up
        if have is None or have < self.latest:
            if c.catching_up_to is None:
                c.catching_up_to = self.latest
                self._out.append(SendCatchUp(name, c.version, self.latest))
            return
        d = self.inflight
        if d is not None and have == d.base and c.catching_up_to is None:
            c.streaming, c.sent = d.target, set(self.arrived)
            self._out.append(SendManifest(name, d))
            self._out.extend(SendChunk(name, d.target, i) for i in sorted(self.arrived))
            if self.sealed:
                self._out.append(SendSeal(name, d.target))


# -- what a catch-up sends
@dataclass(frozen=True, slots=True)
class Replay:
    """Send the history's versions ``first``..``to`` in order (``first`` is a snapshot or the delta
    from the child's version)."""

    first: int
    to: int
    reason: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Send the weights held, whole."""

    to: int
    reason: str


@dataclass(frozen=True, slots=True)
class Compose:
    """Send one delta from ``base`` (read back from the store) to the weights held; when it comes out
    about as big as a snapshot, the driver chooses again without the store."""

    base: int
    to: int
    reason: str


CatchUp = Replay | Compose | Snapshot


def choose_catch_up(have: int | None, to: int, history: Mapping[int, bool], *, stored: bool) -> CatchUp:
    """What to send a child holding ``have`` (None: nothing) to bring it to ``to`` (the module
    docstring's rules). ``history``: the complete versions the node holds to replay, each mapped to
    whether it is a snapshot (True) or the delta from the version before (False); ``stored``: the
    node's store holds ``have``."""
    first, v = None, to
    while v in history:  # back from ``to`` to the first version that needs nothing before it
        if history[v] or v - 1 == have:
            first = v
            break
        v -= 1
    if first is not None:
        start = "a snapshot" if history[first] else f"the delta on v{have}"
        fallback: Replay | Snapshot = Replay(first, to, f"the history holds v{first}..v{to}, from {start}")
    elif have is None:
        fallback = Snapshot(to, "the child holds nothing")
    else:
        fallback = Snapshot(to, f"the history holds no way from v{have} to v{to}")
    if stored and have is not None and (first is None or first < to):
        why = "beyond the history" if first is None else f"{to - first + 1} versions to replay"
        return Compose(have, to, f"v{have} is stored, {why}: one composed delta")
    return fallback
