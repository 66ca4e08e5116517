"""Keys from the topology: nodes with their keys attach over CurveZMQ and commit signed versions; a
key the topology does not list never gets in; a node's key decides who it is (a rollout's key cannot
pose as a relay, nor attach where the topology does not put it); key files name their field."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from pathlib import Path

import pytest
from aurora.actors.node import Node
from aurora.transport.zmq import LinkConfig, ZmqChannel, ZmqClient
from structlog.testing import capture_logs

from aurora.auth.keys import generate_curve_pair, generate_topology_keys, load_node_keys
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.errors import ConfigError, TransportClosed
from aurora.events import BAD_FRAME, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.node import run_node
from aurora.protocol.messages import Hello, PathUpdate, Refused
from tests.helpers import free_ports

CFG = LinkConfig(heartbeat_s=0.1, suspect_after_s=0.3, lost_after_s=0.6)


def _topology(tmp: Path) -> Path:
    p1, p2 = free_ports(2)
    path = tmp / "t.yaml"
    path.write_text(f"""
name: curve
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p1}"}}
  - {{name: relay-a, role: relay, region: local, listen: "tcp://127.0.0.1:{p2}", parent: trainer}}
  - {{name: rollout, role: rollout, region: local, parent: relay-a, fallback_parents: []}}
keys: {{dir: keys}}
heartbeat: {{interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}}
learner: {{kind: synthetic, params: 10000, tensors: 2, density: 0.05, interval_s: 0.1}}
run: {{steps: 3}}
""")
    list(generate_topology_keys(load_topology(path), str(path)))
    return path


async def _run(
    path: Path, names: tuple[str, ...], until: str, deadline_s: float, threads: int | None = None
) -> dict[str, Node]:
    topo = load_topology(path)
    tree = plan(topo, str(path))
    nodes: dict[str, Node] = {}
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            run_node(
                topo,
                tree,
                n,
                stop,
                file=str(path),
                observe=lambda node, n=n: nodes.__setitem__(n, node),
                threads=threads,
            )
        )
        for n in names
    ]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline_s):
                while not (nodes.get(until) and nodes[until].flow.version == 3):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return nodes


async def _hello(ch: ZmqChannel, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await ch.send(Hello(v=None))
        await ch.recv()


def test_generated_secret_keys_are_0600_and_never_overwritten(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    d = tmp_path / "keys"
    for f in d.iterdir():
        mode = stat.S_IMODE(f.stat().st_mode)
        assert mode == (0o600 if f.name.endswith(("key_secret", ".sign")) else 0o644), f
    again = list(generate_topology_keys(load_topology(path), str(path)))
    assert again
    assert not any(made for _, made in again)  # every key kept
    with pytest.raises(FileExistsError):
        generate_curve_pair(d, "trainer")


@pytest.mark.parametrize("secret", ["rollout.key_secret", "trainer.sign"])
def test_a_secret_key_file_others_can_read_is_refused_at_load_with_the_fix(tmp_path: Path, secret: str) -> None:
    path = _topology(tmp_path)
    f = tmp_path / "keys" / secret
    f.chmod(0o644)
    name = "trainer" if secret.endswith(".sign") else "rollout"
    with pytest.raises(ConfigError, match=r"mode 0644.*chmod 600"):
        load_node_keys(load_topology(path), name, str(path))
    f.chmod(0o600)
    assert load_node_keys(load_topology(path), name, str(path)).curve is not None


def test_keys_generate_does_not_call_a_kept_exposed_secret_private(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aurora.cli import main

    path = _topology(tmp_path)
    (tmp_path / "keys" / "relay-a.key_secret").chmod(0o640)
    assert main(["keys", "generate", "--topology", str(path)]) == 2
    captured = capsys.readouterr()
    assert "mode 0600" not in captured.out
    assert "relay-a.key_secret is a secret key readable or writable by others (mode 0640)" in captured.err


async def test_nodes_with_the_topology_keys_attach_over_curve_and_commit_signed_versions(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    with capture_logs() as logs:
        nodes = await _run(path, ("trainer", "relay-a", "rollout"), "rollout", 30, threads=2)
    assert {n.flow.threads for n in nodes.values()} == {2}  # encoded and decoded two chunks at a time
    assert nodes["rollout"].flow.version == 3
    assert nodes["rollout"].flow.digest == nodes["trainer"].flow.digest
    commits = [e for e in logs if e["event"] == VERSION_COMMITTED]
    assert commits
    assert {e["verified"] for e in commits} <= {"bytes", "state"}  # every commit checked against a seal
    assert any(e["event"] == VERSION_PUBLISHED and e["signed"] for e in logs)


async def test_a_node_with_another_key_pair_is_refused(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    _, intruder, _ = generate_curve_pair(tmp_path / "keys", "intruder")
    # the rollout's secret file now holds a pair the topology does not list: caught before connecting
    (tmp_path / "keys" / "rollout.key_secret").write_bytes(intruder.read_bytes())
    with pytest.raises(ConfigError, match="does not match node 'rollout'") as e:
        load_node_keys(load_topology(path), "rollout", str(path))
    assert e.value.path == "nodes[2].public_key"


async def test_a_key_outside_the_topology_never_gets_in(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    topo = load_topology(path)
    keys = load_node_keys(topo, "rollout", str(path))
    assert keys.curve is not None
    other = load_node_keys(topo, "trainer", str(path)).curve
    assert other is not None
    _, sec, _ = generate_curve_pair(tmp_path, "stranger")
    import zmq.auth

    pub, secret = zmq.auth.load_certificate(str(sec))
    assert secret is not None
    from aurora.auth.keys import CurveKeys

    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        trainer = tg.create_task(run_node(topo, plan(topo, str(path)), "trainer", stop, file=str(path)))
        await asyncio.sleep(1.0)
        intruder = ZmqClient(
            "relay-a",
            topo.trainer.listen or "",
            "trainer",
            cfg=CFG,
            curve=CurveKeys(pub, secret),
            server_key=keys.public["trainer"],
        )
        ch = await intruder.start_in(tg)
        with pytest.raises(TransportClosed, match="lost"):  # ZAP refuses it: the trainer is never heard
            await _hello(ch, 5)
        await intruder.close()
        stop.set()
    assert trainer.done()


async def test_a_rollouts_key_cannot_pose_as_a_relay_nor_attach_where_the_topology_does_not_put_it(
    tmp_path: Path,
) -> None:
    path = _topology(tmp_path)
    topo = load_topology(path)
    rollout = load_node_keys(topo, "rollout", str(path))
    assert rollout.curve is not None
    stop = asyncio.Event()
    seen: dict[str, Node] = {}
    with capture_logs() as logs:
        async with asyncio.TaskGroup() as tg:
            runs = [
                tg.create_task(
                    run_node(
                        topo,
                        plan(topo, str(path)),
                        n,
                        stop,
                        file=str(path),
                        observe=lambda node, n=n: seen.__setitem__(n, node),
                    )
                )
                for n in ("trainer", "relay-a")
            ]
            while not (seen.get("relay-a") and seen["relay-a"].flow.version):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            addr = topo.trainer.listen or ""
            # 1. the rollout's key, naming itself relay-a in its heartbeats: no channel at all
            poser = ZmqClient(
                "relay-a", addr, "trainer", cfg=CFG, curve=rollout.curve, server_key=rollout.public["trainer"]
            )
            ch = await poser.start_in(tg)
            with pytest.raises((TransportClosed, TimeoutError)):
                await _hello(ch, 3)
            await poser.close()
            # 2. as itself: the trainer is not a parent the topology gives it (fallback_parents: [])
            honest = ZmqClient(
                "rollout", addr, "trainer", cfg=CFG, curve=rollout.curve, server_key=rollout.public["trainer"]
            )
            ch = await honest.start_in(tg)
            await ch.send(Hello(v=None))
            answer = (await asyncio.wait_for(ch.recv(), 5)).msg
            assert isinstance(answer, Refused)
            assert "does not let 'rollout' attach" in answer.reason
            await honest.close()
            # the real relay stayed attached throughout
            assert seen["relay-a"].place.path == ("trainer",)
            assert "relay-a" in seen["trainer"].flow.children
            stop.set()
        assert all(r.done() for r in runs)
    assert any(e["event"] == BAD_FRAME and "sent heartbeats as 'relay-a'" in e["reason"] for e in logs)
    assert not isinstance(answer, PathUpdate)
