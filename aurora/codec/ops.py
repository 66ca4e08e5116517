"""Operations on whole deltas: inverse and composition.

Positions are coded in the context of the base's exponents, so both are done
by applying and re-encoding rather than by splicing coded streams; the
results are ordinary deltas with all the usual checks.

Invariants: ``apply(apply(b, d), invert(b, d)) == b`` bit for bit;
``apply(b, compose(b, [d1, d2])) == apply(apply(b, d1), d2)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from aurora.codec.decoder import apply
from aurora.codec.encoder import Delta, encode
from aurora.codec.weights import Weights
from aurora.errors import DeltaFormatError


def invert(base: Weights, delta: Delta) -> Delta:
    """The delta from ``delta``'s target back to ``base``."""
    m = delta.manifest
    if m.is_snapshot:
        raise DeltaFormatError("a snapshot has no inverse (it has no base)")
    target = apply(base, m, delta.chunks)
    assert m.base_version is not None
    return encode(target, base, base_version=m.target_version, target_version=m.base_version, transform=m.transform)


def compose(base: Weights, deltas: Sequence[Delta]) -> Delta:
    """One delta from ``base`` to the last delta's target (for catching up late joiners)."""
    if not deltas:
        raise DeltaFormatError("compose needs at least one delta")
    first = deltas[0].manifest
    for a, b in itertools.pairwise(deltas):
        if a.manifest.target_digest != b.manifest.base_digest:
            raise DeltaFormatError(
                f"deltas do not chain: v{a.manifest.target_version} != base of "
                f"v{b.manifest.base_version}->v{b.manifest.target_version}"
            )
    cur = base
    for d in deltas:
        cur = apply(cur, d.manifest, d.chunks)
    return encode(
        base,
        cur,
        base_version=first.base_version,
        target_version=deltas[-1].manifest.target_version,
        transform=first.transform,
    )
