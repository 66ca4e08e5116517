"""Which position coding a tensor's chunks use, by link: the rule and the speeds it needs.

A CONDITIONED chunk (DELTA: ranks inside base-exponent buckets, range-coded) is
the fewest bytes (~0.8 per changed element on real steps) but both sides scan
every element of the span to rank it. A SPARSE chunk (positions as gaps, values
overwritten) is ~3-4 bytes per change, and costs the encoder one compare pass
and the receiver O(changes). For a tensor of ``n`` elements of which a fraction
``p`` changes, sent over a link of ``L`` bytes/s, with this node's measured costs
(``s_*``: seconds per element of encode + apply, ``b_*``: bytes per change):

    SPARSE  iff  n·p·(b_sparse − b_cond) / L  <  n·(s_cond − s_sparse)
            iff  p  <  L·(s_cond − s_sparse) / (b_sparse − b_cond)

that is, when the wire time the conditioned coding saves is less than the CPU
time it costs. ``n`` cancels: the rule is a density threshold per link and node.
The receivers are taken to run at the sender's measured speed (the same code).

Invariants: pure, like the rest of `aurora.codec` (the trainer measures the
speeds: `aurora.actors.coding`).
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora.codec.encoder import Coding


@dataclass(frozen=True, slots=True)
class CodecSpeed:
    cond_s_per_element: float
    sparse_s_per_element: float
    cond_bytes_per_change: float
    sparse_bytes_per_change: float

    def threshold(self, link_bytes_s: float) -> float:
        """The density below which SPARSE is cheaper on this link (0: never; inf: always)."""
        saved = self.cond_s_per_element - self.sparse_s_per_element
        extra = self.sparse_bytes_per_change - self.cond_bytes_per_change
        if saved <= 0:
            return 0.0
        return float("inf") if extra <= 0 else link_bytes_s * saved / extra


def choose(density: float, link_bytes_s: float, speed: CodecSpeed) -> Coding:
    """The coding for a tensor expected to change at ``density`` (see the module docstring)."""
    return Coding.SPARSE if density < speed.threshold(link_bytes_s) else Coding.CONDITIONED
