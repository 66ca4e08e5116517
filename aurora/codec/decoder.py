"""Receiving and applying deltas: stage chunks, verify, then commit.

A `DeltaReceiver` accepts chunks in any order, verifies each on arrival
(digest, delta id, tensor and span, no duplicates), and when complete decodes
them against a base into a `StagedDelta` of sparse patches. Committing writes
the patches in place and checks every touched tensor's target digest; on any
mismatch it restores the old bits and raises, so nothing is ever half-applied.

Invariants: a receiver never changes the base while staging; a commit either
leaves every target tensor bit-identical to the manifest's digests or leaves
the tensors exactly as they were and raises `DeltaFormatError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from aurora.codec import kernels
from aurora.codec.format import Chunk, ChunkKind, Manifest, chunk_range, unpack_chunk
from aurora.codec.parallel import ordered_map, pairs_pay
from aurora.codec.weights import TensorBits, Weights
from aurora.errors import DeltaFormatError

_ERRORS = {
    kernels.ERR_OVERFLOW: "output overflow",
    kernels.ERR_TRUNCATED: "body is truncated",
    kernels.ERR_RANGE: "a coded position or value is out of range",
    kernels.ERR_LEFTOVER: "coded positions do not fit this base (wrong base?)",
}


@dataclass(frozen=True, slots=True)
class Patch:
    """New bits for one span of one tensor: scattered (``idx``) or contiguous from ``start``."""

    name: str
    start: int
    idx: np.ndarray | None
    new: np.ndarray

    @property
    def n(self) -> int:
        return int(self.new.size)


class DeltaReceiver:
    """Stages the chunks of one delta; see the module docstring for the rules."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._chunks: dict[tuple[int, int], Chunk] = {}
        self.bytes_received = 0
        self._ahead: dict[tuple[int, int], Patch | None] = {}
        """Chunks decoded as they came (`decode_ahead`), against `_ahead_base`."""
        self._ahead_failed: set[tuple[int, int]] = set()
        """Chunks that failed to decode ahead: left for `stage` to report."""
        self._ahead_base: Weights | None = None

    @property
    def expected(self) -> int:
        return self.manifest.n_chunks

    @property
    def complete(self) -> bool:
        return len(self._chunks) == self.expected

    def missing(self, limit: int | None = None) -> list[tuple[int, int]]:
        """The (tensor, chunk) indices not yet received, in order (the first ``limit`` of them)."""
        out: list[tuple[int, int]] = []
        for ti, t in enumerate(self.manifest.tensors):
            if not self.manifest.carries(t):
                continue
            for ci in range(t.n_chunks):
                if (ti, ci) not in self._chunks:
                    out.append((ti, ci))
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def has(self, tensor_index: int, chunk_index: int) -> bool:
        return (tensor_index, chunk_index) in self._chunks

    def chunk(self, tensor_index: int, chunk_index: int) -> Chunk:
        """A staged chunk (verified on arrival); `KeyError` if it has not arrived."""
        return self._chunks[(tensor_index, chunk_index)]

    def add(self, data: bytes | bytearray | memoryview) -> Chunk:
        """Verify and stage one packed chunk; raises `DeltaFormatError` and stages nothing on error."""
        c = unpack_chunk(data)
        h = c.header
        m = self.manifest
        where = f"chunk (tensor {h.tensor_index}, chunk {h.chunk_index})"
        if h.delta_id != m.delta_id:
            raise DeltaFormatError(f"{where} belongs to another delta (delta id mismatch)")
        if h.tensor_index >= len(m.tensors):
            raise DeltaFormatError(f"{where}: the manifest has only {len(m.tensors)} tensors")
        entry = m.tensors[h.tensor_index]
        if not m.carries(entry):
            raise DeltaFormatError(f"{where}: tensor {entry.name!r} is unchanged by this delta and has no chunks")
        if h.chunk_index >= entry.n_chunks:
            raise DeltaFormatError(f"{where}: tensor {entry.name!r} has only {entry.n_chunks} chunks")
        if (h.start, h.stop) != chunk_range(entry.numel, entry.dtype, h.chunk_index) or h.dtype != entry.dtype:
            raise DeltaFormatError(f"{where}: span or dtype does not match tensor {entry.name!r}")
        if m.is_snapshot and h.kind is not ChunkKind.RAW:
            raise DeltaFormatError(f"{where}: a snapshot holds only raw chunks")
        if h.kind is ChunkKind.SPARSE and m.format < 3:
            raise DeltaFormatError(f"{where} is SPARSE, which a format-{m.format} delta cannot hold")
        if h.kind is ChunkKind.DELTA and h.transform is not m.transform:
            raise DeltaFormatError(f"{where}: transform differs from the manifest's")
        key = (h.tensor_index, h.chunk_index)
        if key in self._chunks:
            raise DeltaFormatError(f"{where} arrived twice")
        # Own the bytes: the caller's buffer may be reused.
        owned = Chunk(h, memoryview(bytes(c.body)))
        self._chunks[key] = owned
        self.bytes_received += c.nbytes
        return owned

    def add_all(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        for c in chunks:
            self.add(c)

    def undecoded(self, base: Weights | None) -> list[tuple[tuple[int, int], Chunk]]:
        """The chunks arrived and not yet decoded ahead against ``base`` (nor failed to): what
        `decode_ahead` is to be given. Call it where `add` runs (it reads what `add` writes); a
        ``base`` other than the last one starts over."""
        if base is not self._ahead_base:
            self._ahead, self._ahead_failed, self._ahead_base = {}, set(), base
        return [it for it in self._chunks.items() if it[0] not in self._ahead and it[0] not in self._ahead_failed]

    def decode_ahead(
        self, items: list[tuple[tuple[int, int], Chunk]], base: Weights | None, *, threads: int = 1
    ) -> int:
        """Decode ``items`` (from `undecoded`) against ``base`` — the very weights `stage` will be
        given, unchanged until then (None for a snapshot) — so that `stage` has only the rest left: a
        receiver overlaps decoding with the transfer. Returns how many it decoded. A chunk that fails
        is not tried again here, and left for `stage`, which checks the base first and reports the
        error; nothing is raised. May run in a worker thread while `add` takes more chunks (it does not
        read what `add` writes); not at the same time as itself, `undecoded` or `stage`."""
        if base is not self._ahead_base:
            return 0
        if base is not None:
            try:
                check_layout(self.manifest, base)
            except DeltaFormatError:
                self._ahead_failed.update(k for k, _ in items)
                return 0
        done = 0
        for keys, got in _decode_jobs(self.manifest, sorted(items), base, threads):
            if isinstance(got, DeltaFormatError):
                self._ahead_failed.update(keys)
            else:
                self._ahead.update(zip(keys, got, strict=True))
                done += len(keys)
        return done

    def decode_arrived(self, base: Weights | None, *, threads: int = 1) -> int:
        """`decode_ahead` of what is `undecoded`, in one call (where `add` runs, or between adds)."""
        return self.decode_ahead(self.undecoded(base), base, threads=threads)

    def stage(self, base: Weights | None, *, base_checked: bool = False, threads: int = 1) -> StagedDelta:
        """Decode every chunk against ``base`` (unchanged) into patches; what `decode_ahead` decoded
        against this very ``base`` is taken as it is.

        Checks the base's tensor digests first unless ``base_checked`` (the caller
        already knows its version digest equals the manifest's base digest).
        """
        m = self.manifest
        if not m.is_snapshot:  # the layout first: it is cheap, and says more than a count of chunks
            if base is None:
                raise DeltaFormatError(f"delta v{m.base_version}->v{m.target_version} needs a base")
            check_base(m, base, base_checked)
        if not self.complete:
            raise DeltaFormatError(
                f"delta is incomplete: {self.expected - len(self._chunks)} of {self.expected} "
                f"chunks missing, e.g. {self.missing(3)}"
            )
        ahead = self._ahead if base is self._ahead_base else {}
        fresh: dict[tuple[int, int], Patch | None] = {}
        todo = [item for item in sorted(self._chunks.items()) if item[0] not in ahead]
        for keys, got in _decode_jobs(m, todo, base, threads):
            if isinstance(got, DeltaFormatError):
                raise got
            fresh.update(zip(keys, got, strict=True))
        patches = [p for key in sorted(self._chunks) if (p := ahead[key] if key in ahead else fresh[key]) is not None]
        return StagedDelta(m, patches)


def _decode_jobs(
    m: Manifest, items: list[tuple[tuple[int, int], Chunk]], base: Weights | None, threads: int
) -> Iterator[tuple[list[tuple[int, int]], list[Patch | None] | DeltaFormatError]]:
    """Decode ``items`` (in order) against ``base`` on ``threads`` threads, a `located_pairs` job at a time:
    each job's chunk keys with its patches, or the error that job's chunks raised."""
    located = sum(1 for _, c in items if c.header.kind is ChunkKind.DELTA and c.header.n_changed)
    pair = pairs_pay(located, threads)

    def job(
        group: list[tuple[tuple[int, int], Chunk]],
    ) -> tuple[list[tuple[int, int]], list[Patch | None] | DeltaFormatError]:
        keys = [k for k, _ in group]
        try:
            return keys, decode_group(m, group, base)
        except DeltaFormatError as e:
            return keys, e

    return ordered_map(job, located_pairs(items, pair=pair), threads)


def located_pairs(
    items: list[tuple[tuple[int, int], Chunk]], *, pair: bool = True
) -> Iterator[list[tuple[tuple[int, int], Chunk]]]:
    """``items`` (in order) as decoding jobs: two at a time where both are DELTA chunks with changes of one
    dtype — their base scans run side by side (`kernels.locate_pair`) — else one (always one with
    ``pair=False``)."""
    held: tuple[tuple[int, int], Chunk] | None = None
    for item in items:
        h = item[1].header
        if not pair or h.kind is not ChunkKind.DELTA or h.n_changed == 0:
            yield [item]
        elif held is None:
            held = item
        elif held[1].header.dtype == h.dtype:
            yield [held, item]
            held = None
        else:
            yield [held]
            held = item
    if held is not None:
        yield [held]


def decode_group(m: Manifest, group: list[tuple[tuple[int, int], Chunk]], base: Weights | None) -> list[Patch | None]:
    """The patches of one job of `located_pairs`, against ``base``; raises `DeltaFormatError` naming the chunk."""
    names = [m.tensors[ti].name for (ti, _ci), _c in group]
    if len(group) == 1:
        c = group[0][1]
        return [decode_chunk(c, names[0], base[names[0]] if base is not None else None)]
    assert base is not None
    (ca, cb), d = [c for _, c in group], group[0][1].header.dtype
    ha, hb = ca.header, cb.header
    sa, ia, xa, sb, ib, xb = kernels.locate_pair(
        base[names[0]].bits[ha.start : ha.stop],
        *decode_ranks(ca, names[0]),
        ha.n_changed,
        base[names[1]].bits[hb.start : hb.stop],
        *decode_ranks(cb, names[1]),
        hb.n_changed,
        d.exp_shift,
        d.exp_mask,
        d.width,
        int(ha.transform),
    )
    for status, c, name in ((sa, ca, names[0]), (sb, cb, names[1])):
        if status != 0:
            raise DeltaFormatError(f"{_chunk_named(c, name)}: {_ERRORS[-status]}")
    return [Patch(names[0], ha.start, ia + ha.start, xa), Patch(names[1], hb.start, ib + hb.start, xb)]


def check_layout(m: Manifest, weights: Weights) -> None:
    """``weights`` has the manifest's tensors, dtypes and shapes; raises `DeltaFormatError` naming the first
    difference (before anything the manifest describes is allocated)."""
    check_base(m, weights, True)


def check_base(m: Manifest, base: Weights, base_checked: bool = False) -> None:
    """``base`` has the manifest's layout and (unless ``base_checked``) its base digests; raises
    `DeltaFormatError` naming the first difference."""
    names = [t.name for t in m.tensors]
    if list(base) != names:
        raise DeltaFormatError(f"base does not match delta v{m.base_version}->v{m.target_version}: tensor names differ")
    for t in m.tensors:
        b = base[t.name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise DeltaFormatError(
                f"tensor {t.name!r}: delta expects {t.dtype.name}{list(t.shape)}, base has {b.dtype.name}{list(b.shape)}"
            )
    if base_checked:
        return
    digests = base.tensor_digests()
    for t in m.tensors:
        if digests[t.name] != t.base_digest:
            raise DeltaFormatError(
                f"wrong base for delta v{m.base_version}->v{m.target_version}: tensor {t.name!r} differs from its base"
            )


def decode_chunk(c: Chunk, name: str, base: TensorBits | None) -> Patch | None:
    """One chunk's patch (``None`` when it changes nothing)."""
    h = c.header
    d = h.dtype
    if h.kind is ChunkKind.RAW:  # the staged body itself, read-only: a commit copies it into place
        return Patch(name, h.start, None, np.frombuffer(c.body, dtype=d.uint))
    if h.n_changed == 0:
        return None
    if h.kind is ChunkKind.SPARSE:
        idx, new = sparse_patch(c)
        return Patch(name, h.start, idx + h.start, new)
    assert base is not None
    first, ranks, vals = decode_ranks(c, name)
    status, idx, new = kernels.locate(
        base.bits[h.start : h.stop],
        d.exp_shift,
        d.exp_mask,
        first,
        ranks,
        vals,
        h.n_changed,
        d.width,
        int(h.transform),
    )
    if status != 0:
        raise DeltaFormatError(f"{_chunk_named(c, name)}: {_ERRORS[-status]}")
    idx += h.start
    return Patch(name, h.start, idx, new)


def decode_ranks(c: Chunk, name: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A DELTA chunk's body as `kernels.decode_body`'s ``(first, ranks, vals)`` (what `kernels.locate`
    turns into positions against the base); raises `DeltaFormatError` on a malformed body."""
    h = c.header
    d = h.dtype
    src = np.frombuffer(c.body, dtype=np.uint8)
    status, first, ranks, vals = kernels.decode_body(
        src, h.n_changed, h.stop - h.start, d.n_buckets, d.width, int(h.transform)
    )
    if status != 0:
        raise DeltaFormatError(f"{_chunk_named(c, name)}: {_ERRORS[-status]}")
    return first, ranks, vals


def _chunk_named(c: Chunk, name: str | None) -> str:
    where = f"chunk (tensor {c.header.tensor_index}, chunk {c.header.chunk_index})"
    return where if name is None else f"{where} of {name!r}"


def sparse_patch(c: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """A SPARSE chunk's positions (in its span, ascending) and new bits; needs no base."""
    h = c.header
    d = h.dtype
    src = np.frombuffer(c.body, dtype=np.uint8)
    split = src.size - h.n_changed * d.itemsize  # the header check made it >= n_changed
    status, idx, used = kernels.decode_positions(src[:split], h.n_changed, h.stop - h.start)
    if status == 0 and used != split:
        raise DeltaFormatError(
            f"sparse chunk (tensor {h.tensor_index}, chunk {h.chunk_index}): "
            f"{split - used} bytes between its positions and its values"
        )
    if status != 0:
        raise DeltaFormatError(f"sparse chunk (tensor {h.tensor_index}, chunk {h.chunk_index}): {_ERRORS[-status]}")
    return idx, src[split:].view(d.uint).copy()


@dataclass(slots=True)
class StagedDelta:
    """Decoded, verified-so-far patches, ready to commit."""

    manifest: Manifest
    patches: list[Patch]

    @property
    def n_changed(self) -> int:
        return sum(p.n for p in self.patches if p.idx is not None)

    def touched(self) -> set[str]:
        return {p.name for p in self.patches}

    def commit(
        self, weights: Weights, *, check: Callable[[Weights], None] | None = None, restore: bool = True
    ) -> set[str]:
        """Apply in place; verify digests; restore and raise on mismatch. Returns touched names.

        ``check``, if given, runs on the result after the digests match; if it raises, the base is
        restored too (a caller's own test of the result, e.g. a cryptographic hash). ``restore=False``:
        ``weights`` are scratch the caller drops if this raises (a snapshot's fresh weights), so no old
        bits are kept — for a snapshot, a second copy of the weights not held."""
        m = self.manifest
        undo: list[tuple[Patch, np.ndarray]] = []
        try:
            for p in self.patches:
                dst = weights[p.name].bits
                if not restore:
                    if p.idx is None:
                        dst[p.start : p.start + p.n] = p.new
                    else:
                        dst[p.idx] = p.new
                elif p.idx is None:
                    undo.append((p, dst[p.start : p.start + p.n].copy()))
                    dst[p.start : p.start + p.n] = p.new
                else:
                    old = np.empty_like(p.new)
                    kernels.scatter(dst, p.idx, p.new, old)
                    undo.append((p, old))
            weights.forget_digests({p.name for p in self.patches})  # the others' bits did not change
            check_target(m, weights.tensor_digests())
            if check is not None:
                check(weights)
        except BaseException:
            for p, old in reversed(undo):
                dst = weights[p.name].bits
                if p.idx is None:
                    dst[p.start : p.start + p.n] = old
                else:
                    dst[p.idx] = old
            weights.forget_digests({p.name for p in self.patches})
            raise
        return self.touched()


def check_target(m: Manifest, digests: Mapping[str, bytes]) -> None:
    """Every tensor named in ``digests`` has its target digest; else `DeltaFormatError` (raised inside a
    commit, which then restores the base)."""
    bad = [t.name for t in m.tensors if t.name in digests and digests[t.name] != t.target_digest]
    if bad:
        raise DeltaFormatError(
            f"after applying v{m.base_version}->v{m.target_version}, {len(bad)} tensors differ "
            f"from the target digests (first: {bad[0]!r}); the base was restored"
        )


def receive(manifest: Manifest, chunks: Iterable[bytes | bytearray | memoryview]) -> DeltaReceiver:
    r = DeltaReceiver(manifest)
    r.add_all(chunks)
    return r


def apply_in_place(
    weights: Weights, manifest: Manifest, chunks: Iterable[bytes | bytearray | memoryview], *, threads: int = 1
) -> set[str]:
    """Stage, verify and commit a whole delta into ``weights``; all-or-nothing."""
    return receive(manifest, chunks).stage(weights, threads=threads).commit(weights)


def apply(
    base: Weights | None, manifest: Manifest, chunks: Iterable[bytes | bytearray | memoryview], *, threads: int = 1
) -> Weights:
    """A new weight set: ``base`` with the delta applied (``base`` is not modified)."""
    staged = receive(manifest, chunks).stage(base, threads=threads)
    out = blank_weights(manifest) if base is None else base.copy()
    staged.commit(out, restore=False)  # ``out`` is new: dropped if this raises
    return out


def blank_weights(manifest: Manifest) -> Weights:
    """Zeroed tensors in the manifest's layout: what a snapshot is committed into."""
    return Weights({t.name: TensorBits(t.dtype, t.shape, np.zeros(t.numel, t.dtype.uint)) for t in manifest.tensors})
