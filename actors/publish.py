"""`Publishing`: the trainer's side of the version flow — each new version encoded chunk by chunk
and sent down as it is produced, then sealed, stored and made the version held.

`publish` diffs the new weights against the version held (`aurora.codec`, each tensor coded as
`aurora.actors.coding` chooses), hands each chunk to the router (`aurora.actors.fanout`) as it is
encoded, hashes the state in a thread meanwhile, seals the version (`aurora.auth.seal`: the trainer's
signature over its number, base, layout, state and delta bytes), stores it, and sends the seal last.

Invariants: versions are published one at a time, each onto the one before (a snapshot with
``full_weights``); with a store, a version is stored before its seal leaves, so no child can commit
a version the trainer has not stored; the version held changes under ``weights_lock``, after the
store; a cancelled publication leaves no encoding or hashing job running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Iterator
from typing import Any

import structlog
from aurora.actors.coding import CodingPolicy
from aurora.actors.fanout import Fanout
from aurora.actors.held import HeldVersions, Stored

from aurora.auth.seal import DeltaHasher, Sealer, state_hash, tensor_hashes, weights_layout
from aurora.codec import Weights
from aurora.codec.encoder import EncodeStats, encode_stream
from aurora.codec.format import pack_manifest
from aurora.errors import ProtocolError
from aurora.events import VERSION_PUBLISHED
from aurora.protocol.messages import SealWire
from aurora.protocol.routing import DeltaInfo
from aurora.runtime.groups import cancel_and_wait
from aurora.runtime.threads import in_thread

log = structlog.get_logger("aurora.actors.flow")

UNSIGNED = Sealer(None, bytes(16))
"""What a trainer without a signing key seals with: the stream keeps its shape, nothing is signed."""
ENCODE_SLICE_S = 0.005
"""`publish` encodes chunks on the event loop for about this long, then routes them and yields:
a small delta goes out in one slice, a big one still streams cut-through. (One thread hand-off
per chunk cost a scheduling round trip each on a loaded host: 25 made a 46 kB delta take 0.1 s.)"""


class Publishing:
    def __init__(
        self,
        held: HeldVersions,
        fanout: Fanout,
        *,
        sealer: Sealer | None = None,
        coding: CodingPolicy | None = None,
        full_weights: bool = False,
        threads: int = 1,
    ) -> None:
        self.held = held
        self.fanout = fanout
        self.sealer = sealer or UNSIGNED
        """Makes each published version's seal."""
        self.coding = coding or CodingPolicy("conditioned", 0.0)
        """How each tensor's changed positions are coded (`aurora.actors.coding`)."""
        self.full_weights = full_weights
        """Publish every version as a snapshot (the full-weight baseline of the benchmarks)."""
        self.threads = threads
        self._hashes: dict[str, bytes] = {}
        """BLAKE3 of each tensor of the version held (reused for tensors a step left alone)."""
        self.last_published: dict[str, Any] = {}
        """Bytes and density of the last version published, and what sealing cost."""

    @property
    def signs(self) -> bool:
        return self.sealer.signs

    async def publish(self, new: Weights) -> int:
        """Make ``new`` the next version and stream its delta to the children as it is encoded, then
        its seal. With a store, the version is stored before the seal leaves."""
        held, router = self.held, self.fanout.router
        if held.weights is None or held.version is None:
            raise ProtocolError("publish needs a current version to diff against", remote=False)
        t0 = time.perf_counter()
        target = held.version + 1
        base = None if self.full_weights else held.weights
        stats = EncodeStats()
        m, chunks = encode_stream(
            base,
            new,
            base_version=None if base is None else held.version,
            target_version=target,
            stats=stats,
            threads=self.threads,
            coding=await in_thread(self.coding.codings, list(new), self.coding.link()),
        )
        n = m.n_chunks
        packed = pack_manifest(m)
        stored = Stored(packed, [None] * n, m.is_snapshot)
        hasher = DeltaHasher(packed, n)
        held.remember(target, stored, self.fanout.queued_versions)
        router.delta_started(DeltaInfo(held.version, target, n))
        # the state hash (all the weights, BLAKE3) runs in a thread while the chunks are encoded
        hashing = asyncio.ensure_future(in_thread(self._hash_state, new)) if self.signs else None
        self.fanout.dispatch()
        i, encode_s, store_s = 0, 0.0, 0.0
        try:
            while i < n:
                # encoded here in short slices, yielding between them so heartbeats keep flowing
                t = time.perf_counter()
                batch = _encode_slice(chunks, n - i)
                encode_s += time.perf_counter() - t
                for c in batch:
                    stored.chunks[i] = c
                    hasher.add(i, c)
                    router.chunk_arrived(target, i)
                    i += 1
                self.fanout.dispatch()
                await asyncio.sleep(0)
            t = time.perf_counter()
            state, hashes = (await hashing) if hashing is not None else (None, {})
            wait_s = time.perf_counter() - t
        finally:
            if hashing is not None and not hashing.done():
                await cancel_and_wait(hashing)  # returns once the hashing thread has ended (in_thread)
            if isinstance(chunks, Generator):
                chunks.close()  # a cancelled publish leaves no chunk jobs running
        t = time.perf_counter()
        wire = self.sealer.seal(
            v=target,
            base=None if m.is_snapshot else held.version,
            digest=m.target_digest,
            layout=weights_layout(new),
            state=state,
            delta=hasher.digest(),
        )
        seal_s = time.perf_counter() - t
        if held.store is not None:
            t = time.perf_counter()
            await held.store_version(m, stored.chunks, new, wire, in_place=False)
            store_s = time.perf_counter() - t
        stored.seal = wire
        router.seal_arrived(target)  # the seal goes out last
        async with held.weights_lock:
            held.weights, held.version, held.digest, held.seal = new, target, m.target_digest, wire
            self._hashes = hashes
        held.moved_to(target, None)
        router.version_committed(target)
        self.fanout.dispatch()
        if base is not None:
            self.coding.observe(m, stats)
        nbytes = len(packed) + sum(len(c) for c in stored.chunks if c is not None)
        publish_s = time.perf_counter() - t0
        self.last_published = {
            "bytes": nbytes,
            "density": round(stats.density, 6) if base is not None else None,
            "seal_s": round(seal_s + wait_s, 6),
        }
        log.info(
            VERSION_PUBLISHED,
            node=held.name,
            version=target,
            chunks=n,
            bytes=nbytes,
            snapshot=m.is_snapshot,
            publish_s=round(publish_s, 6),
            encode_s=round(encode_s, 6),
            store_s=round(store_s, 6),
            seal_s=round(seal_s, 6),
            hash_wait_s=round(wait_s, 6),
            signed=self.signs,
            changed=stats.changed,
            sparse_chunks=stats.sparse_chunks,
            density=round(stats.density, 6) if base is not None else None,
            digest=m.target_digest.hex()[:16],
        )
        return target

    def _hash_state(self, new: Weights) -> tuple[bytes, dict[str, bytes]]:
        """The state hash of ``new``; a tensor that is the very array of the version held keeps its hash."""
        old = self.held.weights
        reuse = {n: h for n, h in self._hashes.items() if old is not None and n in new and new[n].bits is old[n].bits}
        hashes = tensor_hashes(new, reuse)
        return state_hash(new, hashes), hashes

    def first_seal(self) -> SealWire:
        """Version 0's (or the resumed version's) seal, made now."""
        held = self.held
        assert held.weights is not None
        assert held.version is not None
        state, self._hashes = self._hash_state(held.weights) if self.signs else (None, {})
        held.seal = self.sealer.seal(
            v=held.version,
            base=None,
            digest=held.weights.digest(),
            layout=weights_layout(held.weights),
            state=state,
            delta=None,
        )
        return held.seal

    async def adopt(self, new: Weights) -> int:
        """Make ``new`` the next version here without delivering it (``sync.deliver: false``, the
        ideal run of `aurora bench rl`): nothing is encoded, stored or sent."""
        held = self.held
        async with held.weights_lock:
            held.weights, held.version, held.digest = new, (held.version or 0) + 1, new.digest()
        self.last_published = {"bytes": 0, "density": None}
        log.info(VERSION_PUBLISHED, node=held.name, version=held.version, chunks=0, bytes=0, delivered=False)
        return held.version


def _encode_slice(chunks: Iterator[bytes], left: int) -> list[bytes]:
    """The next chunks encoded within about `ENCODE_SLICE_S` (at least one, at most ``left``)."""
    t0, out = time.perf_counter(), [next(chunks)]
    while len(out) < left and time.perf_counter() - t0 < ENCODE_SLICE_S:
        out.append(next(chunks))
    return out
