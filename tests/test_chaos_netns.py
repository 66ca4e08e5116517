"""`aurora chaos`'s network in namespaces (root only): every node on an address of its own, the topology
rewritten for it, and a cut that black-holes exactly one parent link until it is healed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aurora.chaos.netns import NetnsNetwork
from aurora.config.plan import plan
from aurora.config.topology import load_topology
from aurora.testing.wan import unavailable_reason

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]
ROOT = Path(__file__).resolve().parent.parent
SERVE = "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 47555)); s.listen(); print('up', flush=True)\n" + (
    "while True: s.accept()[0].close()"
)
DIAL = "import socket,sys; socket.create_connection((sys.argv[1], 47555), timeout=1.0).close()"


def test_each_node_has_its_address_and_a_cut_drops_exactly_its_parent_link(tmp_path: Path) -> None:
    path = ROOT / "topologies" / "tiny.yaml"
    topo = load_topology(path)
    tree = plan(topo, str(path))
    net = NetnsNetwork(topo, tree)
    try:
        derived = load_topology(net.topology(path, tmp_path / "topology.yaml"))
        listen = {n.name: n.listen for n in derived.nodes}
        assert listen["trainer"] == f"tcp://{net.addr['trainer']}:47000"
        assert listen["relay-b"] == f"tcp://{net.addr['relay-b']}:47002"
        assert derived.model is not None
        assert derived.model.path is not None
        assert Path(derived.model.path).is_absolute()

        def dials(child: str, parent: str) -> bool:
            r = net.hosts[child].run([sys.executable, "-c", DIAL, net.addr[parent]], timeout_s=10)
            return r.returncode == 0

        servers = [
            net.hosts[p].popen([sys.executable, "-c", SERVE, net.addr[p]], stdout=subprocess.PIPE)
            for p in ("relay-a", "relay-b")
        ]
        for s in servers:
            assert s.stdout is not None
            assert s.stdout.readline().strip() == b"up"
        assert dials("rollout-3", "relay-b")
        net.cut("rollout-3", "relay-b", up=False)
        assert not dials("rollout-3", "relay-b")  # silently dropped: the connect times out
        assert dials("rollout-3", "relay-a")  # its fallback parent is still reachable
        assert dials("rollout-1", "relay-a")
        net.cut("rollout-3", "relay-b", up=True)
        assert dials("rollout-3", "relay-b")
    finally:
        net.close()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(h.ns in out for h in net.hosts.values())
