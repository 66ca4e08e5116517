"""`AnchorPolicy`: whether a version is stored as an anchor, a delta, or a delta made an anchor later.

A `DeltaStore` keeps full snapshots (anchors) and the deltas between them; rebuilding a
version reads its anchor and applies every delta on its chain, so the store bounds the chain
by ``anchor_every``. This is the one place that rule is written: `DeltaStore.keep` asks it
for every version a node stores, and the version flow (`aurora.actors.flow`) writes the
anchors it asks for afterwards.

Rules (`AnchorPolicy.decide`, for version ``v``, from what the store holds):

* ``v`` at or below the latest stored version is there already: `Keep.SKIP` (a restarted
  node catching up to what it had);
* a version that cannot be stored as a delta is stored as an anchor, now (`Keep.ANCHOR`):
  the store holds nothing, the delta at hand is not from the latest stored version, there
  is no delta at hand (a snapshot, a version received whole or composed elsewhere, chunks
  missing), or the latest version's chain cannot be read;
* otherwise ``v`` is stored as its delta (the delta is made already, so this is the fast
  path: it is durable before the version's seal leaves), and when it is the
  ``anchor_every``-th delta or more since its anchor it is made an anchor afterwards, off
  the version's path (`Keep.DELTA_THEN_ANCHOR`); else it stays a delta (`Keep.DELTA`).

Invariants (tests/test_anchors.py, whatever the sequence of versions, gaps, snapshots and
failed anchor writes):

* a version that cannot be a delta is an anchor;
* a delta at ``anchor_every`` or more deltas from its anchor is always asked to become an
  anchor: with every anchor asked for written, no version is more than ``anchor_every``
  deltas from its anchor; an anchor write that fails or is skipped (the node moved on) is
  asked for again at the next version, so the chain outgrows ``anchor_every`` by one per
  such failure, never silently;
* the decision depends on its arguments only: no clock, no I/O, no logging.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Keep(enum.Enum):
    SKIP = "skip"
    """Stored already: write nothing."""
    ANCHOR = "anchor"
    """Store the full weights now."""
    DELTA = "delta"
    """Store the delta."""
    DELTA_THEN_ANCHOR = "delta_then_anchor"
    """Store the delta now, then make the version an anchor (the caller writes it, off the path)."""


@dataclass(frozen=True, slots=True)
class KeepDecision:
    keep: Keep
    reason: str
    """Why, for a person reading a log or a failed test."""


@dataclass(frozen=True, slots=True)
class AnchorPolicy:
    anchor_every: int
    """An anchor at least every this many deltas on a chain (a store's ``anchor_every``)."""

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {self.anchor_every}")

    def decide(self, version: int, *, latest: int | None, base: int | None, chain: int | None) -> KeepDecision:
        """How to store ``version``. ``latest``: the latest stored version (None: the store is
        empty); ``base``: the version the delta at hand was made from (None: there is no delta at
        hand); ``chain``: how many deltas rebuilding ``latest`` applies to its anchor (None: its
        chain cannot be read)."""
        if latest is not None and version <= latest:
            return KeepDecision(Keep.SKIP, f"v{version} is not newer than the latest stored v{latest}")
        if latest is None:
            return KeepDecision(Keep.ANCHOR, "the store is empty")
        if base is None:
            return KeepDecision(Keep.ANCHOR, f"no delta to v{version} at hand")
        if base != latest:
            return KeepDecision(Keep.ANCHOR, f"the delta is from v{base}, the latest stored is v{latest}")
        if chain is None:
            return KeepDecision(Keep.ANCHOR, f"the chain of v{latest} cannot be read")
        why = f"{chain + 1} deltas since the anchor with this one (anchor_every {self.anchor_every})"
        return KeepDecision(Keep.DELTA_THEN_ANCHOR if chain + 1 >= self.anchor_every else Keep.DELTA, why)
