"""`CodingPolicy`: the trainer's choice of position coding per tensor, version after version.

The topology's ``sync.coding`` says ``conditioned`` (every tensor ranked in its
base-exponent buckets, the fewest bytes: the default), ``sparse`` (positions as
gaps, values overwritten: O(changes) for every receiver), or ``auto``: per
tensor, the rule of `aurora.codec.choice` — SPARSE where the tensor's density
in the last version is below ``L·(s_cond − s_sparse)/(b_sparse − b_cond)`` — with
``L`` the slowest link: ``sync.link_mbit`` if set, else the slowest rate a node
has reported receiving a bulk transfer at (its first snapshot, a catch-up: timed
by `aurora.actors.flow`, reported in its status), else the planned tree's slowest
declared link; and the costs measured once on this node (`measure_speed`: both
codings, encode + apply, on one synthetic bf16 span). A tensor not seen yet is
taken at `FIRST_DENSITY`.

Invariants: with ``conditioned`` the trainer writes what it always wrote; a
change in what ``auto`` chooses, or in its threshold by more than 10 %, is
logged (``coding_chosen``) with the numbers behind it and where the link rate
came from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import cache

import numpy as np
import structlog
import torch

from aurora.codec import Manifest, Weights, apply_in_place, encode
from aurora.codec.choice import CodecSpeed, choose
from aurora.codec.encoder import Coding, EncodeStats
from aurora.config.plan import Tree, slowest_link_mbit
from aurora.config.topology import Topology
from aurora.events import CODING_CHOSEN

log = structlog.get_logger("aurora.coding")

FIRST_DENSITY = 0.01
"""The density assumed for a tensor before a version has shown its own (RL steps change ~1–3 %)."""


@cache
def measure_speed(n: int = 1 << 21, density: float = 0.01, reps: int = 3) -> CodecSpeed:
    """Encode + apply of both codings on one synthetic bf16 span (best of ``reps``); once per process."""
    rng = np.random.default_rng(0)
    f = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    b = (f.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    t = b.copy()
    pos = rng.choice(n, size=max(1, round(n * density)), replace=False)
    t[pos] += np.uint16(1)
    base = Weights.from_tensors({"w": torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)})
    target = Weights.from_tensors({"w": torch.from_numpy(t.view(np.int16)).view(torch.bfloat16)})
    out: dict[Coding, tuple[float, float]] = {}
    for coding in Coding:
        best, nbytes = float("inf"), 0
        for _ in range(reps):
            work = base.copy()
            t0 = time.perf_counter()
            d = encode(base, target, base_version=0, target_version=1, coding=coding)
            apply_in_place(work, d.manifest, d.chunks)
            best = min(best, time.perf_counter() - t0)
            nbytes = sum(len(c) for c in d.chunks)
        out[coding] = (best / n, nbytes / pos.size)
    return CodecSpeed(
        out[Coding.CONDITIONED][0], out[Coding.SPARSE][0], out[Coding.CONDITIONED][1], out[Coding.SPARSE][1]
    )


class CodingPolicy:
    """The trainer's coding choice (see the module docstring); ``link()`` says which rate it uses."""

    def __init__(
        self,
        mode: str,
        declared_mbit: float,
        *,
        override_mbit: float | None = None,
        measured: Callable[[], tuple[float, str] | None] | None = None,
    ) -> None:
        self.mode = mode
        self.declared_mbit = declared_mbit
        """The slowest link of the planned tree, as the topology declares it."""
        self.override_mbit = override_mbit
        """``sync.link_mbit``: the operator's figure, taken over any other."""
        self.measured = measured
        """The slowest rate a node has reported receiving a bulk transfer at, and that node (the
        trainer's `ClusterStatus.slowest_link`): taken over the declared rate once there is one."""
        self._density: dict[str, float] = {}
        self._last: tuple[frozenset[str], float] | None = None

    @classmethod
    def of(
        cls, topo: Topology, tree: Tree, measured: Callable[[], tuple[float, str] | None] | None = None
    ) -> CodingPolicy:
        return cls(
            topo.sync.coding, slowest_link_mbit(topo, tree), override_mbit=topo.sync.link_mbit, measured=measured
        )

    def link(self) -> tuple[float, str]:
        """The link rate the rule uses (Mbit/s) and where it comes from."""
        if self.override_mbit:
            return self.override_mbit, "sync.link_mbit"
        got = self.measured() if self.measured is not None else None
        if got is not None:
            return got[0], f"measured by {got[1]}"
        return self.declared_mbit, "declared (planned tree)"

    def codings(self, names: Iterable[str], rate: tuple[float, str] | None = None) -> Coding | dict[str, Coding]:
        """What to code the next version's tensors with. ``rate``: `link()` as read where the node's
        clock can be read (the caller runs this in a worker thread: the first call times the codec)."""
        if self.mode != "auto":
            return Coding(self.mode)
        speed = measure_speed()
        mbit, source = rate if rate is not None else self.link()
        link = mbit * 1e6 / 8
        out = {n: choose(self._density.get(n, FIRST_DENSITY), link, speed) for n in names}
        sparse = frozenset(n for n, c in out.items() if c is Coding.SPARSE)
        threshold = speed.threshold(link)
        if self._last is None or sparse != self._last[0] or not _close(threshold, self._last[1]):
            log.info(
                CODING_CHOSEN,
                sparse=len(sparse),
                conditioned=len(out) - len(sparse),
                threshold_density=round(threshold, 5),
                link_mbit=round(mbit, 3),
                link_source=source,
                cond_ns_per_element=round(speed.cond_s_per_element * 1e9, 2),
                sparse_ns_per_element=round(speed.sparse_s_per_element * 1e9, 2),
                cond_bytes_per_change=round(speed.cond_bytes_per_change, 2),
                sparse_bytes_per_change=round(speed.sparse_bytes_per_change, 2),
            )
            self._last = sparse, threshold
        return out

    def observe(self, m: Manifest, stats: EncodeStats) -> None:
        """Take each tensor's density from the version just encoded (an unchanged tensor: zero)."""
        changed = dict.fromkeys(range(len(m.tensors)), 0)
        for ti, _ci, _kind, n, _bytes in stats.per_chunk:
            changed[ti] += n
        for ti, t in enumerate(m.tensors):
            self._density[t.name] = changed[ti] / max(1, t.numel)


def _close(a: float, b: float) -> bool:
    """Within 10 % (a new measurement that moves the threshold by less is not worth a log line)."""
    return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 0.1 * max(abs(a), abs(b)))
