"""`VersionFlow`: a node's weight versions flowing in from its parent and out to its children — the
four parts of that job, built once per node, and the one view of them the node's actors use.

* `aurora.actors.held.HeldVersions` — what the node holds: the version and its weights (under
  ``weights_lock``), the recent deltas that lead to it, the store and its anchors;
* `aurora.actors.publish.Publishing` — the trainer: each new version encoded and sent as it is
  produced, then sealed, stored, held;
* `aurora.actors.intake.IntakeDriver` — a relay or rollout: the parent's stream checked, forwarded
  chunk by chunk (cut-through), decoded as it arrives and committed all or nothing once the seal
  verifies, by the rules of the sans-IO `aurora.protocol.intake.Intake`;
* `aurora.actors.fanout.Fanout` (with `aurora.actors.catchup.CatchUps`) — the children: the one
  table of them, the router's commands queued per child and sent by each child's own task, and the
  catch-ups (replay, composed delta, snapshot) of a child behind.

Wire messages (`aurora.protocol.messages`; buffers carry the bytes):

* `DeltaManifest` {base, target, n, seal?} + packed manifest — n chunks follow;
* `DeltaChunk` {target, i} + packed chunk;
* `DeltaSeal` {target, seal} — after the chunks of a streamed delta (a catch-up
  carries its seal in the manifest message instead);
* `Have` {v} — from a child: the version it now holds.

Invariants are each part's (see their docstrings); together: versions only move forward, one
verified commit at a time; with the trainer's key nothing is committed, stored or served that the
trainer did not seal; the trainer stores a version before its seal leaves.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from aurora.actors.catchup import CatchUps
from aurora.actors.coding import CodingPolicy
from aurora.actors.fanout import Fanout, Outbox
from aurora.actors.held import DEFAULT_KEEP_VERSIONS, HeldVersions, Stored
from aurora.actors.intake import IntakeDriver
from aurora.actors.publish import Publishing
from aurora.transport.base import Channel, Message

from aurora.auth.seal import Sealer, SealVerifier
from aurora.codec import Weights
from aurora.protocol.intake import Intake
from aurora.protocol.messages import SealWire
from aurora.protocol.routing import VersionRouter
from aurora.runtime.clock import Clock, LoopClock
from aurora.store import DeltaStore


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
        self.threads = max(1, threads)
        """Cores the codec may use: chunks of a version are encoded, and decoded, this many at a time."""
        self.held = HeldVersions(name, weights, version, seal=seal, keep_versions=keep_versions, store=store)
        self.fanout = Fanout(self.held, CatchUps(self.held, self.threads))
        self.publishing = Publishing(
            self.held, self.fanout, sealer=sealer, coding=coding, full_weights=full_weights, threads=self.threads
        )
        self.receiving = IntakeDriver(self.held, self.fanout, verifier or SealVerifier(None), self.clock, self.threads)

    def start_in(self, tg: asyncio.TaskGroup) -> None:
        """Write anchors, and decode arriving chunks ahead of the commit, in ``tg`` (the node's task
        group, their owner): an anchor write that fails other than with a store error is the node's
        crash, and ``tg`` awaits what is in flight when it closes. A flow with a store must be started
        before it stores a version; one never started decodes each version whole at its commit."""
        self.held.start_in(tg)

    # -- what the node holds
    @property
    def weights(self) -> Weights | None:
        return self.held.weights

    @property
    def version(self) -> int | None:
        return self.held.version

    @property
    def digest(self) -> bytes | None:
        return self.held.digest

    @property
    def seal(self) -> SealWire | None:
        return self.held.seal

    @property
    def weights_lock(self) -> asyncio.Lock:
        return self.held.weights_lock

    @property
    def committed(self) -> asyncio.Event:
        """Set at every new version (a waiter clears it first): a rollout's worker wakes on it."""
        return self.held.committed

    @property
    def history(self) -> OrderedDict[int, Stored]:
        return self.held.history

    @property
    def store(self) -> DeltaStore | None:
        return self.held.store

    def touched_since(self, version: int | None) -> frozenset[str] | None:
        return self.held.touched_since(version)

    # -- the trainer
    async def publish(self, new: Weights) -> int:
        return await self.publishing.publish(new)

    async def adopt(self, new: Weights) -> int:
        return await self.publishing.adopt(new)

    def first_seal(self) -> SealWire:
        return self.publishing.first_seal()

    @property
    def last_published(self) -> dict[str, Any]:
        return self.publishing.last_published

    # -- a relay or rollout
    async def on_parent_message(self, msg: Message) -> int | None:
        return await self.receiving.on_parent_message(msg)

    def parent_lost(self, *, left: bool = False) -> None:
        self.receiving.parent_lost(left=left)

    @property
    def intake(self) -> Intake:
        return self.receiving.intake

    @property
    def bytes_in(self) -> int:
        return self.receiving.bytes_in

    @property
    def link_mbit(self) -> float | None:
        return self.receiving.link_mbit

    # -- the children
    @property
    def router(self) -> VersionRouter:
        return self.fanout.router

    @property
    def children(self) -> dict[str, Outbox]:
        return self.fanout.children

    def add_child(self, ch: Channel, version: int | None) -> None:
        self.fanout.add_child(ch, version)

    def remove_child(self, peer: str) -> None:
        self.fanout.remove_child(peer)

    def channel(self, peer: str) -> Channel | None:
        return self.fanout.channel(peer)

    def channels(self) -> list[Channel]:
        return self.fanout.channels()

    def on_child_version(self, peer: str, version: int) -> None:
        self.fanout.on_child_version(peer, version)

    async def serve_child(self, ch: Channel) -> None:
        await self.fanout.serve_child(ch)
