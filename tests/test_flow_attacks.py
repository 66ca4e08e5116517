"""A version stream against hostile children and parents (`VersionFlow` over real channels): a child
that stops reading stalls no one else and is cut off; a child that vanishes mid-send costs the parent
nothing; a forged streamed delta is neither committed nor forwarded nor served; a sealed version of
another run is refused."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from aurora.actors.flow import VersionFlow
from aurora.transport.base import Channel, Message
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aurora.auth.seal import Sealer, SealVerifier
from aurora.codec import Weights
from aurora.codec.format import pack_chunk, unpack_chunk
from aurora.errors import AuthError, TransportClosed
from aurora.protocol.link import bulk_size
from aurora.protocol.messages import DeltaChunk, DeltaSeal, Have
from aurora.testing.memory import memory_channel_pair
from tests.helpers import perturb

KEY = Ed25519PrivateKey.generate()
VERIFIER = SealVerifier(KEY.public_key())


def _w0() -> Weights:
    rng = np.random.default_rng(0)
    return Weights.from_tensors(
        {"a": rng.standard_normal((128, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    )


async def _follow(flow: VersionFlow, up: Channel, log: list[str]) -> None:
    with contextlib.suppress(TransportClosed):
        while True:
            m = await up.recv()
            log.append(type(m.msg).__name__)
            try:
                v = await flow.on_parent_message(m)
            except (AuthError, ValueError) as e:
                log.append(f"failed: {type(e).__name__}")
                return
            if v is not None:
                log.append(f"committed v{v}")
                await up.send(Have(v=v))


async def _feed(flow: VersionFlow, msgs: list[Message]) -> None:
    for m in msgs:
        await flow.on_parent_message(m)


async def _listen(flow: VersionFlow, down: Channel) -> None:
    with contextlib.suppress(TransportClosed):
        while True:
            m = (await down.recv()).msg
            assert isinstance(m, Have)
            flow.on_child_version(down.peer, m.v)


async def test_a_child_that_never_reads_stalls_no_one_and_is_cut_off() -> None:
    w0 = _w0()
    trainer = VersionFlow("trainer", w0.copy(), 0)
    honest = VersionFlow("honest", None, None)
    async with asyncio.TaskGroup() as tg:
        d1, u1 = memory_channel_pair("trainer", "honest", window=8)
        tg.create_task(_follow(honest, u1, []))
        tg.create_task(_listen(trainer, d1))
        trainer.add_child(d1, None)
        tg.create_task(trainer.serve_child(d1))
        # never reads u2, and says it keeps up; its bulk lane holds about 8 of these small messages
        d2, u2 = memory_channel_pair("trainer", "evil", window=8, bulk_bytes=8 * bulk_size(512))
        tg.create_task(_listen(trainer, d2))
        trainer.add_child(d2, 0)
        tg.create_task(trainer.serve_child(d2))
        w = w0
        for v in range(1, 40):
            w = perturb(w, 0.01, v)
            await asyncio.wait_for(trainer.publish(w), 5.0)  # never waits for a child
            if not u2.closed:
                await u2.send(Have(v=v))
        async with asyncio.timeout(10):
            while honest.version != trainer.version:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert honest.digest == trainer.digest
        assert d2.closed  # fell behind its history: cut off, to reconnect and catch up
        assert "behind" in (d2.close_reason or "") or "not reading" in (d2.close_reason or "")
        for ch in (d1, u1, d2, u2):
            await ch.close("test over")


async def test_a_child_that_vanishes_mid_send_costs_the_publisher_nothing() -> None:
    trainer = VersionFlow("trainer", _w0(), 0)
    async with asyncio.TaskGroup() as tg:
        down, up = memory_channel_pair("trainer", "gone", window=2, bulk_bytes=2 * bulk_size(512))
        trainer.add_child(down, 0)
        tg.create_task(trainer.serve_child(down))
        w = trainer.weights
        assert w is not None
        await trainer.publish(perturb(w, 0.05, 1))
        await up.close("bye")  # the child goes while its sender waits for credit
        await trainer.publish(perturb(w, 0.05, 2))  # raises nothing
        assert trainer.version == 2


async def test_a_forged_streamed_delta_is_not_committed_forwarded_or_served() -> None:
    """A compromised relay streams the trainer's v1 with one chunk altered (its digest re-made) and the
    trainer's real seal: the honest relay below refuses it, forwards no seal, keeps nothing of it."""
    w0 = _w0()
    trainer = VersionFlow("trainer", w0.copy(), 0, sealer=Sealer(KEY, bytes(16)), verifier=VERIFIER)
    seal0 = trainer.first_seal()
    got: list[Message] = []
    down, up = memory_channel_pair("trainer", "bad-relay", window=64)
    trainer.add_child(down, 0)
    async with asyncio.TaskGroup() as tg:
        sender = tg.create_task(trainer.serve_child(down))
        await trainer.publish(perturb(w0, 0.05, 1))
        while len(got) < 2 or not isinstance(got[-1].msg, DeltaSeal):
            got.append(await asyncio.wait_for(up.recv(), 5))
        sender.cancel()
    chunk = unpack_chunk(bytes(got[1].buffers[0]))
    body = bytearray(chunk.body)
    body[len(body) // 2] ^= 0x10
    forged = [got[0], Message(got[1].msg, (memoryview(pack_chunk(chunk.header, bytes(body))),)), *got[2:]]
    assert isinstance(forged[1].msg, DeltaChunk)
    relay = VersionFlow("relay", w0.copy(), 0, verifier=VERIFIER, seal=seal0)
    below: list[str] = []
    async with asyncio.TaskGroup() as tg:
        d, u = memory_channel_pair("relay", "child", window=64)
        child = VersionFlow("child", w0.copy(), 0, verifier=VERIFIER, seal=seal0)
        tg.create_task(_follow(child, u, below))
        relay.add_child(d, 0)
        tg.create_task(relay.serve_child(d))
        with pytest.raises(AuthError, match="not the one the trainer sealed"):
            await _feed(relay, forged)
        relay.parent_lost()
        await asyncio.sleep(0.05)
        assert relay.version == 0
        assert "DeltaSeal" not in below  # the seal was not passed on
        assert 1 not in relay.history
        assert relay.router.inflight is None
        await d.close("test over")
        await u.close("test over")


async def test_a_sealed_version_of_another_run_is_refused() -> None:
    w0 = _w0()
    run_a = VersionFlow("trainer-a", w0.copy(), 0, sealer=Sealer(KEY, b"A" * 16), verifier=VERIFIER)
    run_b = VersionFlow("trainer-b", w0.copy(), 0, sealer=Sealer(KEY, b"B" * 16), verifier=VERIFIER)
    node = VersionFlow("node", w0.copy(), 0, verifier=VERIFIER, seal=run_b.first_seal())
    run_a.first_seal()
    msgs: list[Message] = []
    down, up = memory_channel_pair("trainer-a", "node", window=64)
    run_a.add_child(down, 0)
    async with asyncio.TaskGroup() as tg:
        sender = tg.create_task(run_a.serve_child(down))
        await run_a.publish(perturb(w0, 0.05, 1))
        while not msgs or not isinstance(msgs[-1].msg, DeltaSeal):
            msgs.append(await asyncio.wait_for(up.recv(), 5))
        sender.cancel()
    with pytest.raises(AuthError, match="another run"):
        await _feed(node, msgs)
    assert node.version == 0
