"""`Intake`: what a relay or rollout accepts of its parent's version stream, as a value.

A node holds one version (or none yet) and receives at most one delta at a time: a manifest
announces it, its chunks follow in any order, and a streamed delta's seal comes last (a catch-up
or snapshot brings its seal with the manifest). The bytes are checked by the codec and the seal by
`aurora.auth.seal`; this machine holds the *rules* — which manifest may begin, which chunk or
seal is in place, when a delta is streamed on to the children, when it is complete, and what the
seal's check must cover — and says what the driver (`aurora.actors.intake.IntakeDriver`) is to do.
No clock, no I/O, no logging.

Inputs: `manifest` (its header and what the parsed manifest says), `chunk_in_place` then
`chunk_added` (before and after the codec checked the chunk's bytes), `seal_in_place` then
`sealed`, `trust` (the seal's verdict on what arrived), `committed`, `parent_lost`. Each input
either raises the typed error of a peer's fault (`ProtocolError(remote=True)`, `DeltaFormatError`,
`AuthError`) and changes nothing, or returns the commands, in order:

* `Abandon` — forget the delta in progress (its history entry, its routing, what is queued of it);
* `Begin` — start receiving the announced delta (``streamed``: forward it chunk by chunk);
* `Forward` — a streamed delta's chunk ``i`` may go to the children (its seal goes on only once
  `trust` has passed it: `Trust.forward_seal`);
* `DecodeAhead` — decode what has come while the rest arrives;
* `TimeLink` — a bulk transfer (not streamed) has all its chunks: the parent link may be timed;
* `Finish` — everything is in: verify the seal and commit.

Rules and invariants (tests/test_protocol_intake.py holds the machine to them):

* a delta is applied only onto the version it was made from, a snapshot onto anything, and the
  target is always newer than the version held: versions only move forward, one at a time;
* a node that holds nothing (or authenticates and holds no seal) takes a first version only with
  its seal in the manifest message, and a manifest must fit the layout held;
* a new manifest supersedes a delta in progress (`Abandon` first);
* a chunk is taken only for the delta in progress, within its chunk count, once each; a seal only
  for a delta in progress that is complete, streamed and not yet sealed;
* exactly one `Finish` per delta, once every chunk is in and, if streamed, its seal;
* a streamed delta is the next version (held + 1) without a seal of its own in the manifest, and
  only its chunks are `Forward`ed, each once, and its seal only once `trust` has passed it;
* `trust`: a streamed delta's bytes must be the ones the trainer sealed; a delta whose bytes are
  sealed must be from the base its seal names; otherwise (a composed catch-up, a snapshot a relay
  made) the result's state is checked against the seal (`Trust.check_state`) — and an
  authenticating node never takes a delta whose base it holds unsealed without that check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aurora.errors import AuthError, DeltaFormatError, ProtocolError


@dataclass(frozen=True, slots=True)
class Announced:
    """A manifest message's header and what its parsed manifest says."""

    target: int
    base: int | None
    """The base version of a delta (None: a snapshot)."""
    n_chunks: int
    header_target: int
    header_base: int | None
    header_n: int
    sealed: bool
    """The manifest message carried the seal (a catch-up or snapshot)."""
    layout_fits: bool
    """The manifest's layout is the layout of the weights held (True when nothing is held)."""


@dataclass(frozen=True, slots=True)
class Abandon:
    target: int
    streamed: bool


@dataclass(frozen=True, slots=True)
class Begin:
    target: int
    streamed: bool


@dataclass(frozen=True, slots=True)
class Forward:
    target: int
    chunk: int


@dataclass(frozen=True, slots=True)
class DecodeAhead:
    target: int


@dataclass(frozen=True, slots=True)
class TimeLink:
    target: int


@dataclass(frozen=True, slots=True)
class Finish:
    target: int


Command = Abandon | Begin | Forward | DecodeAhead | TimeLink | Finish


@dataclass(frozen=True, slots=True)
class Trust:
    """What the seal's check of a delta must still cover, and what may go on meanwhile."""

    check_state: bool
    """Hash the result and compare with the sealed state (the bytes are not the trainer's own)."""
    forward_seal: bool = False
    """A streamed delta's seal, checked against its bytes: it follows the chunks down the tree now."""


@dataclass(slots=True)
class _Delta:
    target: int
    base: int | None
    n_chunks: int
    streamed: bool
    sealed: bool
    arrived: set[int] = field(default_factory=set)
    finished: bool = False

    @property
    def complete(self) -> bool:
        return len(self.arrived) == self.n_chunks


class Intake:
    """The intake rules of one node (see the module docstring). ``authenticates``: versions must be
    sealed by the trainer's key; ``version``/``held_sealed``: what the node holds at start."""

    def __init__(self, name: str, version: int | None, *, authenticates: bool, held_sealed: bool) -> None:
        self.name = name
        self.version = version
        self.authenticates = authenticates
        self.held_sealed = held_sealed
        self._delta: _Delta | None = None

    @property
    def receiving(self) -> int | None:
        """The target of the delta in progress (None: none)."""
        return None if self._delta is None else self._delta.target

    def refuses_unparsed(self, header_sealed: bool) -> bool:
        """Is a manifest refused before it is parsed? (A node holding nothing, authenticating, takes a
        first version only with its seal.)"""
        return self.version is None and self.authenticates and not header_sealed

    def manifest(self, a: Announced) -> list[Command]:
        """A manifest message (`Announced`): the delta it announces begins (module rules)."""
        who = self.name
        if self.refuses_unparsed(a.sealed):
            raise AuthError(f"{who}: a first version must come with its seal")
        if (a.target, a.base, a.n_chunks) != (a.header_target, a.header_base, a.header_n):
            raise ProtocolError(f"{who}: a manifest message that does not match its manifest", remote=True)
        if a.base is not None and a.base != self.version:
            raise ProtocolError(
                f"{who}: parent sent a delta from version {a.base}, this node holds {self.version}", remote=True
            )
        if self.version is not None and a.target <= self.version:
            raise ProtocolError(
                f"{who}: parent sent version {a.target}, this node holds {self.version} already", remote=True
            )
        if not a.layout_fits:
            raise DeltaFormatError(
                f"{who}: the parent's version {a.target} has another layout (tensor names, dtypes or shapes) "
                "than the weights held"
            )
        out: list[Command] = self.parent_lost()  # whatever was half-received before is superseded
        streamed = self.version is not None and a.target == self.version + 1 and not a.sealed
        self._delta = _Delta(a.target, a.base, a.n_chunks, streamed, a.sealed)
        out.append(Begin(a.target, streamed))
        return out + self._maybe_finish()

    def chunk_in_place(self, target: int, i: int) -> None:
        """Raise `ProtocolError` unless chunk ``i`` of ``target`` is expected now (before its bytes are checked)."""
        d = self._delta
        if d is None or d.target != target or not 0 <= i < d.n_chunks or i in d.arrived:
            raise ProtocolError(f"{self.name}: chunk {i} of version {target} was not announced", remote=True)

    def chunk_added(self, target: int, i: int) -> list[Command]:
        """Chunk ``i`` of ``target`` passed the codec's checks."""
        self.chunk_in_place(target, i)
        d = self._delta
        assert d is not None
        d.arrived.add(i)
        out: list[Command] = [Forward(target, i)] if d.streamed else []
        if d.complete:
            if not d.streamed:
                out.append(TimeLink(target))
        elif d.base is not None:
            out.append(DecodeAhead(target))
        return out + self._maybe_finish()

    def seal_in_place(self, target: int) -> None:
        """Raise `ProtocolError` unless a seal for ``target`` is expected now."""
        d = self._delta
        if d is None or d.target != target or not d.complete or d.sealed or not d.streamed:
            raise ProtocolError(f"{self.name}: a seal for version {target} out of place", remote=True)

    def sealed(self, target: int) -> list[Command]:
        """The seal of the streamed delta ``target`` came (its signature already checked)."""
        self.seal_in_place(target)
        d = self._delta
        assert d is not None
        d.sealed = True
        return self._maybe_finish()

    def trust(self, *, has_seal: bool, bytes_sealed: bool, seal_base: int | None) -> Trust:
        """What the seal of the delta in progress leaves to check: ``bytes_sealed``: what arrived hashes
        to the seal's delta bytes; ``seal_base``: the base the seal names. Raises `AuthError` when the
        seal cannot stand for what arrived."""
        d = self._delta
        if d is None or not d.finished:
            raise ProtocolError(f"{self.name}: trust asked with no delta finished", remote=False)
        if not has_seal:
            if self.authenticates:
                raise AuthError(f"{self.name}: version {d.target} came without a seal")
            return Trust(check_state=False)
        if d.streamed and not bytes_sealed:  # what streams is the trainer's own bytes, or nothing
            raise AuthError(f"{self.name}: the streamed delta to version {d.target} is not the one the trainer sealed")
        if bytes_sealed and d.base is not None and seal_base != d.base:
            raise AuthError(f"{self.name}: version {d.target}'s seal is for a delta from {seal_base}, not {d.base}")
        check_state = self.authenticates and not bytes_sealed
        if not check_state and self.authenticates and d.base is not None and not self.held_sealed:
            raise AuthError(f"{self.name}: holds version {self.version} unsealed; a delta onto it proves nothing")
        return Trust(check_state, forward_seal=d.streamed)

    def committed(self, target: int, *, sealed: bool) -> None:
        """The delta in progress was committed: the node holds ``target`` now."""
        d = self._delta
        if d is None or d.target != target or not d.finished:
            raise ProtocolError(f"{self.name}: committed {target}, which was not finished", remote=False)
        self.version, self.held_sealed, self._delta = target, sealed, None

    def failed(self) -> list[Command]:
        """The delta in progress could not be committed (its check failed): it is forgotten."""
        return self.parent_lost()

    def parent_lost(self) -> list[Command]:
        """The parent is gone (or superseded by a new manifest): a delta half-received is abandoned."""
        d, self._delta = self._delta, None
        return [] if d is None else [Abandon(d.target, d.streamed)]

    def _maybe_finish(self) -> list[Command]:
        d = self._delta
        if d is None or d.finished or not d.complete or (d.streamed and not d.sealed):
            return []
        d.finished = True
        return [Finish(d.target)]
