"""`VersionFlow`: a node's weight versions flowing in from its parent and out to its children.

The driver for `aurora.protocol.routing.VersionRouter` over `Channel`s, with
the codec doing the bytes. The trainer calls `publish` with each new version:
the delta is encoded chunk by chunk and each chunk goes to the children as it
is produced. A relay or rollout node feeds what its parent sends into
`on_parent_message`: every chunk is verified on arrival (`DeltaReceiver.add`)
and forwarded at once (cut-through); the version is committed all-or-nothing
when the last chunk is in. Children report their versions with ``version``
messages (`on_child_message`); a child that is behind gets the missing deltas
in order from the node's recent history, or a snapshot when they are gone.

Wire messages (headers; buffers carry the bytes):

* ``delta_manifest`` {base, target, n} + packed manifest — n chunks follow;
* ``delta_chunk`` {target, i} + packed chunk;
* ``version`` {v} — from a child: the version it now holds.

Invariants: a node applies a delta only onto the version it was made from (or
a snapshot onto anything), so versions only move forward, one verified
commit at a time; a chunk that fails verification raises `DeltaFormatError`
and changes nothing. The weights change only under `weights_lock`, so a
reader holding it (a rollout engine copying them) sees one whole version.
With a store, `publish` stores the version before its last chunk leaves, so no
child can commit a version the trainer has not stored.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aurora.transport.base import Channel, Message

from aurora.codec import Weights
from aurora.codec.decoder import DeltaReceiver, blank_weights
from aurora.codec.encoder import EncodeStats, encode, encode_stream
from aurora.codec.format import Manifest, pack_manifest, unpack_manifest
from aurora.errors import ProtocolError
from aurora.protocol.routing import Command, DeltaInfo, SendCatchUp, SendChunk, SendManifest, VersionRouter
from aurora.store import DeltaStore

log = structlog.get_logger("aurora.actors.flow")

DEFAULT_KEEP_VERSIONS = 8
ENCODE_SLICE_S = 0.005
"""`publish` encodes chunks on the event loop for about this long, then routes them and yields:
a small delta goes out in one slice, a big one still streams cut-through. (One thread hand-off
per chunk cost a scheduling round trip each on a loaded host: 25 made a 46 kB delta take 0.1 s.)"""


@dataclass
class _Stored:
    manifest: bytes
    chunks: list[bytes | None] = field(default_factory=list)
    snapshot: bool = False

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.chunks)


@dataclass
class _Incoming:
    manifest: Manifest
    receiver: DeltaReceiver
    streamed: bool
    """Routed to children chunk by chunk (a delta on the latest version, not a snapshot)."""


class VersionFlow:
    def __init__(self, name: str, weights: Weights | None, version: int | None, *,
                 keep_versions: int = DEFAULT_KEEP_VERSIONS, full_weights: bool = False,
                 store: DeltaStore | None = None) -> None:  # fmt: skip
        self.name = name
        self.weights = weights
        self.version = version
        self.digest: bytes | None = weights.digest() if weights is not None else None
        self.changed: OrderedDict[int, frozenset[str] | None] = OrderedDict()
        """Per committed version, the tensors its delta touched (None: a snapshot, everything)."""
        self.keep_versions = keep_versions
        self.full_weights = full_weights
        """Publish every version as a snapshot (the full-weight baseline of the benchmarks)."""
        self.store = store
        """This node's versions on disk: a relay or rollout stores what it commits (anchors every
        ``store.anchor_every`` versions, deltas between), so a restarted node resumes from it and a
        child far behind gets one composed delta instead of a chain or a snapshot."""
        self.router = VersionRouter(version)
        self.children: dict[str, Channel] = {}
        self.history: OrderedDict[int, _Stored] = OrderedDict()  # target version -> delta from target-1
        self._incoming: _Incoming | None = None
        self._send_lock = asyncio.Lock()  # command batches go out in the order the router made them
        self.weights_lock = asyncio.Lock()
        self.committed = asyncio.Event()
        """Set at every commit (a waiter clears it first): a rollout's worker wakes on a new version."""
        self.bytes_in = 0
        """Delta bytes received from parents (manifests and chunks)."""
        self.last_published: dict[str, Any] = {}
        """The trainer: bytes and density of the last version it published."""

    # -- children
    async def add_child(self, ch: Channel, version: int | None) -> None:
        self.children[ch.peer] = ch
        self.router.child_attached(ch.peer, version)
        await self._run(self.router.commands())

    def remove_child(self, peer: str) -> None:
        self.children.pop(peer, None)
        self.router.child_detached(peer)

    async def on_child_message(self, peer: str, msg: Message) -> None:
        if msg.header.get("k") == "version":
            self.router.child_version(peer, int(msg.header["v"]))
            await self._run(self.router.commands())

    # -- the trainer's side
    async def publish(self, new: Weights) -> int:
        """Make ``new`` the next version and stream its delta to the children as it is encoded.

        With a store, the version is stored once every chunk is encoded and before the last one
        is routed."""
        if self.weights is None or self.version is None:
            raise ProtocolError("publish needs a current version to diff against", remote=False)
        t0 = time.monotonic()
        target = self.version + 1
        base = None if self.full_weights else self.weights
        stats = EncodeStats()
        m, chunks = encode_stream(base, new, base_version=None if base is None else self.version,
                                  target_version=target, stats=stats)  # fmt: skip
        n = m.n_chunks
        stored = _Stored(pack_manifest(m), [None] * n, m.is_snapshot)
        self._remember(target, stored)
        self.router.delta_started(DeltaInfo(self.version, target, n))
        await self._run(self.router.commands())
        i, encode_s, store_s = 0, 0.0, 0.0
        while i < n:
            # encoded here in short slices, yielding between them so heartbeats keep flowing
            t = time.monotonic()
            batch = _encode_slice(chunks, n - i)
            encode_s += time.monotonic() - t
            for c in batch:
                stored.chunks[i] = c
                if i == n - 1 and self.store is not None:
                    t = time.monotonic()
                    await asyncio.to_thread(self._keep, m, stored.chunks, new)
                    store_s = time.monotonic() - t
                self.router.chunk_arrived(target, i)
                i += 1
            await self._run(self.router.commands())
            await asyncio.sleep(0)
        async with self.weights_lock:
            self.weights, self.version, self.digest = new, target, m.target_digest
        self._changed(target, None)
        self.router.version_committed(target)
        await self._run(self.router.commands())
        nbytes = len(stored.manifest) + sum(len(c) for c in stored.chunks if c is not None)
        self.last_published = {"bytes": nbytes, "density": round(stats.density, 6) if base is not None else None}
        log.info("version_published", node=self.name, version=target, chunks=n, bytes=nbytes,
                 snapshot=m.is_snapshot, publish_s=round(time.monotonic() - t0, 6), encode_s=round(encode_s, 6),
                 store_s=round(store_s, 6), changed=stats.changed,
                 density=round(stats.density, 6) if base is not None else None,
                 digest=m.target_digest.hex()[:16])  # fmt: skip
        return target

    async def adopt(self, new: Weights) -> int:
        """Make ``new`` the next version here without delivering it (``sync.deliver: false``, the
        ideal run of `aurora bench rl`): nothing is encoded, stored or sent."""
        async with self.weights_lock:
            self.weights, self.version, self.digest = new, (self.version or 0) + 1, new.digest()
        self.last_published = {"bytes": 0, "density": None}
        log.info("version_published", node=self.name, version=self.version, chunks=0, bytes=0, delivered=False)
        return self.version

    # -- a relay's or rollout's side
    async def on_parent_message(self, msg: Message) -> int | None:
        """Feed one message from the parent; returns the version just committed, if any."""
        h = msg.header
        k = h.get("k")
        self.bytes_in += sum(len(b) for b in msg.buffers)
        if k == "delta_manifest":
            self._begin(bytes(msg.buffers[0]))
            return None
        if k == "delta_chunk":
            return await self._chunk(int(h["target"]), int(h["i"]), bytes(msg.buffers[0]))
        return None

    def _begin(self, packed: bytes) -> None:
        m = unpack_manifest(packed)
        if not m.is_snapshot and m.base_version != self.version:
            raise ProtocolError(f"{self.name}: parent sent a delta from version {m.base_version}, "
                                f"this node holds {self.version}", remote=True)  # fmt: skip
        rx = DeltaReceiver(m)
        # the next version (a delta, or a snapshot of the full-weight baseline) is forwarded chunk by chunk
        streamed = self.version is not None and m.target_version == self.version + 1
        self._incoming = _Incoming(m, rx, streamed)
        if streamed:
            self._remember(m.target_version, _Stored(packed, [None] * m.n_chunks, m.is_snapshot))
            self.router.delta_started(DeltaInfo(self.version or 0, m.target_version, m.n_chunks))

    async def _chunk(self, target: int, i: int, data: bytes) -> int | None:
        inc = self._incoming
        if inc is None or inc.manifest.target_version != target or not 0 <= i < inc.manifest.n_chunks:
            raise ProtocolError(f"{self.name}: chunk {i} of version {target} was not announced", remote=True)
        inc.receiver.add(data)  # verified here; a bad chunk raises and nothing changes
        if inc.streamed:
            stored = self.history[target]
            stored.chunks[i] = data
            self.router.chunk_arrived(target, i)
            await self._run(self.router.commands())
        if not inc.receiver.complete:
            return None
        self._incoming = None
        touched: frozenset[str] | None = None
        if inc.manifest.is_snapshot or self.weights is None:
            fresh = await asyncio.to_thread(_commit_snapshot, inc)
            async with self.weights_lock:
                self.weights = fresh
                self.version, self.digest = target, inc.manifest.target_digest
        else:
            w = self.weights
            async with self.weights_lock:  # decode and apply in one thread hand-off
                touched = await asyncio.to_thread(_decode_and_apply, inc.receiver, w)
                self.version, self.digest = target, inc.manifest.target_digest
        self._changed(target, touched)
        if self.store is not None:
            kept = self.history.get(target) if inc.streamed else None
            w = self.weights
            await asyncio.to_thread(self._keep, inc.manifest, None if kept is None else kept.chunks, w, prune=True)
        if not inc.streamed:
            self.history.clear()  # older deltas no longer lead to this version
        self.router.version_committed(target)
        await self._run(self.router.commands())
        log.info("version_committed", node=self.name, version=target, snapshot=inc.manifest.is_snapshot,
                 digest=inc.manifest.target_digest.hex()[:16])  # fmt: skip
        return target

    # -- executing the router's commands
    async def _run(self, commands: list[Command]) -> None:
        """Send a batch of router commands. Batches are serialised (FIFO lock) so that two tasks
        (the parent's stream and a child's report) never interleave messages to one child."""
        async with self._send_lock:
            await self._send_all(commands)

    async def _send_all(self, commands: list[Command]) -> None:
        for cmd in commands:
            ch = self.children.get(cmd.child)
            if ch is None:
                continue
            if isinstance(cmd, SendManifest):
                stored = self.history[cmd.delta.target]
                await ch.send({"k": "delta_manifest", "base": cmd.delta.base, "target": cmd.delta.target,
                               "n": cmd.delta.chunks}, stored.manifest)  # fmt: skip
            elif isinstance(cmd, SendChunk):
                chunk = self.history[cmd.target].chunks[cmd.index]
                assert chunk is not None
                await ch.send({"k": "delta_chunk", "target": cmd.target, "i": cmd.index}, chunk)
            elif isinstance(cmd, SendCatchUp):
                await self._catch_up(ch, cmd)

    def _keep(self, m: Manifest, chunks: list[bytes | None] | None, weights: Weights, *, prune: bool = False) -> None:
        """Store version ``m.target_version`` (``weights``): its delta when the base is the latest
        stored version, else (or every ``anchor_every`` versions) an anchor; ``prune`` then drops
        all but the recent versions (a relay's or rollout's store; the trainer's keeps them all)."""
        store, v = self.store, m.target_version
        assert store is not None
        latest = store.latest()
        if latest is not None and v <= latest:
            return  # already there (a restarted node catching up to what it had)
        full = chunks is None or any(c is None for c in chunks) or m.is_snapshot or m.base_version != latest
        if full or v % store.anchor_every == 0:
            store.put_anchor(v, weights)
        else:
            assert chunks is not None
            store.put_delta(m, [c for c in chunks if c is not None])
        if prune:
            store.prune(keep_last=max(store.anchor_every, self.keep_versions) * 2)

    async def _send_composed(self, ch: Channel, have: int) -> bool:
        """One delta from the child's version (read back from the store) to the current one; False
        when a snapshot would be as small (then the caller sends what it would have)."""
        assert self.store is not None
        async with self.weights_lock:
            weights, version = self.weights, self.version
            assert weights is not None
            assert version is not None
            base = await asyncio.to_thread(self.store.get, have)
            d = await asyncio.to_thread(encode, base, weights, base_version=have, target_version=version)
        if d.prefer_snapshot:
            return False
        await _send_delta(ch, have, version, pack_manifest(d.manifest), d.chunks)
        log.info("catch_up_sent", node=self.name, child=ch.peer, composed=True, base=have, version=version)
        return True

    async def _catch_up(self, ch: Channel, cmd: SendCatchUp) -> None:
        start = self._replay_from(cmd.from_version, cmd.to_version)
        have = cmd.from_version
        if (self.store is not None and have is not None and have in self.store
                and (start is None or start < cmd.to_version) and await self._send_composed(ch, have)):  # fmt: skip
            return  # two or more versions behind, or beyond the history: one composed delta
        if start is not None:
            chain = range(start, cmd.to_version + 1)
            for v in chain:
                s = self.history[v]
                await _send_delta(
                    ch, None if s.snapshot else v - 1, v, s.manifest, [c for c in s.chunks if c is not None]
                )
            log.info("catch_up_sent", node=self.name, child=ch.peer, versions=len(chain))
            return
        if self.weights is None:
            raise ProtocolError(f"{self.name}: no weights to send {ch.peer!r} a snapshot from", remote=False)
        async with self.weights_lock:  # label the snapshot with what the weights are now
            weights, version = self.weights, self.version
            assert version is not None
            snap = await asyncio.to_thread(encode, None, weights, base_version=None, target_version=version)
        await _send_delta(ch, None, version, pack_manifest(snap.manifest), snap.chunks)
        log.info("snapshot_sent", node=self.name, child=ch.peer, version=version)

    def _replay_from(self, have: int | None, to: int) -> int | None:
        """The first stored version of the shortest chain that brings a child holding ``have`` to
        ``to``: back from ``to`` until the delta from ``have``, or a stored snapshot (full-weight
        mode: one snapshot, not the whole chain of them). None when the history cannot."""
        v = to
        while v in self.history and self.history[v].complete:
            if self.history[v].snapshot or v - 1 == have:
                return v
            v -= 1
        return None

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


def _decode_and_apply(rx: DeltaReceiver, w: Weights) -> frozenset[str]:
    """Stage every chunk against ``w``, then apply them in place: the tensors touched."""
    return frozenset(rx.stage(w).commit(w))


def _encode_slice(chunks: Iterator[bytes], left: int) -> list[bytes]:
    """The next chunks encoded within about `ENCODE_SLICE_S` (at least one, at most ``left``)."""
    t0, out = time.perf_counter(), [next(chunks)]
    while len(out) < left and time.perf_counter() - t0 < ENCODE_SLICE_S:
        out.append(next(chunks))
    return out


async def _send_delta(ch: Channel, base: int | None, target: int, manifest: bytes, chunks: Sequence[bytes]) -> None:
    """One whole delta (or snapshot, ``base`` None) to one child: the manifest, then every chunk."""
    await ch.send({"k": "delta_manifest", "base": base, "target": target, "n": len(chunks)}, manifest)
    for i, c in enumerate(chunks):
        await ch.send({"k": "delta_chunk", "target": target, "i": i}, c)


def _commit_snapshot(inc: _Incoming) -> Weights:
    fresh = blank_weights(inc.manifest)
    inc.receiver.stage(None).commit(fresh)
    return fresh
