"""CurveZMQ keys from the topology: nodes with their keys attach; a node whose key is not the one
the topology lists never gets in; a key file that does not match names the node's field."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import zmq.auth
from aurora.actors.node import Node, run_node

from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.errors import ConfigError
from tests.helpers import free_ports


def _topology(tmp: Path, keys: dict[str, str]) -> Path:
    (port,) = free_ports(1)
    path = tmp / "t.yaml"
    path.write_text(f"""
name: curve
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{port}",
      public_key: "{keys["trainer"]}", secret_key_file: keys/trainer.key_secret}}
  - {{name: rollout, role: rollout, region: local, parent: trainer,
      public_key: "{keys["rollout"]}", secret_key_file: keys/rollout.key_secret}}
heartbeat: {{interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}}
learner: {{kind: synthetic, params: 10000, tensors: 2, density: 0.05, interval_s: 0.1}}
run: {{steps: 3}}
""")
    return path


def _keys(tmp: Path, *names: str) -> dict[str, str]:
    out = {}
    (tmp / "keys").mkdir(exist_ok=True)
    for n in names:
        pub, _ = zmq.auth.create_certificates(str(tmp / "keys"), n)
        out[n] = zmq.auth.load_certificate(pub)[0].decode()
    return out


async def _run_both(path: Path, deadline_s: float) -> dict[str, Node]:
    topo = load_topology(path)
    tree = plan(topo, str(path))
    nodes: dict[str, Node] = {}
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            run_node(topo, tree, n, stop, file=str(path), observe=lambda node, n=n: nodes.__setitem__(n, node))
        )
        for n in ("trainer", "rollout")
    ]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline_s):
                while not (nodes.get("rollout") and nodes["rollout"].flow.version == 3):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return nodes


async def test_nodes_with_the_topology_keys_attach_over_curve(tmp_path: Path) -> None:
    path = _topology(tmp_path, _keys(tmp_path, "trainer", "rollout"))
    nodes = await _run_both(path, 30)
    assert nodes["rollout"].flow.version == 3
    assert nodes["rollout"].flow.digest == nodes["trainer"].flow.digest


async def test_a_node_with_another_key_pair_is_refused(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "trainer", "rollout", "intruder")
    path = _topology(tmp_path, keys)
    # the rollout's secret file now holds a pair the topology does not list: caught before connecting
    (tmp_path / "keys" / "rollout.key_secret").write_bytes((tmp_path / "keys" / "intruder.key_secret").read_bytes())
    with pytest.raises(ConfigError, match="does not match this node's public_key") as e:
        await _run_both(path, 2)
    assert e.value.path == "nodes[1].public_key"


async def test_a_client_key_outside_the_allowlist_never_gets_in(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "trainer", "rollout", "intruder")
    path = _topology(tmp_path, keys)
    text = path.read_text().replace(keys["rollout"], keys["intruder"]).replace("keys/rollout.", "keys/intruder.")
    rogue = tmp_path / "rogue.yaml"  # the intruder claims the rollout's name with its own keys
    rogue.write_text(text)
    topo, rtopo = load_topology(path), load_topology(rogue)
    stop = asyncio.Event()
    seen: dict[str, Node] = {}
    tasks = [asyncio.create_task(run_node(topo, plan(topo, str(path)), "trainer", stop, file=str(path))),
             asyncio.create_task(run_node(rtopo, plan(rtopo, str(rogue)), "rollout", stop, file=str(rogue),
                                          observe=lambda node: seen.__setitem__("rollout", node)))]  # fmt: skip
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*tasks)
    assert seen["rollout"].flow.version is None  # never attached, never got a version
