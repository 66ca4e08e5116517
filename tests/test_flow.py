"""Weight versions down a relay tree over real channels: bit-exact everywhere, catch-up, snapshots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aurora.actors.coding import CodingPolicy
from aurora.actors.flow import VersionFlow
from aurora.transport.base import Channel
from structlog.testing import capture_logs

from aurora.codec import Weights
from aurora.errors import TransportClosed
from aurora.events import ANCHOR_NOT_WRITTEN, CATCH_UP_SENT, CODING_CHOSEN, SNAPSHOT_SENT, VERSION_PUBLISHED
from aurora.protocol.messages import Have
from aurora.testing.memory import memory_channel_pair
from tests.helpers import perturb


def _model(seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    return Weights.from_tensors(
        {
            "embed": rng.standard_normal((64, 32)).astype(np.float32),
            "layer.w": rng.standard_normal((32, 32)).astype(np.float32),
            "layer.b": rng.standard_normal(32).astype(np.float32),
        }
    )


async def _follow(flow: VersionFlow, up: Channel) -> None:
    """A child node's loop: apply what the parent sends, report each committed version."""
    with contextlib.suppress(TransportClosed):
        while True:
            v = await flow.on_parent_message(await up.recv())
            if v is not None:
                await up.send(Have(v=v))


async def _listen(flow: VersionFlow, down: Channel) -> None:
    """A parent's loop for one child: take its version reports."""
    with contextlib.suppress(TransportClosed):
        while True:
            m = (await down.recv()).msg
            assert isinstance(m, Have)
            flow.on_child_version(down.peer, m.v)


class Tree:
    def __init__(self, tg: asyncio.TaskGroup) -> None:
        self.tg = tg
        self.links: list[Channel] = []

    async def attach(self, parent: VersionFlow, child: VersionFlow) -> None:
        down, up = memory_channel_pair(parent.name, child.name, window=8)
        self.links += [down, up]
        child.start_in(self.tg)  # its chunks decoded as they come, in tasks of this group
        self.tg.create_task(_follow(child, up))
        self.tg.create_task(_listen(parent, down))
        parent.add_child(down, child.version)
        self.tg.create_task(parent.serve_child(down))

    async def close(self) -> None:
        for ch in self.links:
            await ch.close("test over")


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for a condition over several nodes' state (no one event covers it)."""
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_versions_reach_every_node_bit_exact_and_late_joiners_catch_up() -> None:
    w0 = _model()
    trainer = VersionFlow("trainer", w0.copy(), 0)
    relay = VersionFlow("relay", None, None)
    leaves = [VersionFlow(f"rollout-{i}", None, None) for i in range(3)]
    async with asyncio.TaskGroup() as tg:
        tree = Tree(tg)
        await tree.attach(trainer, relay)
        await tree.attach(relay, leaves[0])
        await tree.attach(relay, leaves[1])
        await tree.attach(trainer, leaves[2])
        everyone = [relay, *leaves]
        await _until(lambda: all(n.version == 0 for n in everyone))  # a snapshot of version 0
        current = w0
        for step in range(1, 4):
            current = perturb(current, 0.02, seed=step)
            assert await trainer.publish(current.copy()) == step
            await _until(lambda step=step: all(n.version == step for n in everyone))
            for n in everyone:
                assert n.weights is not None
                assert n.weights.digest() == current.digest(), n.name
        late = VersionFlow("late", None, None)  # joins at version 3: snapshot
        behind = VersionFlow("behind", w0.copy(), 0)  # holds version 0: gets deltas 1..3 in order
        with capture_logs() as logs:
            await tree.attach(relay, late)
            await tree.attach(relay, behind)
            await _until(lambda: late.version == 3 and behind.version == 3)
        sent = {(e["event"], e["child"]) for e in logs if e["event"] in (SNAPSHOT_SENT, CATCH_UP_SENT)}
        assert sent == {(SNAPSHOT_SENT, "late"), (CATCH_UP_SENT, "behind")}
        for n in (late, behind):
            assert n.weights is not None
            assert n.weights.digest() == current.digest(), n.name
        await tree.close()


async def test_children_of_a_lost_relay_reattach_to_the_trainer_and_converge() -> None:
    w0 = _model(1)
    trainer = VersionFlow("trainer", w0.copy(), 0)
    relay = VersionFlow("relay", None, None)
    leaves = [VersionFlow(f"rollout-{i}", None, None) for i in range(2)]
    async with asyncio.TaskGroup() as tg:
        tree = Tree(tg)
        await tree.attach(trainer, relay)
        for leaf in leaves:
            await tree.attach(relay, leaf)
        await _until(lambda: all(n.version == 0 for n in (relay, *leaves)))
        current = perturb(w0, 0.02, seed=11)
        await trainer.publish(current.copy())
        await _until(lambda: all(n.version == 1 for n in leaves))
        # the relay dies: its links close; the trainer forgets it; its children re-attach
        for ch in tree.links[: 2 + 2 * len(leaves)]:
            await ch.close("peer lost: relay died")
        trainer.remove_child("relay")
        for _ in range(2):  # versions published while the children have no parent
            current = perturb(current, 0.02, seed=len(trainer.history) + 20)
            await trainer.publish(current.copy())
        for leaf in leaves:
            await tree.attach(trainer, leaf)
        await _until(lambda: all(n.version == 3 for n in leaves))
        for leaf in leaves:
            assert leaf.weights is not None
            assert leaf.weights.digest() == current.digest()
        await tree.close()


async def test_anchors_are_written_after_the_version_leaves_and_every_stored_version_reads_back(
    tmp_path: Path,
) -> None:
    """An anchor-due version is stored as its delta first (durable before the seal leaves), then
    made an anchor off the version's path, on the trainer and on a child whose weights change in place."""
    from aurora.store import DeltaStore

    w0 = _model(2)
    ts, rs = DeltaStore(tmp_path / "t", anchor_every=2), DeltaStore(tmp_path / "r", anchor_every=2)
    ts.put_anchor(0, w0)
    trainer = VersionFlow("trainer", w0.copy(), 0, store=ts)
    child = VersionFlow("rollout", None, None, store=rs)
    versions = {0: w0}
    async with asyncio.TaskGroup() as tg:  # owns the anchor writes: awaited when it closes
        trainer.start_in(tg)
        child.start_in(tg)
        tree = Tree(tg)
        await tree.attach(trainer, child)
        await _until(lambda: child.version == 0)
        for step in range(1, 6):
            versions[step] = perturb(versions[step - 1], 0.02, seed=step)
            await trainer.publish(versions[step].copy())
            await _until(lambda step=step: child.version == step)
        await tree.close()
    for store in (ts, rs):
        kinds = {v: store.info(v).kind for v in store.versions()}
        assert kinds[2] == kinds[4] == "anchor", kinds
        assert kinds[3] == kinds[5] == "delta", kinds
        for v in store.versions():
            assert store.get(v).digest() == versions[v].digest(), v


@pytest.mark.parametrize(("mode", "link_mbit"), [("sparse", 100.0), ("auto", 1e6), ("auto", 1e-3)])
async def test_versions_coded_sparse_or_by_link_reach_every_node_bit_exact(mode: str, link_mbit: float) -> None:
    from aurora.actors.status import ClusterStatus

    from aurora.runtime.clock import LoopClock

    # as the trainer node wires it: the measured rate read on the node's clock (the event loop's)
    status, clock = ClusterStatus(["relay", "rollout-0"]), LoopClock()
    policy = CodingPolicy(mode, link_mbit, measured=lambda: status.slowest_link(clock.now()))
    trainer = VersionFlow("trainer", _model(2).copy(), 0, coding=policy)
    relay, leaf = VersionFlow("relay", None, None), VersionFlow("rollout-0", None, None)
    async with asyncio.TaskGroup() as tg:
        tree = Tree(tg)
        await tree.attach(trainer, relay)
        await tree.attach(relay, leaf)
        current = _model(2)
        with capture_logs() as logs:
            for step in range(1, 4):
                current = perturb(current, 0.01, seed=20 + step)
                await trainer.publish(current.copy())
                await _until(lambda step=step: relay.version == leaf.version == step)
                assert leaf.weights is not None
                assert leaf.weights.digest() == current.digest()
        sparse = [e["sparse_chunks"] for e in logs if e["event"] == VERSION_PUBLISHED]
        if link_mbit > 1:  # sparse always, or a link so fast that every tensor is cheaper sparse
            assert all(s > 0 for s in sparse)
        else:  # a link so slow that the conditioned bytes always win
            assert sparse == [0, 0, 0]
        if mode == "auto":
            assert any(e["event"] == CODING_CHOSEN for e in logs)
        await tree.close()


async def test_an_anchor_write_is_owned_by_the_flows_task_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store error writing an anchor is logged (the version stays a delta); any other error is the
    owner's crash, raised by its task group; a flow with a store that was never started refuses to store."""
    from aurora.errors import ProtocolError, StoreError
    from aurora.store import DeltaStore

    w0 = _model(3)
    store = DeltaStore(tmp_path / "t", anchor_every=1)
    store.put_anchor(0, w0)
    unstarted = VersionFlow("trainer", w0.copy(), 0, store=store)
    with pytest.raises(ProtocolError, match="start_in"):
        await unstarted.publish(perturb(w0, 0.02, seed=1))

    def failing(error: Exception) -> Callable[..., None]:
        def write_anchor(*_: object, **__: object) -> None:
            raise error

        return write_anchor

    trainer = VersionFlow("trainer", w0.copy(), 0, store=store)

    async def publish_in_a_group(seed: int) -> None:
        async with asyncio.TaskGroup() as tg:
            trainer.start_in(tg)
            await trainer.publish(perturb(w0, 0.02, seed=seed))

    monkeypatch.setattr(store, "write_anchor", failing(StoreError("disk full")))
    with capture_logs() as logs:
        await publish_in_a_group(1)
    assert [e["version"] for e in logs if e["event"] == ANCHOR_NOT_WRITTEN] == [1]
    assert store.info(1).kind == "delta"

    monkeypatch.setattr(store, "write_anchor", failing(RuntimeError("a bug")))
    with pytest.raises(ExceptionGroup) as caught:
        await publish_in_a_group(2)
    assert [type(e) for e in caught.value.exceptions] == [RuntimeError]


async def test_a_bulk_transfer_times_the_parent_link_and_a_streamed_delta_does_not() -> None:
    """A node's first weights (a snapshot of >= 1 MB) time its parent link; the streamed deltas after
    it (paced by the trainer's encoder) leave the figure alone; nodes report it."""
    rng = np.random.default_rng(5)
    w0 = Weights.from_tensors({"big": rng.standard_normal(400_000).astype(np.float32)})  # 1.6 MB
    trainer = VersionFlow("trainer", w0.copy(), 0)
    leaf = VersionFlow("rollout-0", None, None)
    async with asyncio.TaskGroup() as tg:
        tree = Tree(tg)
        await tree.attach(trainer, leaf)
        await _until(lambda: leaf.version == 0)
        assert leaf.link_mbit is not None
        assert leaf.link_mbit > 0
        leaf.receiving.link_mbit = 1.0  # a mark: a streamed delta must not overwrite it
        await trainer.publish(perturb(w0, 0.01, seed=6))
        await _until(lambda: leaf.version == 1)
        assert leaf.link_mbit == 1.0
        leaf.parent_lost()  # a half-received delta dropped: the same parent, the same link
        assert leaf.link_mbit == 1.0
        leaf.parent_lost(left=True)  # a parent left: its link's rate goes with it
        assert leaf.link_mbit is None
        await tree.close()


async def test_the_history_keeps_two_snapshots_but_none_still_going_out() -> None:
    """Full weights: a third snapshot drops the oldest from the history, unless a child's outbox still
    has to send it (it would be cut off for falling behind)."""
    from aurora.actors.fanout import Outbox
    from aurora.actors.held import Stored

    from aurora.protocol.routing import SendChunk

    flow = VersionFlow("relay", _model(), 0)
    down, _up = memory_channel_pair("relay", "rollout-0")
    flow.children["rollout-0"] = Outbox(down)
    flow.children["rollout-0"].queue.append(SendChunk("rollout-0", 1, 0))
    for v in range(1, 5):
        flow.held.remember(v, Stored(b"m", [b"c"], snapshot=True), flow.fanout.queued_versions)
    assert list(flow.history) == [1, 3, 4]  # 2 dropped; 1 kept while its chunk waits to go out
    flow.children["rollout-0"].queue.clear()
    flow.held.remember(5, Stored(b"m", [b"c"], snapshot=True), flow.fanout.queued_versions)
    assert list(flow.history) == [4, 5]


def test_the_coding_choice_takes_the_operators_link_then_the_slowest_measured_then_the_declared() -> None:
    from aurora.actors.status import ClusterStatus

    from aurora.codec.encoder import Coding
    from aurora.protocol.messages import NodeReport

    status = ClusterStatus(["relay", "rollout-0", "rollout-1"])
    policy = CodingPolicy("auto", 100.0, measured=lambda: status.slowest_link(1.0))
    assert policy.link() == (100.0, "declared (planned tree)")
    status.on_report("rollout-0", NodeReport(version=1), 0.0)  # not timed anything yet
    assert policy.link()[1] == "declared (planned tree)"
    status.on_report("rollout-0", NodeReport(version=1, link_mbit=2000.0), 0.0)
    status.on_report("relay", NodeReport(version=1, link_mbit=0.001), 0.0)
    status.on_report("stranger", NodeReport(version=1, link_mbit=1e-6), 0.0)  # not in the topology: not heard
    assert policy.link() == (0.001, "measured by relay")
    assert policy.codings(["w"]) == {"w": Coding.CONDITIONED}  # a crawl of a link: bytes win
    status.on_report("relay", NodeReport(version=2, link_mbit=1e6), 0.0)
    assert policy.link() == (2000.0, "measured by rollout-0")
    fixed = CodingPolicy("auto", 100.0, override_mbit=0.5, measured=lambda: status.slowest_link(1.0))
    assert fixed.link() == (0.5, "sync.link_mbit")


async def test_a_catch_up_from_a_corrupt_stored_version_falls_back_to_the_next_way(tmp_path: Path) -> None:
    """The relay's stored copy of the version a child holds is corrupt: the composed catch-up fails
    once (logged), the child gets a snapshot instead and converges, and a child that comes back with the
    same version is not composed from the bad copy again (it attached and failed over and over before)."""
    from aurora.events import CATCH_UP_STORE_FAILED
    from aurora.store import DeltaStore

    w0 = _model(4)
    rs = DeltaStore(tmp_path / "r", anchor_every=100)
    trainer = VersionFlow("trainer", w0.copy(), 0, keep_versions=2)
    relay = VersionFlow("relay", None, None, store=rs, keep_versions=2)
    current = w0
    async with asyncio.TaskGroup() as tg:
        relay.start_in(tg)
        tree = Tree(tg)
        await tree.attach(trainer, relay)
        await _until(lambda: relay.version == 0)
        for step in range(1, 5):  # beyond the relay's history of 2: v0 is only in its store
            current = perturb(current, 0.02, seed=step)
            await trainer.publish(current.copy())
            await _until(lambda step=step: relay.version == step)
        anchor = tmp_path / "r" / "anchors" / "v00000000.safetensors"
        data = bytearray(anchor.read_bytes())
        data[-8:] = bytes(8) if data[-8:] != bytes(8) else b"\xff" * 8
        anchor.write_bytes(bytes(data))
        with capture_logs() as logs:
            for name in ("behind-1", "behind-2"):
                child = VersionFlow(name, w0.copy(), 0)
                await tree.attach(relay, child)
                await _until(lambda child=child: child.version == 4)
                assert child.weights is not None
                assert child.weights.digest() == current.digest()
        await tree.close()
    failed = [e for e in logs if e["event"] == CATCH_UP_STORE_FAILED]
    assert [(e["child"], e["base"]) for e in failed] == [("behind-1", 0)]
    assert {e["child"] for e in logs if e["event"] == SNAPSHOT_SENT} == {"behind-1", "behind-2"}


async def test_a_commit_cancelled_midway_still_moves_the_router_so_the_next_delta_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The uplink's version reader may be cancelled while a commit's thread runs (the parent is left):
    the thread finishes the commit, and the flow's router learns the version too — otherwise the next
    delta from the parent (base: that version) would not fit the router and crash the uplink over and over."""
    import threading
    import time

    import aurora.actors.intake as intake_module

    from aurora.testing.memory import memory_channel_pair

    real = intake_module._decode_and_apply
    started = threading.Event()

    def slow(*args: Any) -> frozenset[str]:
        started.set()
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(intake_module, "_decode_and_apply", slow)
    w0 = _model(6)
    trainer, child = VersionFlow("trainer", w0.copy(), 0), VersionFlow("child", w0.copy(), 0)
    down, up = memory_channel_pair("trainer", "child", window=8)
    trainer.add_child(down, 0)

    async def feed() -> int:
        while True:
            v = await child.on_parent_message(await up.recv())
            if v is not None:
                return v

    async with asyncio.TaskGroup() as tg:
        tg.create_task(trainer.serve_child(down))
        w1 = perturb(w0, 0.02, 1)
        await trainer.publish(w1.copy())
        task = asyncio.ensure_future(feed())
        while not started.is_set():  # noqa: ASYNC110 (a thread's event)
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert child.version == 1
        assert child.router.latest == 1
        trainer.on_child_version("child", 1)
        w2 = perturb(w1, 0.02, 2)
        await trainer.publish(w2.copy())
        assert await asyncio.wait_for(feed(), 10) == 2
        assert child.digest == w2.digest()
        await down.close("test over")
        await up.close("test over")
