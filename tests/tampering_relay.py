"""A compromised relay, for tests: ``python -m tests.tampering_relay --topology T.yaml --name NAME``.

It runs the real relay (`aurora.node.run_node`, its own key, a real process) with one hook:
every delta or snapshot it sends a child is swapped for one that makes *altered* weights, with
every digest re-made as well as anyone without the trainer's signing key can — the manifest's
tensor and version digests and its delta id, every chunk's digest — and the trainer's seal passed
on unchanged (it cannot make one). It commits the trainer's real versions itself, so it stays in
the tree and keeps looking healthy to its children's probes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import numpy as np
from aurora.actors import catchup
from aurora.actors.fanout import Fanout
from aurora.transport.base import Channel

from aurora.codec import Weights
from aurora.codec.encoder import encode
from aurora.codec.format import pack_manifest
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.logs import configure
from aurora.node import run_node
from aurora.protocol.messages import DeltaChunk, DeltaManifest, DeltaSeal, SealWire
from aurora.protocol.routing import Command, SendChunk, SendManifest, SendSeal

_real_send_delta = catchup.send_delta
_forged: dict[int, tuple[bytes, tuple[bytes, ...]]] = {}


def _altered(w: Weights) -> Weights:
    """``w`` with one bit of the first tensor flipped: a version the trainer never made."""
    out = w.copy()
    first = next(iter(out))
    out[first].bits[:1] ^= np.array([1], dtype=out[first].bits.dtype)
    out.forget_digests()
    return out


async def _forged_send_delta(
    ch: Channel, base: int | None, target: int, manifest: bytes, chunks: object, seal: SealWire | None
) -> None:
    """A catch-up: a snapshot of altered weights, under the trainer's seal for ``target``."""
    held = _current[0].held
    assert held.weights is not None
    d = encode(None, _altered(held.weights), base_version=None, target_version=target)
    await _real_send_delta(ch, None, target, pack_manifest(d.manifest), d.chunks, seal)


_current: list[Fanout] = []


async def _forged_send_one(self: Fanout, ch: Channel, cmd: Command) -> None:
    """The stream: the manifest and chunks of a delta to altered weights, then the real seal."""
    _current[:] = [self]
    w = self.held.weights
    if isinstance(cmd, SendManifest):
        assert w is not None  # still the base: the relay commits after the seal
        if cmd.delta.target not in _forged:
            d = encode(w, _altered(w), base_version=cmd.delta.base, target_version=cmd.delta.target)
            _forged[cmd.delta.target] = (pack_manifest(d.manifest), d.chunks)
        manifest, chunks = _forged[cmd.delta.target]
        await ch.send(DeltaManifest(base=cmd.delta.base, target=cmd.delta.target, n=len(chunks)), manifest)
    elif isinstance(cmd, SendChunk):
        self.held.stored(cmd.target)  # GoneFromHistory: the child fell behind, as in the real relay
        await ch.send(DeltaChunk(target=cmd.target, i=cmd.index), _forged[cmd.target][1][cmd.index])
    elif isinstance(cmd, SendSeal):
        seal = self.held.stored(cmd.target).seal
        assert seal is not None
        await ch.send(DeltaSeal(target=cmd.target, seal=seal))
    else:
        await self.catch_ups.send(ch, cmd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", type=Path, required=True)
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    configure("info", "json")
    catchup.send_delta = _forged_send_delta  # type: ignore[assignment]
    Fanout._send_one = _forged_send_one  # type: ignore[method-assign]
    topo = load_topology(a.topology)

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await run_node(topo, plan(topo, str(a.topology)), a.name, stop, file=str(a.topology))

    asyncio.run(run())


if __name__ == "__main__":
    main()
