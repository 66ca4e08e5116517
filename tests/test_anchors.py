"""The anchor policy as shipped (`aurora.store.anchors.AnchorPolicy`), over a model of what a store holds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aurora.store.anchors import AnchorPolicy, Keep

# One version a node stores: how far past the latest stored version it is (0 or less: one the
# store has already, a restarted node catching up), the delta it comes with (from the latest, from
# another version, none at hand), whether the latest's chain reads, and whether the anchor asked
# for afterwards is written (False: the write failed, or the node had moved on).
STEP = st.tuples(
    st.integers(-2, 3),
    st.sampled_from(["latest", "latest", "latest", "other", "none"]),
    st.sampled_from([True, True, True, False]),
    st.sampled_from([True, True, True, False]),
)


@given(st.integers(1, 6), st.lists(STEP, max_size=40))
def test_anchors_are_never_more_than_anchor_every_deltas_apart_but_for_failed_writes(
    anchor_every: int, steps: list[tuple[int, str, bool, bool]]
) -> None:
    """A version that cannot be a delta is an anchor and one that can is a delta; a delta
    ``anchor_every`` or more from its anchor is always asked to become one, so every version is
    fewer than ``anchor_every`` deltas from an anchor, plus one for each anchor write that failed
    since; nothing stored is stored again."""
    policy = AnchorPolicy(anchor_every)
    chain: dict[int, int] = {}  # the model store: version -> deltas since its anchor (0: an anchor)
    owed = 0  # anchor writes asked for, and not done, since the latest version's anchor
    for gap, delta, readable, written in steps:
        latest = max(chain, default=None)
        v = max(0, gap) if latest is None else max(0, latest + gap)
        base = {"latest": latest, "other": None if latest is None else latest + 1, "none": None}[delta]
        at_latest = None if latest is None or not readable else chain[latest]
        d = policy.decide(v, latest=latest, base=base, chain=at_latest)
        if latest is not None and v <= latest:
            assert d.keep is Keep.SKIP, d
            continue
        if latest is None or base != latest or at_latest is None:
            assert d.keep is Keep.ANCHOR, d  # it cannot be a delta
            chain[v], owed = 0, 0
            continue
        assert d.keep in (Keep.DELTA, Keep.DELTA_THEN_ANCHOR), d  # it can: never a needless anchor
        chain[v] = at_latest + 1
        assert (d.keep is Keep.DELTA_THEN_ANCHOR) == (chain[v] >= anchor_every), (d, chain[v])
        if d.keep is Keep.DELTA_THEN_ANCHOR:
            if written:
                chain[v], owed = 0, 0
            else:
                owed += 1
        assert chain[v] < anchor_every + owed, (v, chain[v], owed)


@given(st.integers(1, 6), st.integers(0, 40))
def test_with_every_anchor_written_each_anchor_every_th_version_is_an_anchor(anchor_every: int, n: int) -> None:
    """The steady state: versions one after another, each with its delta: anchors at 0, K, 2K, ..."""
    policy = AnchorPolicy(anchor_every)
    chain = 0
    for v in range(1, n + 1):
        d = policy.decide(v, latest=v - 1, base=v - 1, chain=chain)
        chain = 0 if d.keep is Keep.DELTA_THEN_ANCHOR else chain + 1
        assert (chain == 0) == (v % anchor_every == 0), (v, d)


def test_the_reasons_say_why() -> None:
    p = AnchorPolicy(3)
    assert p.decide(4, latest=None, base=None, chain=None).reason == "the store is empty"
    assert "not newer" in p.decide(4, latest=4, base=3, chain=1).reason
    assert "from v2" in p.decide(5, latest=4, base=2, chain=1).reason
    assert "cannot be read" in p.decide(5, latest=4, base=4, chain=None).reason
    assert p.decide(5, latest=4, base=4, chain=2).keep is Keep.DELTA_THEN_ANCHOR
    with pytest.raises(ValueError, match="anchor_every"):
        AnchorPolicy(0)
