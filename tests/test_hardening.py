"""What a hostile peer, file or result could do before, each refused: absurd manifests, store metadata
pointing outside the store, unknown status senders, corrupt stored versions, non-finite learner steps,
nodes that listen beyond loopback without keys, and the typed messages' own limits."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from aurora.actors.node import Node
from aurora.actors.status import LINK_REPORT_S, ClusterStatus, render
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from aurora.auth.keys import generate_topology_keys
from aurora.auth.seal import Sealer, SealVerifier, state_hash, weights_layout
from aurora.codec import Weights
from aurora.codec.digest import digest_bytes
from aurora.codec.format import FORMAT_VERSION, MANIFEST_MAGIC, delta_id_for, unpack_manifest
from aurora.config.plan import plan
from aurora.config.rl import ArithmeticSpec, GrpoSpec, ModelSpec
from aurora.config.topology import load_topology
from aurora.errors import ConfigError, DeltaFormatError, StoreError
from aurora.events import STORE_VERSION_UNUSABLE
from aurora.node import open_store, run_node
from aurora.protocol import messages as wire
from aurora.rl.learners.grpo import GrpoLearner
from aurora.rl.tasks import ArithmeticTask
from aurora.rl.types import Completion, Prompt, Sample
from aurora.store import DeltaStore
from tests.helpers import free_ports, perturb


def _weights(seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    return Weights.from_tensors(
        {"a": rng.standard_normal((64, 8)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}
    )


def _absurd_manifest(elements: int) -> bytes:
    """A well-formed manifest (its digest right) whose one tensor claims ``elements`` elements."""
    d16 = bytes(16)
    body = msgpack.packb(
        {
            "delta_id": delta_id_for(None, 1, None, d16),
            "base_version": None,
            "target_version": 1,
            "base_digest": None,
            "target_digest": d16,
            "transform": "xor",
            "chunk_span_bytes": 4 * 1024 * 1024 - 4096,
            "tensors": [["w", "bfloat16", [elements], None, d16]],
        },
        use_bin_type=True,
    )
    head = MANIFEST_MAGIC + struct.pack("<HI", FORMAT_VERSION, len(body))
    return head + body + digest_bytes(head, body)


def test_a_manifest_claiming_absurd_sizes_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    with pytest.raises(DeltaFormatError, match="elements"):
        unpack_manifest(_absurd_manifest(2**60))
    assert unpack_manifest(_absurd_manifest(2**36)).n_chunks == 32801  # within the bounds: parsed, not allocated
    # `aurora delta apply` on such a file: exit 2 at once, one line
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "base.safetensors"))
    for n in (2**60, 2**36):
        f = tmp_path / f"d{n}.audelta"
        f.write_bytes(
            b"AUDF"
            + struct.pack("<H", FORMAT_VERSION)
            + struct.pack("<I", len(_absurd_manifest(n)))
            + _absurd_manifest(n)
        )
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "aurora",
                "delta",
                "apply",
                str(tmp_path / "base.safetensors"),
                str(f),
                "-o",
                str(tmp_path / "out.safetensors"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.monotonic() - t0 < 60
        assert not (tmp_path / "out.safetensors").exists()


def _many_empty_tensors_manifest(n: int) -> bytes:
    """A valid manifest of ``n`` zero-size tensors: the most rows per manifest byte."""
    from aurora.codec.dtypes import BY_NAME
    from aurora.codec.format import Manifest, TensorEntry, Transform, delta_id_for, pack_manifest

    d16 = bytes(16)
    rows = tuple(TensorEntry(f"t{i:07d}", BY_NAME["bfloat16"], (0,), None, d16) for i in range(n))
    return pack_manifest(Manifest(delta_id_for(None, 1, None, d16), None, 1, None, d16, Transform.XOR, rows, format=3))


def test_a_manifest_costs_a_small_multiple_of_its_bytes_and_one_of_another_layout_is_refused_unparsed() -> None:
    import tracemalloc

    packed = _many_empty_tensors_manifest(100_000)  # 4 MB
    tracemalloc.start()
    try:
        assert len(unpack_manifest(packed).tensors) == 100_000
        _, parsed_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(DeltaFormatError, match="lists 100000 tensors, the weights held have 300"):
            unpack_manifest(packed, tensors=300)
        _, refused_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed_peak < 12 * len(packed), (parsed_peak, len(packed))  # was ~14x its bytes, all at once
    assert refused_peak < 2 * len(packed) + (1 << 20), (refused_peak, len(packed))


def test_store_metadata_that_points_outside_the_store_is_refused_and_prune_deletes_nothing_there(
    tmp_path: Path,
) -> None:
    store = DeltaStore(tmp_path / "s", anchor_every=1)
    w = _weights()
    for v in range(3):
        store.put_anchor(v, w)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    meta = tmp_path / "s" / "versions" / "v00000000.json"
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps({**doc, "file": "../../victim.txt"}))
    fresh = DeltaStore(tmp_path / "s")
    with pytest.raises(StoreError, match=r"v00000000\.json.*names the file"):
        fresh.get(0)
    fresh.prune(keep_last=1)
    assert victim.read_text() == "keep me"


def test_status_is_kept_only_for_the_topologys_nodes() -> None:
    st_ = ClusterStatus(["relay", "rollout"])
    for i in range(40):
        st_.on_report(f"stranger-{i}", wire.NodeReport(version=1), 1.0)
    st_.on_report("rollout", wire.NodeReport(version=3), 1.0)
    st_.on_report("rollout", wire.NodeReport(version=4), 2.0)
    assert list(st_.reports) == ["rollout"]
    assert st_.reports["rollout"][0].version == 4
    # a report carrying anything beyond its schema never decodes
    with pytest.raises(wire.BadMessage):
        wire.decode_app(msgpack.packb({"k": "status", "n": "rollout", "r": {"version": 1, "junk": "x" * 4_000_000}}))
    # nor a link rate that is not a positive finite number: the coding choice reads the lowest
    for bad in (float("nan"), float("-inf"), -1.0, 0.0, 1e300):
        with pytest.raises(wire.BadMessage):
            wire.decode_app(msgpack.packb({"k": "status", "n": "rollout", "r": {"version": 1, "link_mbit": bad}}))
    st_.on_report("relay", wire.NodeReport(version=4, link_mbit=95.5), 9.0)
    assert st_.slowest_link(10.0) == (95.5, "relay")
    assert st_.slowest_link(9.0 + LINK_REPORT_S + 0.1) is None  # a node silent that long no longer counts
    pool = {"accepted": 0, "rejected": {}, "in_flight": 0, "pending": 0, "dropped_stale": 0, "parked": 0}
    snap = st_.snapshot(4, pool, 10.0)  # a value: the time is the caller's
    assert "link 96 Mbit/s" in render(snap)
    assert (snap.nodes["rollout"].age_s, snap.nodes["relay"].age_s) == (8.0, 1.0)
    assert "(silent 8 s)" in render(snap)
    # the work pool's measured speeds go with it, and refuse what is not a positive finite rate
    fast = msgspec.structs.replace(snap, speeds={"rollout": 1.5})
    assert "speed 1.50 prompts/s" in render(fast)
    for bad in (float("nan"), 0.0, -1.0, 1e300):
        with pytest.raises(wire.BadMessage):
            wire.decode_app(wire.encode(wire.StatusSnapshot(snap=msgspec.structs.replace(snap, speeds={"r": bad}))))
    st_.on_published(5, 20.0)
    assert st_.on_held("relay", 5, 20.5) is None
    assert st_.on_held("rollout", 5, 21.25) == 1.25  # the last node: publication to its notice
    assert st_.sync_s[5] == 1.25


async def test_a_corrupt_newest_stored_version_resumes_from_the_newest_intact_one(tmp_path: Path) -> None:
    """A rollout's store: v3 sealed and intact, v4 corrupt on disk. The node resumes from v3,
    logging the file; the trainer, on a corrupt store, stops with an error naming the file."""
    (p0,) = free_ports(1)
    path = tmp_path / "t.yaml"
    path.write_text(f"""
name: resume
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p0}"}}
  - {{name: r1, role: rollout, region: local, parent: trainer}}
keys: {{dir: keys}}
learner: {{kind: synthetic, params: 2000, tensors: 2, density: 0.05, interval_s: 10}}
""")
    topo = load_topology(path)
    list(generate_topology_keys(topo, str(path)))
    from aurora.auth.keys import load_node_keys

    keys = load_node_keys(topo, "trainer", str(path))
    store = DeltaStore(tmp_path / "r1", anchor_every=1)
    w = _weights()
    sealer = Sealer(keys.signer, store.run)
    for v in (3, 4):
        w = perturb(w, 0.05, v)
        seal = sealer.seal(v=v, base=None, digest=w.digest(), layout=weights_layout(w), state=state_hash(w), delta=None)
        store.put_anchor(v, w, seal=seal)
    good = DeltaStore(tmp_path / "r1").get(3)
    anchor = tmp_path / "r1" / "anchors" / "v00000004.safetensors"
    anchor.write_bytes(anchor.read_bytes()[:-40] + b"\x00" * 40)
    node = Node("r1", topo, plan(topo, str(path)), str(path), load_node_keys(topo, "r1", str(path)))
    with capture_logs() as logs:
        await open_store(node, tmp_path / "r1")
    assert node.flow.version == 3
    assert node.flow.digest == good.digest()
    (skip,) = [e for e in logs if e["event"] == STORE_VERSION_UNUSABLE]
    assert skip["version"] == 4
    assert "v00000004.safetensors" in skip["error"]
    assert isinstance(SealVerifier(keys.verifier).open(node.flow.seal or wire.SealWire(b"", bytes(64))).v, int)
    # the trainer's store with a corrupt latest version: an error that names the file
    tstore = DeltaStore(tmp_path / "trainer", anchor_every=1)
    tstore.put_anchor(0, _weights())
    t_anchor = tmp_path / "trainer" / "anchors" / "v00000000.safetensors"
    t_anchor.write_bytes(b"\x00" * 64)
    with pytest.raises(StoreError, match=r"v00000000\.safetensors"):
        await asyncio.wait_for(
            run_node(
                topo, plan(topo, str(path)), "trainer", asyncio.Event(), file=str(path), store=tmp_path / "trainer"
            ),
            120,
        )


def _open_topology(tmp_path: Path) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text("""
name: open
regions: [{name: local}]
nodes:
  - {name: trainer, role: trainer, region: local, listen: "tcp://0.0.0.0:1"}
  - {name: r1, role: rollout, region: local, parent: trainer}
""")
    return path


async def test_a_node_that_listens_beyond_loopback_refuses_to_start_without_keys(tmp_path: Path) -> None:
    path = _open_topology(tmp_path)
    topo = load_topology(path)
    with pytest.raises(ConfigError, match="--insecure"):
        await run_node(topo, plan(topo, str(path)), "r1", asyncio.Event(), file=str(path))


def test_aurora_node_says_so_in_one_line(tmp_path: Path) -> None:
    path = _open_topology(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "node", "--topology", str(path), "--name", "trainer"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--insecure" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "topology", "check", str(path)], capture_output=True, text=True, timeout=120
    )
    assert "refuse to start without --insecure" in r.stdout


def test_keys_generate_topology_makes_every_key_once(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("""
name: k
regions: [{name: local}]
nodes:
  - {name: trainer, role: trainer, region: local, listen: "tcp://10.0.0.1:1"}
  - {name: r1, role: rollout, region: local, parent: trainer}
keys: {dir: keys}
""")
    cmd = [sys.executable, "-m", "aurora", "keys", "generate", "--topology", str(tmp_path / "t.yaml")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "keys").iterdir())
    assert names == sorted(
        [
            "trainer.key",
            "trainer.key_secret",
            "r1.key",
            "r1.key_secret",
            "operator.key",
            "operator.key_secret",
            "trainer.sign",
            "trainer.sign_pub",
        ]
    )
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "0 files written" in again.stdout


def test_a_learner_step_with_non_finite_loss_changes_nothing_and_is_counted() -> None:
    task = ArithmeticTask(ArithmeticSpec())
    learner = GrpoLearner(
        GrpoSpec(group_size=2, prompts_per_step=1, lr=1e-3), ModelSpec(preset="tiny"), task, temperature=1.0
    )
    w0 = learner.initial()
    p = Prompt(0, "1+1=", "2", tokens=tuple(learner.tokenize(Prompt(0, "1+1="))))
    ok, wrong = learner.tok.hf("2", add_special_tokens=False)["input_ids"], [9]
    poisoned = Completion(0, list(p.tokens), [Sample(list(ok), [math.nan] * len(ok)), Sample(wrong, [-1.0])], 0)
    w1 = learner.step([(p, poisoned)])
    assert learner.stats["nonfinite_skipped"] == 1
    assert w1.digest() == w0.digest()
    assert all(bool(torch.isfinite(t).all()) for t in w1.to_tensors().values())


MESSAGES = [m for m in wire.AppMessage.__args__]  # type: ignore[attr-defined]


POST_INIT_RULES = ("differ in length", "version span", "oldest of its samples")
"""What the messages' ``__post_init__`` checks say (a sample's lengths, its version spans, a result's version)."""


@given(st.sampled_from(MESSAGES), st.data())
def test_every_valid_message_round_trips(kind: type, data: st.DataObject) -> None:
    import msgspec.inspect as mi

    from aurora.testing.fuzz import pack, valid_message

    info = mi.type_info(kind)
    assert isinstance(info, mi.StructType)
    raw = pack(data.draw(valid_message(info)))
    try:
        msg = wire.decode_app(raw, [b""] * len(wire.BUFFER_LIMITS.get(kind, ())))
    except wire.BadMessage as e:  # a __post_init__ rule the schema cannot say (e.g. equal lengths)
        assert any(rule in e.reason for rule in POST_INIT_RULES), e.reason  # noqa: PT017
        return
    assert isinstance(msg, kind)
    assert wire.decode_app(wire.encode_app(msg), [b""] * len(wire.BUFFER_LIMITS.get(kind, ()))) == msg


def test_the_wire_limits_agree_with_the_codecs() -> None:
    from aurora.codec import format as fmt

    assert wire.MAX_CHUNK_BYTES == fmt.MAX_CHUNK_BYTES
    assert wire.MAX_CHUNKS == fmt.MAX_CHUNKS
    assert wire.MAX_MANIFEST_BYTES <= fmt.MAX_MANIFEST_BYTES


def test_a_workers_route_moves_only_with_its_want_while_its_child_is_attached() -> None:
    from aurora.actors.work import Routes

    r = Routes()
    assert r.learn("rollout", "relay-a")
    open_children = {"relay-a": object(), "relay-b": object()}
    # a relay the rollout merely lists as a fallback sends renewals in its name: refused
    assert not r.learn("rollout", "relay-b", moves=False, open_children=open_children)
    assert r.child_for("rollout") == "relay-a"
    # the rollout itself moved (its want comes through relay-b), or relay-a is gone: the route moves
    assert r.learn("rollout", "relay-b", moves=True, open_children=open_children)
    assert r.learn("rollout", "relay-a", moves=False, open_children={"relay-a": object()})
    assert r.child_for("rollout") == "relay-a"


def test_clients_choose_routing_ids_a_router_never_generates() -> None:
    """libzmq aborts when an id it generates is one a client chose: Aurora's clients choose ids outside
    the generated form (a zero byte and a 32-bit count), and generation starts at a random point."""
    import zmq
    from aurora.transport.zmq import ZmqClient

    ctx = zmq.Context()
    try:
        r = ctx.socket(zmq.ROUTER)
        port = r.bind_to_random_port("tcp://127.0.0.1")
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(b"x")
        generated = r.recv_multipart()[0]
        assert generated[0] == 0 and len(generated) == 5  # noqa: PT018
        assert generated != bytes.fromhex("006b8b4567")  # glibc's unseeded first rand()
        for s in (r, d):
            s.close(linger=0)
    finally:
        ctx.term()

    async def mine() -> bytes:
        client = ZmqClient("x", "tcp://127.0.0.1:1", "p")
        async with asyncio.TaskGroup() as tg:
            await client.start_in(tg)
            rid = client.sock.getsockopt(zmq.ROUTING_ID)
            await client.close()
        return bytes(rid)

    rid = asyncio.run(mine())
    assert rid[0] == 1
    assert len(rid) == 17
