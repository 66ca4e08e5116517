"""`VersionFlow`: a node's weight versions flowing in from its parent and out to its children.

The driver for `aurora.protocol.routing.VersionRouter` over `Channel`s, with
the codec doing the bytes and `aurora.auth.seal` the trust. The trainer calls
`publish` with each new version: the delta is encoded chunk by chunk and each
chunk goes to the children as it is produced; then the version's seal (the
trainer's signature over its number, base, layout, state and delta bytes). A
relay or rollout node feeds what its parent sends into `on_parent_message`:
every chunk is verified on arrival (`DeltaReceiver.add`) and forwarded at once
(cut-through); the version is committed all-or-nothing once the last chunk and
the seal are in and the seal verifies. Children report their versions with
`Have` messages; a child that is behind gets the missing deltas in order from
the node's recent history (each with its seal), a composed delta, or a snapshot
(both with the seal of the version they make): which one is
`aurora.protocol.routing.choose_catch_up`'s rule, and the anchors of the store are
`aurora.store.anchors.AnchorPolicy`'s.

Wire messages (`aurora.protocol.messages`; buffers carry the bytes):

* `DeltaManifest` {base, target, n, seal?} + packed manifest — n chunks follow;
* `DeltaChunk` {target, i} + packed chunk;
* `DeltaSeal` {target, seal} — after the chunks of a streamed delta (a catch-up
  carries its seal in the manifest message instead);
* `Have` {v} — from a child: the version it now holds.

The router streams a delta's chunks, then its seal (`SendSeal`) once this node has checked it. What a node
accepts of its parent's stream — which manifest may begin, which chunk or seal is in place, when a
delta is streamed on, complete and finished, what its seal must still prove — is the sans-IO
`aurora.protocol.intake.Intake`; `on_parent_message` checks the bytes (codec, seal signature) and
carries out what the machine says.

Invariants: a node applies a delta only onto the version it was made from (or a
snapshot onto anything), so versions only move forward, one verified commit at a
time; with the trainer's key, nothing is committed, stored or served that the
trainer did not seal (the delta's bytes hash to the seal's, or the result's state
does); a manifest is checked against the layout the node holds (or, holding
nothing, the sealed layout) before anything is allocated; a chunk or seal that
fails raises `DeltaFormatError` / `AuthError` and changes nothing. The weights
change only under `weights_lock`, so a reader holding it (a rollout engine
copying them) sees one whole version. With a store, `publish` stores the version
before its seal leaves, so no child can commit a version the trainer has not stored;
an anchor due is written after, in a task of the owner's task group (`start_in`), never
a loose one.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aurora.actors.coding import CodingPolicy
from aurora.transport.base import Channel, Message

from aurora.auth.seal import (
    DeltaHasher,
    Seal,
    Sealer,
    SealVerifier,
    check_manifest,
    manifest_layout,
    state_hash,
    tensor_hashes,
    weights_layout,
)
from aurora.codec import Weights
from aurora.codec.decoder import DeltaReceiver, blank_weights
from aurora.codec.encoder import EncodeStats, encode, encode_stream
from aurora.codec.format import Manifest, pack_manifest, unpack_manifest
from aurora.errors import AuthError, ProtocolError, StoreError, TransportClosed
from aurora.events import (
    ANCHOR_NOT_WRITTEN,
    CATCH_UP_SENT,
    CATCH_UP_STORE_FAILED,
    SNAPSHOT_SENT,
    VERSION_COMMITTED,
    VERSION_PUBLISHED,
)
from aurora.protocol.intake import (
    Abandon,
    Announced,
    Begin,
    DecodeAhead,
    Finish,
    Forward,
    Intake,
    TimeLink,
)
from aurora.protocol.intake import Command as IntakeCommand
from aurora.protocol.messages import DeltaChunk, DeltaManifest, DeltaSeal, SealWire
from aurora.protocol.routing import (
    CatchUp,
    Command,
    Compose,
    DeltaInfo,
    Replay,
    SendCatchUp,
    SendChunk,
    SendManifest,
    SendSeal,
    VersionRouter,
    choose_catch_up,
)
from aurora.runtime.clock import Clock, LoopClock
from aurora.runtime.groups import cancel_and_wait, wait_first
from aurora.runtime.threads import in_thread, to_the_end
from aurora.store import DeltaStore
from aurora.store.anchors import Keep
from aurora.store.store import anchor_image

log = structlog.get_logger("aurora.actors.flow")

UNSIGNED = Sealer(None, bytes(16))
"""What a trainer without a signing key seals with: the stream keeps its shape, nothing is signed."""

DEFAULT_KEEP_VERSIONS = 8
MAX_QUEUED = 8192
"""Messages that may wait for one child (a version is its chunks plus two): past it the child is cut off."""
KEEP_SERVED = 2
"""Catch-ups (composed deltas, snapshots) kept made: children that ask for the same one share it."""
LINK_SAMPLE_BYTES = 1 << 20
"""A transfer a node times its parent link by (manifest to last chunk) carries at least this much: a
smaller one says more about latency and scheduling than about the link's rate."""
KEEP_SNAPSHOTS = 2
"""Snapshots the history keeps (a version published as full weights): a child behind needs only the
newest, and each is the size of the weights."""
ENCODE_SLICE_S = 0.005
"""`publish` encodes chunks on the event loop for about this long, then routes them and yields:
a small delta goes out in one slice, a big one still streams cut-through. (One thread hand-off
per chunk cost a scheduling round trip each on a loaded host: 25 made a 46 kB delta take 0.1 s.)"""


@dataclass
class _Stored:
    manifest: bytes
    chunks: list[bytes | None] = field(default_factory=list)
    snapshot: bool = False
    seal: SealWire | None = None

    @property
    def complete(self) -> bool:
        return self.seal is not None and all(c is not None for c in self.chunks)


@dataclass
class _Outbox:
    ch: Channel
    queue: deque[Command] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


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


class VersionFlow:
    def __init__(
        self,
        name: str,
        weights: Weights | None,
        version: int | None,
        *,
        keep_versions: int = DEFAULT_KEEP_VERSIONS,
        full_weights: bool = False,
        store: DeltaStore | None = None,
        sealer: Sealer | None = None,
        verifier: SealVerifier | None = None,
        seal: SealWire | None = None,
        threads: int = 1,
        coding: CodingPolicy | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.clock: Clock = clock or LoopClock()
        """The node's clock: a bulk transfer from the parent is timed on it (the link's rate is time on
        the network, virtual under a virtual clock); what the codec's work took is a stopwatch reading."""
        self.coding = coding or CodingPolicy("conditioned", 0.0)
        """The trainer: how each tensor's changed positions are coded (`aurora.actors.coding`)."""
        self.threads = max(1, threads)
        """Cores the codec may use: chunks of a version are encoded, and decoded, this many at a time."""
        self.weights = weights
        self.version = version
        self.digest: bytes | None = weights.digest() if weights is not None else None
        self.seal = seal
        """The seal of the version held (None: none known yet)."""
        self.sealer = sealer or UNSIGNED
        """The trainer: makes each published version's seal."""
        self.verifier = verifier or SealVerifier(None)
        """Every other node: checks the seals of what it commits (with the trainer's public key)."""
        self.changed: OrderedDict[int, frozenset[str] | None] = OrderedDict()
        """Per committed version, the tensors its delta touched (None: a snapshot, everything)."""
        self.keep_versions = keep_versions
        self.full_weights = full_weights
        """Publish every version as a snapshot (the full-weight baseline of the benchmarks)."""
        self.store = store
        """This node's versions on disk: a relay or rollout stores what it commits (deltas, and an
        anchor every ``store.anchor_every`` of them: `aurora.store.anchors`), so a restarted node
        resumes from it and a child far behind gets one composed delta instead of a chain or a snapshot."""
        self.router = VersionRouter(version)
        self.intake = Intake(name, version, authenticates=self.verifier.authenticates, held_sealed=seal is not None)
        """What this node accepts of its parent's version stream (`aurora.protocol.intake`)."""
        self.history: OrderedDict[int, _Stored] = OrderedDict()  # target version -> delta from target-1
        self._incoming: _Incoming | None = None
        self._hashes: dict[str, bytes] = {}
        """The trainer: BLAKE3 of each tensor of the version held (reused for tensors a step left alone)."""
        self.children: dict[str, _Outbox] = {}
        """The attached children — the node's one table of them: each one's channel and what the router
        asked to send it, in order, drained by that child's own task (`serve_child`), so a slow or stuck
        child holds up nobody else."""
        self._unreadable: set[int] = set()
        """Stored versions a composed catch-up could not read (corrupt): never composed from again."""
        self._served: OrderedDict[tuple[int | None, int], tuple[bytes, tuple[bytes, ...]]] = OrderedDict()
        """The last composed deltas and snapshots made for catch-ups: (from, to) -> (manifest, chunks); a
        snapshot only while it is being sent (`_sending`)."""
        self._sending: dict[tuple[int | None, int], int] = {}
        """Sends in flight of each snapshot in `_served`: children that ask meanwhile share it."""
        self._run_id: bytes | None = None
        self._tg: asyncio.TaskGroup | None = None
        """The owner of the anchor writes (`start_in`): the node's task group."""
        self._anchoring: asyncio.Task[None] | None = None
        """The anchor being written for the version stored last (`_promote`), a task of `_tg`."""
        self.weights_lock = asyncio.Lock()
        self.committed = asyncio.Event()
        """Set at every commit (a waiter clears it first): a rollout's worker wakes on a new version."""
        self.bytes_in = 0
        """Delta bytes received from parents (manifests and chunks)."""
        self.link_mbit: float | None = None
        """The rate (Mbit/s) the last bulk transfer from a parent came at — a snapshot or catch-up of at
        least `LINK_SAMPLE_BYTES`, manifest to last chunk (a streamed delta leaves the trainer as fast
        as it is encoded, so it times the encoder, not the link). Reported up to the trainer, whose
        coding choice takes the slowest (`aurora.actors.coding`)."""
        self.last_published: dict[str, Any] = {}
        """The trainer: bytes and density of the last version it published, and what sealing cost."""
        self.last_verify_s = 0.0
        """A relay or rollout: seconds its last commit spent verifying the seal (hash and signature)."""

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        """Write anchors, and decode arriving chunks ahead of the commit, in ``tg`` (the node's task
        group, their owner): an anchor write that fails other than with a store error is the node's
        crash, and ``tg`` awaits what is in flight when it closes. A flow with a store must be started
        before it stores a version; one never started decodes each version whole at its commit."""
        self._tg = tg

    # -- children
    def add_child(self, ch: Channel, version: int | None) -> None:
        """Attach a child; what it is to be sent goes to its outbox, which `serve_child` drains."""
        self.children[ch.peer] = _Outbox(ch)
        self.router.child_attached(ch.peer, version)
        self._dispatch(self.router.commands())

    def remove_child(self, peer: str) -> None:
        self.children.pop(peer, None)
        self.router.child_detached(peer)

    def channel(self, peer: str) -> Channel | None:
        """The channel of attached child ``peer`` (None: not attached)."""
        box = self.children.get(peer)
        return None if box is None else box.ch

    def channels(self) -> list[Channel]:
        """Every attached child's channel."""
        return [box.ch for box in self.children.values()]

    def on_child_version(self, peer: str, version: int) -> None:
        self.router.child_version(peer, version)
        self._dispatch(self.router.commands())

    async def serve_child(self, ch: Channel) -> None:
        """Send ``ch``'s outbox until the channel closes (then returns). Run by the task that serves
        that child, so what the child does (stop reading, vanish) stalls only this coroutine."""
        box = self.children.get(ch.peer)
        while box is not None and self.children.get(ch.peer) is box and not ch.closed:
            if not box.queue:
                box.wake.clear()
                await wait_first(box.wake.wait(), ch.wait_closed())
                continue
            cmd = box.queue.popleft()
            try:
                await self._send_one(ch, cmd)
            except TransportClosed:
                return
            except GoneFromHistory:
                ch.abort(f"{ch.peer!r} fell behind the versions this node keeps; reconnect to catch up")
                return

    # -- the trainer's side
    async def publish(self, new: Weights) -> int:
        """Make ``new`` the next version and stream its delta to the children as it is encoded, then
        its seal. With a store, the version is stored before the seal leaves."""
        if self.weights is None or self.version is None:
            raise ProtocolError("publish needs a current version to diff against", remote=False)
        t0 = time.perf_counter()
        target = self.version + 1
        base = None if self.full_weights else self.weights
        stats = EncodeStats()
        m, chunks = encode_stream(
            base,
            new,
            base_version=None if base is None else self.version,
            target_version=target,
            stats=stats,
            threads=self.threads,
            coding=await in_thread(self.coding.codings, list(new), self.coding.link()),
        )
        n = m.n_chunks
        packed = pack_manifest(m)
        stored = _Stored(packed, [None] * n, m.is_snapshot)
        hasher = DeltaHasher(packed, n)
        self._remember(target, stored)
        self.router.delta_started(DeltaInfo(self.version, target, n))
        # the state hash (all the weights, BLAKE3) runs in a thread while the chunks are encoded
        hashing = asyncio.ensure_future(in_thread(self._hash_state, new)) if self._signs else None
        self._dispatch(self.router.commands())
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
                    self.router.chunk_arrived(target, i)
                    i += 1
                self._dispatch(self.router.commands())
                await asyncio.sleep(0)
            t = time.perf_counter()
            state, hashes = (await hashing) if hashing is not None else (None, {})
            wait_s = time.perf_counter() - t
        finally:
            if hashing is not None and not hashing.done():
                await cancel_and_wait(hashing)  # the thread runs on, unheard
            if isinstance(chunks, Generator):
                chunks.close()  # a cancelled publish leaves no chunk jobs running
        t = time.perf_counter()
        wire = self.sealer.seal(
            v=target,
            base=None if m.is_snapshot else self.version,
            digest=m.target_digest,
            layout=weights_layout(new),
            state=state,
            delta=hasher.digest(),
        )
        seal_s = time.perf_counter() - t
        if self.store is not None:
            t = time.perf_counter()
            await self._store(m, stored.chunks, new, wire, in_place=False)
            store_s = time.perf_counter() - t
        stored.seal = wire
        self.router.seal_arrived(target)  # the seal goes out last
        async with self.weights_lock:
            self.weights, self.version, self.digest, self.seal = new, target, m.target_digest, wire
            self._hashes = hashes
        self._changed(target, None)
        self.router.version_committed(target)
        self._dispatch(self.router.commands())
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
            node=self.name,
            version=target,
            chunks=n,
            bytes=nbytes,
            snapshot=m.is_snapshot,
            publish_s=round(publish_s, 6),
            encode_s=round(encode_s, 6),
            store_s=round(store_s, 6),
            seal_s=round(seal_s, 6),
            hash_wait_s=round(wait_s, 6),
            signed=self._signs,
            changed=stats.changed,
            sparse_chunks=stats.sparse_chunks,
            density=round(stats.density, 6) if base is not None else None,
            digest=m.target_digest.hex()[:16],
        )
        return target

    @property
    def _signs(self) -> bool:
        return self.sealer.signs

    def _hash_state(self, new: Weights) -> tuple[bytes, dict[str, bytes]]:
        """The state hash of ``new``; a tensor that is the very array of the version held keeps its hash."""
        old = self.weights
        reuse = {n: h for n, h in self._hashes.items() if old is not None and n in new and new[n].bits is old[n].bits}
        hashes = tensor_hashes(new, reuse)
        return state_hash(new, hashes), hashes

    def first_seal(self) -> SealWire:
        """The trainer: version 0's (or the resumed version's) seal, made now."""
        assert self.weights is not None
        assert self.version is not None
        state, self._hashes = self._hash_state(self.weights) if self._signs else (None, {})
        self.seal = self.sealer.seal(
            v=self.version,
            base=None,
            digest=self.weights.digest(),
            layout=weights_layout(self.weights),
            state=state,
            delta=None,
        )
        return self.seal

    async def adopt(self, new: Weights) -> int:
        """Make ``new`` the next version here without delivering it (``sync.deliver: false``, the
        ideal run of `aurora bench rl`): nothing is encoded, stored or sent."""
        async with self.weights_lock:
            self.weights, self.version, self.digest = new, (self.version or 0) + 1, new.digest()
        self.last_published = {"bytes": 0, "density": None}
        log.info(VERSION_PUBLISHED, node=self.name, version=self.version, chunks=0, bytes=0, delivered=False)
        return self.version

    # -- a relay's or rollout's side
    async def on_parent_message(self, msg: Message) -> int | None:
        """Feed one version-stream message from the parent; returns the version just committed, if
        any. Raises `DeltaFormatError`, `AuthError` or `ProtocolError` for what the parent got wrong
        (nothing changes then; the caller leaves that parent). The rules are `Intake`'s; this
        carries out what it says."""
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

    def _abandon(self, commands: list[IntakeCommand]) -> None:
        """Forget a delta that will not be committed: its history entry, its routing, what is queued of it."""
        for cmd in commands:
            assert isinstance(cmd, Abandon), cmd
            if self._incoming is not None and self._incoming.manifest.target_version == cmd.target:
                self._incoming = None
            if not cmd.streamed:
                continue
            self.history.pop(cmd.target, None)
            self.router.delta_abandoned(cmd.target)
            for box in self.children.values():
                box.queue = deque(c for c in box.queue if not (isinstance(c, _Streamed) and _target(c) == cmd.target))

    async def _run(self, commands: list[IntakeCommand]) -> int | None:
        """Carry out `Intake`'s commands in order; the version committed if one was."""
        committed = None
        for cmd in commands:
            inc = self._incoming
            if isinstance(cmd, Abandon):
                self._abandon([cmd])
            elif isinstance(cmd, Forward):
                assert inc is not None
                self.router.chunk_arrived(cmd.target, cmd.chunk)
                self._dispatch(self.router.commands())
            elif isinstance(cmd, DecodeAhead):
                assert inc is not None
                if self._tg is not None and (inc.decoding is None or inc.decoding.done()):
                    decoding = self._decode_ahead(inc)
                    try:
                        inc.decoding = self._tg.create_task(decoding)
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
        if self.seal is not None and self.verifier.authenticates:
            if self._run_id is None:
                self._run_id = self.verifier.open(self.seal).run
            if seal.run != self._run_id:
                raise AuthError(
                    f"{self.name}: version {seal.v} is of another run ({seal.run.hex()[:8]}, this node's "
                    f"is {self._run_id.hex()[:8]})"
                )
        return seal

    def _begin(self, h: DeltaManifest, packed: bytes) -> list[IntakeCommand]:
        # refused before it is parsed where that can be known: a first version without its seal, or a
        # manifest whose tensor count is not that of the weights held (parsing costs O(manifest bytes))
        if self.intake.refuses_unparsed(h.seal is not None):
            raise AuthError(f"{self.name}: a first version must come with its seal")
        m = unpack_manifest(packed, tensors=None if self.weights is None else len(self.weights))
        # nothing is allocated for a manifest before its layout is known to be the right one
        fits = self.weights is None or manifest_layout(m) == weights_layout(self.weights)
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
            self._remember(m.target_version, _Stored(packed, [None] * m.n_chunks, m.is_snapshot))
            self.router.delta_started(DeltaInfo(self.version or 0, m.target_version, m.n_chunks))
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
            self.history[target].chunks[i] = data
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
        base = self.weights  # what `_commit` stages against (a snapshot, against nothing, is not decoded ahead)
        rx = inc.receiver
        while self._incoming is inc:
            items = rx.undecoded(base)  # taken here, where chunks are added: the thread reads only these
            if not items or not await in_thread(rx.decode_ahead, items, base, threads=self.threads):
                return

    async def _sealed(self, target: int, wire: SealWire) -> int | None:
        inc = self._incoming
        if inc is None or inc.manifest.target_version != target or not inc.receiver.complete or inc.seal is not None:
            raise ProtocolError(f"{self.name}: a seal for version {target} out of place", remote=True)
        inc.seal = (self._open(wire, inc.manifest), wire)
        return await self._finish(inc)

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
            self.history[target].seal = wire
            self.router.seal_arrived(target)
            self._dispatch(self.router.commands())
        return await self._commit(inc, wire, trusted_bytes, trust.check_state, verify_s)

    async def _commit(
        self, inc: _Incoming, wire: SealWire | None, trusted_bytes: bool, check_state: bool, verify_s: float
    ) -> int:
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
        async with self.weights_lock:
            if m.is_snapshot or self.weights is None:
                self.weights, cancelled = await to_the_end(_commit_snapshot, inc, check, self.threads)
            else:  # decode and apply in one thread hand-off, in place
                touched, cancelled = await to_the_end(
                    _decode_and_apply, inc.receiver, self.weights, check, self.threads
                )
            self.version, self.digest, self.seal = target, m.target_digest, wire
            self.intake.committed(target, sealed=wire is not None)
        self._incoming = None
        # the node holds ``target`` now, whatever comes next (a cancellation, a store that fails): its
        # router and children learn it at once, or the next delta from the parent would not fit the router
        kept = self.history.get(target) if inc.streamed else None
        self._changed(target, touched)
        if not inc.streamed:
            self.history.clear()  # older deltas no longer lead to this version
        self.router.version_committed(target)
        self._dispatch(self.router.commands())
        if cancelled:
            raise asyncio.CancelledError
        if check_state:
            verify_s += time.perf_counter() - t
        self.last_verify_s = verify_s
        if self.store is not None:
            w = self.weights
            assert w is not None
            await self._store(m, None if kept is None else kept.chunks, w, wire, prune=True)
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

    # -- executing the router's commands
    def _dispatch(self, commands: list[Command]) -> None:
        """Queue each command on its child's outbox (never waits). A child that is not keeping up —
        what waits for it is of a version the history no longer holds, or past `MAX_QUEUED` messages —
        has its channel closed (it reconnects and catches up)."""
        for cmd in commands:
            box = self.children.get(cmd.child)
            if box is None:
                continue
            head = box.queue[0] if box.queue else None
            stale = isinstance(head, _Streamed) and _target(head) not in self.history
            if stale or len(box.queue) >= MAX_QUEUED:
                box.ch.abort(
                    f"{cmd.child!r} is not reading: it fell {len(box.queue)} messages behind, past the "
                    "versions this node keeps; reconnect to catch up"
                )
                self.remove_child(cmd.child)
                continue
            box.queue.append(cmd)
            box.wake.set()

    def _held(self, version: int) -> _Stored:
        """Version ``version`` from the history; `GoneFromHistory` if it has left it."""
        stored = self.history.get(version)
        if stored is None:
            raise GoneFromHistory(version)
        return stored

    async def _send_one(self, ch: Channel, cmd: Command) -> None:
        if isinstance(cmd, SendManifest):
            stored = self._held(cmd.delta.target)
            await ch.send(
                DeltaManifest(
                    base=cmd.delta.base if not stored.snapshot else None,
                    target=cmd.delta.target,
                    n=cmd.delta.chunks,
                ),
                stored.manifest,
            )
        elif isinstance(cmd, SendChunk):
            chunk = self._held(cmd.target).chunks[cmd.index]
            assert chunk is not None
            await ch.send(DeltaChunk(target=cmd.target, i=cmd.index), chunk)
        elif isinstance(cmd, SendSeal):
            seal = self._held(cmd.target).seal
            assert seal is not None
            await ch.send(DeltaSeal(target=cmd.target, seal=seal))
        elif isinstance(cmd, SendCatchUp):
            await self._catch_up(ch, cmd)

    async def _store(
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
            self._anchoring = self._tg.create_task(self._promote(m.target_version, weights, seal, in_place))

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

    async def _send_composed(self, ch: Channel, have: int, reason: str) -> bool:
        """One delta from the child's version (read back from the store) to the current one; False
        when a snapshot would be as small (the encoder's ``prefer_snapshot``: then the caller chooses
        again without the store)."""
        assert self.store is not None
        store = self.store

        def compose(weights: Weights, version: int) -> tuple[bytes, tuple[bytes, ...]] | None:
            d = encode(store.get(have), weights, base_version=have, target_version=version, threads=self.threads)
            return None if d.prefer_snapshot else (pack_manifest(d.manifest), d.chunks)

        made = await self._made(have, compose)
        if made is None:
            return False
        version, seal, (manifest, chunks) = made
        await _send_delta(ch, have, version, manifest, chunks, seal)
        log.info(CATCH_UP_SENT, node=self.name, child=ch.peer, composed=True, base=have, version=version, reason=reason)
        return True

    async def _made(self, have: int | None, make: Any) -> tuple[int, SealWire | None, Any] | None:
        """A catch-up from ``have`` to the version held, made once and shared (`KEEP_SERVED`): a child
        that reconnects, or many that ask at once, cost one encode, not one each."""
        async with self.weights_lock:
            weights, version, seal = self.weights, self.version, self.seal
            assert weights is not None
            assert version is not None
            key = (have, version)
            made = self._served.get(key)
            if made is None:
                made = await in_thread(make, weights, version)
                if made is None:
                    return None
                self._served[key] = made
                # the oldest go first, but never a snapshot being sent (another child may ask for it)
                for old in [k for k in self._served if k not in self._sending][
                    : max(0, len(self._served) - KEEP_SERVED)
                ]:
                    del self._served[old]
            return version, seal, made

    async def _catch_up(self, ch: Channel, cmd: SendCatchUp) -> None:
        """Send a behind child what `choose_catch_up` chooses; the one thing decided here is a composed
        delta too big to be worth it (`_send_composed`), when the choice made without the store goes
        instead. Each send logs the choice's reason."""
        have, store = cmd.from_version, self.store

        def choose(stored: bool) -> CatchUp:
            complete = {v: s.snapshot for v, s in self.history.items() if s.complete}
            return choose_catch_up(have, cmd.to_version, complete, stored=stored)

        usable = store is not None and have is not None and have in store and have not in self._unreadable
        choice = choose(usable)
        if isinstance(choice, Compose):
            try:
                if await self._send_composed(ch, choice.base, choice.reason):
                    return
            except StoreError as e:  # this node's copy of the child's version is bad: the next way, not a retry
                self._unreadable.add(choice.base)
                log.warning(CATCH_UP_STORE_FAILED, node=self.name, child=ch.peer, base=choice.base, error=str(e))
            # the history may have moved on while the composed delta was made: choose from it as it is
            choice = choose(False)
        if isinstance(choice, Replay):
            chain = [(v, self._held(v)) for v in range(choice.first, choice.to + 1)]  # held while they go
            for v, s in chain:
                await _send_delta(
                    ch, None if s.snapshot else v - 1, v, s.manifest, [c for c in s.chunks if c is not None], s.seal
                )
            log.info(CATCH_UP_SENT, node=self.name, child=ch.peer, versions=len(chain), reason=choice.reason)
            return
        if self.weights is None:
            raise ProtocolError(f"{self.name}: no weights to send {ch.peer!r} a snapshot from", remote=False)

        def snapshot(weights: Weights, version: int) -> tuple[bytes, tuple[bytes, ...]]:
            snap = encode(None, weights, base_version=None, target_version=version, threads=self.threads)
            return pack_manifest(snap.manifest), snap.chunks

        made = await self._made(None, snapshot)  # labelled with what the weights are now
        assert made is not None
        version, seal, (manifest, chunks) = made
        key = (None, version)
        self._sending[key] = self._sending.get(key, 0) + 1
        try:
            await _send_delta(ch, None, version, manifest, chunks, seal)
        finally:
            self._sending[key] -= 1
            if not self._sending[key]:  # the size of the weights: kept made only while it is being sent
                del self._sending[key]
                self._served.pop(key, None)
        log.info(SNAPSHOT_SENT, node=self.name, child=ch.peer, version=version, reason=choice.reason)

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

    def _changed(self, version: int, touched: frozenset[str] | None) -> None:
        self.committed.set()
        self.changed[version] = touched
        while len(self.changed) > 4 * self.keep_versions:
            self.changed.popitem(last=False)

    def _remember(self, target: int, stored: _Stored) -> None:
        self.history[target] = stored
        while len(self.history) > self.keep_versions:
            self.history.popitem(last=False)
        snapshots = [v for v, h in self.history.items() if h.snapshot]
        if len(snapshots) > KEEP_SNAPSHOTS:
            # full weights each: only the newest are worth their memory, and those still going out
            queued = {_target(c) for box in self.children.values() for c in box.queue if isinstance(c, _Streamed)}
            for v in snapshots[:-KEEP_SNAPSHOTS]:
                if v not in queued:
                    del self.history[v]


class GoneFromHistory(Exception):
    """What a child was to be sent has left this node's history: the child fell too far behind."""


_Streamed = SendManifest | SendChunk | SendSeal
"""The commands that send part of a streamed delta (which the history must still hold)."""


def _target(cmd: SendManifest | SendChunk | SendSeal) -> int:
    return cmd.delta.target if isinstance(cmd, SendManifest) else cmd.target


def _decode_and_apply(rx: DeltaReceiver, w: Weights, check: Any, threads: int) -> frozenset[str]:
    """Stage every chunk against ``w`` (``threads`` chunks at a time), then apply them in place: the
    tensors touched. ``check`` (the seal's state) runs on the result before the commit stands."""
    return frozenset(rx.stage(w, threads=threads).commit(w, check=check))


def _encode_slice(chunks: Iterator[bytes], left: int) -> list[bytes]:
    """The next chunks encoded within about `ENCODE_SLICE_S` (at least one, at most ``left``)."""
    t0, out = time.perf_counter(), [next(chunks)]
    while len(out) < left and time.perf_counter() - t0 < ENCODE_SLICE_S:
        out.append(next(chunks))
    return out


async def _send_delta(
    ch: Channel, base: int | None, target: int, manifest: bytes, chunks: Sequence[bytes], seal: SealWire | None
) -> None:
    """One whole delta (or snapshot, ``base`` None) to one child: the manifest with the seal, then every chunk."""
    await ch.send(DeltaManifest(base=base, target=target, n=len(chunks), seal=seal), manifest)
    for i, c in enumerate(chunks):
        await ch.send(DeltaChunk(target=target, i=i), c)


def _commit_snapshot(inc: _Incoming, check: Any, threads: int) -> Weights:
    fresh = blank_weights(inc.manifest)
    inc.receiver.stage(None, threads=threads).commit(fresh, check=check, restore=False)  # dropped if it fails
    return fresh
