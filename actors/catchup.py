"""`CatchUps`: what a child behind is sent — the missing deltas replayed from the history, one delta
composed from the store, or a snapshot — and the made ones shared between children.

Which way is `aurora.protocol.routing.choose_catch_up`'s rule; the one thing decided here is a
composed delta too big to be worth it (the encoder's ``prefer_snapshot``), or one whose stored base
is unreadable (`CATCH_UP_STORE_FAILED`), when the choice made without the store goes instead.

Invariants: every catch-up carries the seal of the version it makes, read with the weights under
``weights_lock`` (one whole version); a composed delta or snapshot is made once per (from, to) and
kept for `KEEP_SERVED` catch-ups, a snapshot only while it is being sent; a stored version that could
not be read is never composed from again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import structlog
from aurora.actors.held import HeldVersions
from aurora.transport.base import Channel

from aurora.codec import Weights
from aurora.codec.encoder import encode
from aurora.codec.format import pack_manifest
from aurora.errors import ProtocolError, StoreError
from aurora.events import CATCH_UP_SENT, CATCH_UP_STORE_FAILED, SNAPSHOT_SENT
from aurora.protocol.messages import DeltaChunk, DeltaManifest, SealWire
from aurora.protocol.routing import CatchUp, Compose, Replay, SendCatchUp, choose_catch_up
from aurora.runtime.threads import in_thread

log = structlog.get_logger("aurora.actors.flow")

KEEP_SERVED = 2
"""Catch-ups (composed deltas, snapshots) kept made: children that ask for the same one share it."""


class CatchUps:
    def __init__(self, held: HeldVersions, threads: int) -> None:
        self.held = held
        self.threads = threads
        self._unreadable: set[int] = set()
        """Stored versions a composed catch-up could not read (corrupt): never composed from again."""
        self._served: OrderedDict[tuple[int | None, int], tuple[bytes, tuple[bytes, ...]]] = OrderedDict()
        """The last composed deltas and snapshots made for catch-ups: (from, to) -> (manifest, chunks); a
        snapshot only while it is being sent (`_sending`)."""
        self._sending: dict[tuple[int | None, int], int] = {}
        """Sends in flight of each snapshot in `_served`: children that ask meanwhile share it."""

    async def send(self, ch: Channel, cmd: SendCatchUp) -> None:
        """Send a behind child what `choose_catch_up` chooses (see the module docstring). Each send
        logs the choice's reason."""
        held = self.held
        have, store = cmd.from_version, held.store

        def choose(stored: bool) -> CatchUp:
            complete = {v: s.snapshot for v, s in held.history.items() if s.complete}
            return choose_catch_up(have, cmd.to_version, complete, stored=stored)

        usable = store is not None and have is not None and have in store and have not in self._unreadable
        choice = choose(usable)
        if isinstance(choice, Compose):
            try:
                if await self._send_composed(ch, choice.base, choice.reason):
                    return
            except StoreError as e:  # this node's copy of the child's version is bad: the next way, not a retry
                self._unreadable.add(choice.base)
                log.warning(CATCH_UP_STORE_FAILED, node=held.name, child=ch.peer, base=choice.base, error=str(e))
            # the history may have moved on while the composed delta was made: choose from it as it is
            choice = choose(False)
        if isinstance(choice, Replay):
            chain = [(v, held.stored(v)) for v in range(choice.first, choice.to + 1)]  # held while they go
            for v, s in chain:
                await send_delta(
                    ch, None if s.snapshot else v - 1, v, s.manifest, [c for c in s.chunks if c is not None], s.seal
                )
            log.info(CATCH_UP_SENT, node=held.name, child=ch.peer, versions=len(chain), reason=choice.reason)
            return
        if held.weights is None:
            raise ProtocolError(f"{held.name}: no weights to send {ch.peer!r} a snapshot from", remote=False)

        def snapshot(weights: Weights, version: int) -> tuple[bytes, tuple[bytes, ...]]:
            snap = encode(None, weights, base_version=None, target_version=version, threads=self.threads)
            return pack_manifest(snap.manifest), snap.chunks

        made = await self._made(None, snapshot)  # labelled with what the weights are now
        assert made is not None
        version, seal, (manifest, chunks) = made
        key = (None, version)
        self._sending[key] = self._sending.get(key, 0) + 1
        try:
            await send_delta(ch, None, version, manifest, chunks, seal)
        finally:
            self._sending[key] -= 1
            if not self._sending[key]:  # the size of the weights: kept made only while it is being sent
                del self._sending[key]
                self._served.pop(key, None)
        log.info(SNAPSHOT_SENT, node=held.name, child=ch.peer, version=version, reason=choice.reason)

    async def _send_composed(self, ch: Channel, have: int, reason: str) -> bool:
        """One delta from the child's version (read back from the store) to the current one; False
        when a snapshot would be as small (the encoder's ``prefer_snapshot``: then the caller chooses
        again without the store)."""
        store = self.held.store
        assert store is not None

        def compose(weights: Weights, version: int) -> tuple[bytes, tuple[bytes, ...]] | None:
            d = encode(store.get(have), weights, base_version=have, target_version=version, threads=self.threads)
            return None if d.prefer_snapshot else (pack_manifest(d.manifest), d.chunks)

        made = await self._made(have, compose)
        if made is None:
            return False
        version, seal, (manifest, chunks) = made
        await send_delta(ch, have, version, manifest, chunks, seal)
        log.info(
            CATCH_UP_SENT, node=self.held.name, child=ch.peer, composed=True, base=have, version=version, reason=reason
        )
        return True

    async def _made(self, have: int | None, make: Any) -> tuple[int, SealWire | None, Any] | None:
        """A catch-up from ``have`` to the version held, made once and shared (`KEEP_SERVED`): a child
        that reconnects, or many that ask at once, cost one encode, not one each."""
        held = self.held
        async with held.weights_lock:
            weights, version, seal = held.weights, held.version, held.seal
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


async def send_delta(
    ch: Channel, base: int | None, target: int, manifest: bytes, chunks: Sequence[bytes], seal: SealWire | None
) -> None:
    """One whole delta (or snapshot, ``base`` None) to one child: the manifest with the seal, then every chunk."""
    await ch.send(DeltaManifest(base=base, target=target, n=len(chunks), seal=seal), manifest)
    for i, c in enumerate(chunks):
        await ch.send(DeltaChunk(target=target, i=i), c)
