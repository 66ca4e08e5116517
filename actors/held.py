"""`HeldVersions`: the versions a node holds — the current one and its weights, the recent deltas that lead
to it, and the node's store.

Every other part of the version flow reads and moves the node's version through this one object:
the trainer's publication (`aurora.actors.publish`), the intake of the parent's stream
(`aurora.actors.intake`), the fan-out and catch-ups of the children (`aurora.actors.fanout`,
`aurora.actors.catchup`).

Invariants: the weights, version, digest and seal change together, and only under
``weights_lock`` — a reader holding it (a rollout engine copying them, a catch-up encoding
them) sees one whole version; ``history`` holds at most ``keep_versions`` deltas, each keyed
by the version it makes (from the one before), and at most `KEEP_SNAPSHOTS` snapshots besides
those still queued for a child; a version is stored (`store_version`) before anything says it is
held durably, and an anchor due at it is written after, in a task of the owner's task group
(`start_in`), never a loose one, and finished before the store is written again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from aurora.codec import Weights
from aurora.codec.format import Manifest
from aurora.errors import ProtocolError, StoreError
from aurora.events import ANCHOR_NOT_WRITTEN
from aurora.protocol.messages import SealWire
from aurora.runtime.threads import in_thread
from aurora.store import DeltaStore
from aurora.store.anchors import Keep
from aurora.store.store import anchor_image

log = structlog.get_logger("aurora.actors.flow")

DEFAULT_KEEP_VERSIONS = 8
KEEP_SNAPSHOTS = 2
"""Snapshots the history keeps (a version published as full weights): a child behind needs only the
newest, and each is the size of the weights."""


@dataclass
class Stored:
    """One version's delta (or snapshot) as it went out: its manifest, its chunks (None: not here
    yet), and its seal once checked."""

    manifest: bytes
    chunks: list[bytes | None] = field(default_factory=list)
    snapshot: bool = False
    seal: SealWire | None = None

    @property
    def complete(self) -> bool:
        return self.seal is not None and all(c is not None for c in self.chunks)


class GoneFromHistory(Exception):
    """What a child was to be sent has left this node's history: the child fell too far behind."""


class HeldVersions:
    def __init__(
        self,
        name: str,
        weights: Weights | None,
        version: int | None,
        *,
        seal: SealWire | None = None,
        keep_versions: int = DEFAULT_KEEP_VERSIONS,
        store: DeltaStore | None = None,
    ) -> None:
        self.name = name
        self.weights = weights
        self.version = version
        self.digest: bytes | None = weights.digest() if weights is not None else None
        self.seal = seal
        """The seal of the version held (None: none known yet)."""
        self.weights_lock = asyncio.Lock()
        self.committed = asyncio.Event()
        """Set at every new version (a waiter clears it first): a rollout's worker wakes on it."""
        self.changed: OrderedDict[int, frozenset[str] | None] = OrderedDict()
        """Per version held since the start, the tensors its delta touched (None: a snapshot, everything)."""
        self.keep_versions = keep_versions
        self.history: OrderedDict[int, Stored] = OrderedDict()  # target version -> delta from target-1
        self.store = store
        """This node's versions on disk: a relay or rollout stores what it commits (deltas, and an
        anchor every ``store.anchor_every`` of them: `aurora.store.anchors`), so a restarted node
        resumes from it and a child far behind gets one composed delta instead of a chain or a snapshot."""
        self._tg: asyncio.TaskGroup | None = None
        """The owner of the anchor writes (`start_in`): the node's task group."""
        self._anchoring: asyncio.Task[None] | None = None
        """The anchor being written for the version stored last (`_promote`), a task of `_tg`."""

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg

    @property
    def task_group(self) -> asyncio.TaskGroup | None:
        return self._tg

    # -- the version held
    def moved_to(self, version: int, touched: frozenset[str] | None) -> None:
        """The node now holds ``version`` (its delta touched ``touched``): wake who waits for one."""
        self.committed.set()
        self.changed[version] = touched
        while len(self.changed) > 4 * self.keep_versions:
            self.changed.popitem(last=False)

    def touched_since(self, version: int | None) -> frozenset[str] | None:
        """Tensors changed from ``version`` to the current one; None when not known (then: all)."""
        if version is None or self.version is None or version > self.version:
            return None
        out: set[str] = set()
        for v in range(version + 1, self.version + 1):
            t = self.changed.get(v)
            if t is None:
                return None
            out |= t
        return frozenset(out)

    # -- the recent deltas
    def remember(self, target: int, stored: Stored, queued: Callable[[], set[int]]) -> None:
        """Keep ``stored``, the delta that makes ``target``; the oldest go past `keep_versions`, and
        snapshots past `KEEP_SNAPSHOTS` unless ``queued()`` (versions queued for a child) holds them."""
        self.history[target] = stored
        while len(self.history) > self.keep_versions:
            self.history.popitem(last=False)
        snapshots = [v for v, h in self.history.items() if h.snapshot]
        if len(snapshots) > KEEP_SNAPSHOTS:
            going = queued()  # full weights each: only the newest are worth their memory, and those still going out
            for v in snapshots[:-KEEP_SNAPSHOTS]:
                if v not in going:
                    del self.history[v]

    def stored(self, version: int) -> Stored:
        """Version ``version`` from the history; `GoneFromHistory` if it has left it."""
        stored = self.history.get(version)
        if stored is None:
            raise GoneFromHistory(version)
        return stored

    # -- the store
    async def store_version(
        self,
        m: Manifest,
        chunks: list[bytes | None] | None,
        weights: Weights,
        seal: SealWire | None,
        *,
        prune: bool = False,
        in_place: bool = True,
    ) -> None:
        """Store version ``m.target_version`` (`_keep`); an anchor due at it is written after, off the
        version's path (`_promote`), and finished before the store is written again. ``in_place``:
        ``weights`` are the node's own, which its next commit changes in place (a relay, a rollout);
        False: they never change (the trainer's published versions)."""
        if self._tg is None:
            raise ProtocolError(f"{self.name}: a flow with a store stores only once started (start_in)", remote=False)
        if self._anchoring is not None:
            await self._anchoring
        if await in_thread(self._keep, m, chunks, weights, seal, prune=prune):
            promote = self._promote(m.target_version, weights, seal, in_place)
            try:
                self._anchoring = self._tg.create_task(promote)
            except RuntimeError:  # the node's task group is shutting down: the version stays a delta
                promote.close()  # (never started: closed, not left to warn that it was never awaited)

    async def _promote(self, v: int, weights: Weights, seal: SealWire | None, in_place: bool) -> None:
        """Make stored version ``v`` an anchor. Weights that change in place have their image taken
        under the weights lock while the node still holds ``v``; the write, the slow part, runs
        outside it. A failure is logged: ``v`` stays stored as a delta."""
        store = self.store
        assert store is not None
        try:
            if in_place:
                async with self.weights_lock:
                    if self.version != v or self.weights is not weights:
                        return  # moved on already: the next anchor-due version will be one
                    image = await in_thread(anchor_image, v, weights)
            else:
                image = await in_thread(anchor_image, v, weights)
            await in_thread(store.write_anchor, image, seal=seal)
        except (StoreError, OSError) as e:
            log.warning(ANCHOR_NOT_WRITTEN, node=self.name, version=v, error=str(e))

    def _keep(
        self,
        m: Manifest,
        chunks: list[bytes | None] | None,
        weights: Weights,
        seal: SealWire | None,
        *,
        prune: bool = False,
    ) -> bool:
        """Store version ``m.target_version`` (``weights``) with its seal as the store's anchor policy
        says (`DeltaStore.keep`); ``prune`` then drops all but the recent versions (a relay's or
        rollout's store; the trainer's keeps them all). True: stored as a delta although an anchor is
        due, which the caller writes later (`_promote`)."""
        store = self.store
        assert store is not None
        kept = store.keep(m, chunks, weights, seal=seal).keep
        if kept is Keep.SKIP:
            return False  # already there (a restarted node catching up to what it had)
        if prune:
            store.prune(keep_last=max(store.anchor_every, self.keep_versions) * 2)
        return kept is Keep.DELTA_THEN_ANCHOR
