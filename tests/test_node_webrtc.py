"""A rollout behind NAT: its parent link is a WebRTC data channel, signalled through the parent.

Real ZeroMQ for the signalling channel, real aiortc peer connections (host candidates on
loopback, `loopback_ice`), the node code `aurora node` runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aurora.actors.node import Node
from structlog.testing import capture_logs

from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.events import CHILD_ATTACHED, WEBRTC_ACCEPTED, WEBRTC_PARENT_CONNECTED
from aurora.node import run_node
from aurora.testing.webrtc import loopback_ice
from tests.helpers import free_ports


def _topology(tmp: Path, rollout_transport: str) -> Path:
    (port,) = free_ports(1)
    path = tmp / "t.yaml"
    path.write_text(f"""
name: nat
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{port}"}}
  - {{name: rollout, role: rollout, region: local, parent: trainer, transport: {rollout_transport}}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.5}}
learner: {{kind: synthetic, params: 20000, tensors: 2, density: 0.05, interval_s: 0.2}}
run: {{steps: 3}}
""")
    return path


async def test_a_webrtc_child_gets_every_version_over_a_data_channel(tmp_path: Path) -> None:
    path = _topology(tmp_path, "{kind: webrtc, ice_servers: []}")
    topo = load_topology(path)
    tree = plan(topo, str(path))
    nodes: dict[str, Node] = {}
    stop = asyncio.Event()
    with loopback_ice(), capture_logs() as logs:
        tasks = [
            asyncio.create_task(
                run_node(topo, tree, n, stop, file=str(path), observe=lambda x, n=n: nodes.__setitem__(n, x))
            )
            for n in ("trainer", "rollout")
        ]
        try:
            async with asyncio.timeout(60):
                while not (nodes.get("rollout") and nodes["rollout"].flow.version == 3):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert nodes["rollout"].flow.digest == nodes["trainer"].flow.digest
    events = [e["event"] for e in logs]
    assert WEBRTC_PARENT_CONNECTED in events
    assert WEBRTC_ACCEPTED in events
    assert any(e["event"] == CHILD_ATTACHED and e["child"] == "rollout" for e in logs)
