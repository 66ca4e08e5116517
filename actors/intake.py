"""`IntakeDriver`: a relay's or rollout's intake of its parent's version stream — the driver of the
sans-IO `aurora.protocol.intake.Intake`.

`on_parent_message` checks the bytes (each chunk on arrival: `DeltaReceiver.add`; the seal's
signature: `aurora.auth.seal`) and carries out what the machine says: forward a chunk to the
children at once (cut-through, through the router of `aurora.actors.fanout`), decode what came
ahead of the commit, time the parent link, and finish — verify the seal against what arrived,
commit all or nothing under ``weights_lock``, store. What the machine decides (which manifest may
begin, which chunk or seal is in place, when a delta is streamed on, what its seal must still prove)
is not decided here.

Invariants: a node applies a delta only onto the version it was made from (or a snapshot onto
anything), so versions only move forward, one verified commit at a time; with the trainer's key,
nothing is committed, stored or served that the trainer did not seal (the delta's bytes hash to the
seal's, or the result's state does); a manifest is checked against the layout the node holds (or,
holding nothing, the sealed layout) before anything is allocated; a chunk or seal that fails raises
`DeltaFormatError` / `AuthError` and changes nothing; once a commit has changed the weights, the
router and children learn the new version before anything else can fail (a cancellation, a store
that fails).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import structlog
from aurora.actors.fanout import Fanout
from aurora.actors.held import HeldVersions, Stored
from aurora.transport.base import Message

from aurora.auth.seal import (
    DeltaHasher,
    Seal,
    SealVerifier,
    check_manifest,
    manifest_layout,
    state_hash,
    weights_layout,
)
from aurora.codec import Weights
from aurora.codec.decoder import DeltaReceiver, blank_weights
from aurora.codec.format import Manifest, unpack_manifest
from aurora.errors import AuthError, ProtocolError
from aurora.events import VERSION_COMMITTED
from aurora.protocol.intake import (
    Abandon,
    Announced,
    Begin,
    Command,
    DecodeAhead,
    Finish,
    Forward,
    Intake,
    TimeLink,
)
from aurora.protocol.messages import DeltaChunk, DeltaManifest, DeltaSeal, SealWire
from aurora.protocol.routing import DeltaInfo
from aurora.runtime.clock import Clock
from aurora.runtime.threads import in_thread, to_the_end

log = structlog.get_logger("aurora.actors.flow")

LINK_SAMPLE_BYTES = 1 << 20
"""A transfer a node times its parent link by (manifest to last chunk) carries at least this much: a
smaller one says more about latency and scheduling than about the link's rate."""


@dataclass
class _Incoming:
    manifest: Manifest
    receiver: DeltaReceiver
    hasher: DeltaHasher
    streamed: bool
    """Routed to children chunk by chunk (a delta on the latest version, not a catch-up)."""
    seal: tuple[Seal, SealWire] | None = None
    hash_s: float = 0.0
    """Seconds spent hashing the chunks as they came (part of what verifying the seal costs)."""
    began: float = 0.0
    """When the manifest came (on the flow's clock): a bulk transfer is timed from it to the last chunk."""
    decoding: asyncio.Task[None] | None = None
    """Decoding the chunks that came, against the weights held, while more arrive (`_decode_ahead`)."""


class IntakeDriver:
    def __init__(self, held: HeldVersions, fanout: Fanout, verifier: SealVerifier, clock: Clock, threads: int) -> None:
        self.held = held
        self.fanout = fanout
        self.verifier = verifier
        self.clock = clock
        self.threads = threads
        self.name = held.name
        self.intake = Intake(
            held.name, held.version, authenticates=verifier.authenticates, held_sealed=held.seal is not None
        )
        """What this node accepts of its parent's version stream (`aurora.protocol.intake`)."""
        self._incoming: _Incoming | None = None
        self._run_id: bytes | None = None
        self.bytes_in = 0
        """Delta bytes received from parents (manifests and chunks)."""
        self.link_mbit: float | None = None
        """The rate (Mbit/s) the last bulk transfer from a parent came at — a snapshot or catch-up of at
        least `LINK_SAMPLE_BYTES`, manifest to last chunk (a streamed delta leaves the trainer as fast
        as it is encoded, so it times the encoder, not the link). Reported up to the trainer, whose
        coding choice takes the slowest (`aurora.actors.coding`)."""

    async def on_parent_message(self, msg: Message) -> int | None:
        """Feed one version-stream message from the parent; returns the version just committed, if
        any. Raises `DeltaFormatError`, `AuthError` or `ProtocolError` for what the parent got wrong
        (nothing changes then; the caller leaves that parent)."""
        m = msg.msg
        self.bytes_in += sum(len(b) for b in msg.buffers)
        if isinstance(m, DeltaManifest):
            return await self._run(self._begin(m, bytes(msg.buffers[0])))
        if isinstance(m, DeltaChunk):
            return await self._chunk(m.target, m.i, bytes(msg.buffers[0]))
        if isinstance(m, DeltaSeal):
            inc = self._incoming
            self.intake.seal_in_place(m.target)
            assert inc is not None
            inc.seal = (self._open(m.seal, inc.manifest), m.seal)
            return await self._run(self.intake.sealed(m.target))
        raise ProtocolError(f"{self.name}: {type(m).__name__} is not part of a version stream", remote=True)

    def parent_lost(self, *, left: bool = False) -> None:
        """The parent is gone: a delta half-received from it is abandoned (the next parent resends).
        ``left``: the node left that parent (the rate it timed that link at goes with it)."""
        if left:
            self.link_mbit = None
        self._abandon(self.intake.parent_lost())

    def _abandon(self, commands: list[Command]) -> None:
        """Forget a delta that will not be committed: its history entry, its routing, what is queued of it."""
        for cmd in commands:
            assert isinstance(cmd, Abandon), cmd
            if self._incoming is not None and self._incoming.manifest.target_version == cmd.target:
                self._incoming = None
            if not cmd.streamed:
                continue
            self.held.history.pop(cmd.target, None)
            self.fanout.forget(cmd.target)

    async def _run(self, commands: list[Command]) -> int | None:
        """Carry out `Intake`'s commands in order; the version committed if one was."""
        committed = None
        for cmd in commands:
            inc = self._incoming
            if isinstance(cmd, Abandon):
                self._abandon([cmd])
            elif isinstance(cmd, Forward):
                assert inc is not None
                self.fanout.router.chunk_arrived(cmd.target, cmd.chunk)
                self.fanout.dispatch()
            elif isinstance(cmd, DecodeAhead):
                assert inc is not None
                tg = self.held.task_group
                if tg is not None and (inc.decoding is None or inc.decoding.done()):
                    decoding = self._decode_ahead(inc)
                    try:
                        inc.decoding = tg.create_task(decoding)
                    except RuntimeError:  # the owner's task group is shutting down: the commit decodes
                        decoding.close()
            elif isinstance(cmd, TimeLink):
                assert inc is not None
                self._time_link(inc)
            elif isinstance(cmd, Finish):
                assert inc is not None
                committed = await self._finish(inc)
        return committed

    def _open(self, wire: SealWire, m: Manifest) -> Seal:
        """A seal, checked against its signature, the manifest, and the run of the version held."""
        seal = self.verifier.open(wire)
        check_manifest(seal, m)
        if self.held.seal is not None and self.verifier.authenticates:
            if self._run_id is None:
                self._run_id = self.verifier.open(self.held.seal).run
            if seal.run != self._run_id:
                raise AuthError(
                    f"{self.name}: version {seal.v} is of another run ({seal.run.hex()[:8]}, this node's "
                    f"is {self._run_id.hex()[:8]})"
                )
        return seal

    def _begin(self, h: DeltaManifest, packed: bytes) -> list[Command]:
        held = self.held
        # refused before it is parsed where that can be known: a first version without its seal, or a
        # manifest whose tensor count is not that of the weights held (parsing costs O(manifest bytes))
        if self.intake.refuses_unparsed(h.seal is not None):
            raise AuthError(f"{self.name}: a first version must come with its seal")
        m = unpack_manifest(packed, tensors=None if held.weights is None else len(held.weights))
        # nothing is allocated for a manifest before its layout is known to be the right one
        fits = held.weights is None or manifest_layout(m) == weights_layout(held.weights)
        announced = Announced(
            target=m.target_version,
            base=None if m.is_snapshot else m.base_version,
            n_chunks=m.n_chunks,
            header_target=h.target,
            header_base=h.base,
            header_n=h.n,
            sealed=h.seal is not None,
            layout_fits=fits,
        )
        if h.seal is not None and fits:  # its signature, before anything is begun
            sealed: tuple[Seal, SealWire] | None = (self._open(h.seal, m), h.seal)
        else:
            sealed = None
        commands = self.intake.manifest(announced)
        begin = next(c for c in commands if isinstance(c, Begin))
        self._abandon([c for c in commands if isinstance(c, Abandon)])
        self._incoming = _Incoming(
            m, DeltaReceiver(m), DeltaHasher(packed, m.n_chunks), begin.streamed, sealed, began=self.clock.now()
        )
        if begin.streamed:
            held.remember(
                m.target_version, Stored(packed, [None] * m.n_chunks, m.is_snapshot), self.fanout.queued_versions
            )
            self.fanout.router.delta_started(DeltaInfo(held.version or 0, m.target_version, m.n_chunks))
        return [c for c in commands if not isinstance(c, Abandon | Begin)]

    async def _chunk(self, target: int, i: int, data: bytes) -> int | None:
        self.intake.chunk_in_place(target, i)
        inc = self._incoming
        assert inc is not None
        inc.receiver.add(data)  # verified here; a bad chunk raises and nothing changes
        t = time.perf_counter()
        inc.hasher.add(i, data)
        inc.hash_s += time.perf_counter() - t
        if inc.streamed:
            self.held.history[target].chunks[i] = data
        return await self._run(self.intake.chunk_added(target, i))

    def _time_link(self, inc: _Incoming) -> None:
        """A bulk transfer just ended: the parent link's rate, if it was big enough to time."""
        if inc.streamed or inc.receiver.bytes_received < LINK_SAMPLE_BYTES:
            return
        dt = self.clock.now() - inc.began
        if dt > 0:
            self.link_mbit = inc.receiver.bytes_received * 8 / dt / 1e6

    async def _decode_ahead(self, inc: _Incoming) -> None:
        """Decode what has come of ``inc`` against the weights held, in a thread, until a pass finds
        nothing new: the commit then decodes only the rest (on a node of its own, decoding overlaps
        the transfer). The weights do not change before ``inc`` commits or is dropped, so what is
        decoded stays good; a chunk that fails is left for the commit to report."""
        base = self.held.weights  # what `_commit` stages against (a snapshot, against nothing, is not decoded ahead)
        rx = inc.receiver
        while self._incoming is inc:
            items = rx.undecoded(base)  # taken here, where chunks are added: the thread reads only these
            if not items or not await in_thread(rx.decode_ahead, items, base, threads=self.threads):
                return

    async def _finish(self, inc: _Incoming) -> int:
        """Verify the seal against what arrived, forward it, commit, store. On any failure the delta
        is abandoned here (not served to anyone) and the error raised."""
        try:
            return await self._verify_and_commit(inc)
        except BaseException:
            if self.intake.receiving == inc.manifest.target_version:
                self._abandon(self.intake.failed())
            raise

    async def _verify_and_commit(self, inc: _Incoming) -> int:
        t = time.perf_counter()
        seal = None if inc.seal is None else inc.seal[0]
        trusted_bytes = seal is not None and seal.delta is not None and seal.delta == inc.hasher.digest()
        trust = self.intake.trust(
            has_seal=seal is not None, bytes_sealed=trusted_bytes, seal_base=None if seal is None else seal.base
        )
        verify_s = time.perf_counter() - t + (inc.hash_s if seal is not None else 0.0)  # the chunks' hashing counts
        wire = None if inc.seal is None else inc.seal[1]
        if trust.forward_seal:  # checked: the seal follows the chunks down the tree at once
            target = inc.manifest.target_version
            self.held.history[target].seal = wire
            self.fanout.router.seal_arrived(target)
            self.fanout.dispatch()
        return await self._commit(inc, wire, trusted_bytes, trust.check_state, verify_s)

    async def _commit(
        self, inc: _Incoming, wire: SealWire | None, trusted_bytes: bool, check_state: bool, verify_s: float
    ) -> int:
        held = self.held
        m, target = inc.manifest, inc.manifest.target_version
        sealed = inc.seal[0] if inc.seal is not None else None

        def sealed_state(w: Weights) -> None:  # O(weights): only for bytes the trainer did not stream
            assert sealed is not None
            if state_hash(w) != sealed.state:
                raise AuthError(f"{self.name}: version {target} does not hash to the state the trainer sealed")

        check = sealed_state if check_state else None
        touched: frozenset[str] | None = None
        if inc.decoding is not None:
            await inc.decoding  # its last pass ends before the commit stages: never both at once
        t = time.perf_counter()
        async with held.weights_lock:
            if m.is_snapshot or held.weights is None:
                held.weights, cancelled = await to_the_end(_commit_snapshot, inc, check, self.threads)
            else:  # decode and apply in one thread hand-off, in place
                touched, cancelled = await to_the_end(
                    _decode_and_apply, inc.receiver, held.weights, check, self.threads
                )
            held.version, held.digest, held.seal = target, m.target_digest, wire
            self.intake.committed(target, sealed=wire is not None)
        self._incoming = None
        # the node holds ``target`` now, whatever comes next (a cancellation, a store that fails): its
        # router and children learn it at once, or the next delta from the parent would not fit the router
        kept = held.history.get(target) if inc.streamed else None
        held.moved_to(target, touched)
        if not inc.streamed:
            held.history.clear()  # older deltas no longer lead to this version
        self.fanout.router.version_committed(target)
        self.fanout.dispatch()
        if cancelled:
            raise asyncio.CancelledError
        if check_state:
            verify_s += time.perf_counter() - t
        if held.store is not None:
            w = held.weights
            assert w is not None
            await held.store_version(m, None if kept is None else kept.chunks, w, wire, prune=True)
        log.info(
            VERSION_COMMITTED,
            node=self.name,
            version=target,
            snapshot=m.is_snapshot,
            verified="bytes" if trusted_bytes else ("state" if check_state else "unsigned"),
            verify_s=round(verify_s, 6),
            digest=m.target_digest.hex()[:16],
        )
        return target


def _decode_and_apply(rx: DeltaReceiver, w: Weights, check: Any, threads: int) -> frozenset[str]:
    """Stage every chunk against ``w`` (``threads`` chunks at a time), then apply them in place: the
    tensors touched. ``check`` (the seal's state) runs on the result before the commit stands."""
    return frozenset(rx.stage(w, threads=threads).commit(w, check=check))


def _commit_snapshot(inc: _Incoming, check: Any, threads: int) -> Weights:
    fresh = blank_weights(inc.manifest)
    inc.receiver.stage(None, threads=threads).commit(fresh, check=check, restore=False)  # dropped if it fails
    return fresh
