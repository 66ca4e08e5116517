"""Blame by cause (in-process nodes over in-memory links): only a peer's fault makes a node leave or
quarantine a parent, or close a child; a local failure crashes the actor that met it, and its
supervisor counts and restarts it (let it crash)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aurora.errors import ProtocolError, StoreError, peer_fault
from aurora.events import CHILD_RESTARTING, PARENT_ATTACHED, PARENT_FAILED
from tests.helpers import run_in_process

if TYPE_CHECKING:
    from aurora.actors.node import Node

STEPS = 6
TOPOLOGY = f"""
name: blame
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "mem://trainer"}}
  - {{name: relay, role: relay, region: local, listen: "mem://relay", parent: trainer}}
  - {{name: r1, role: rollout, region: local, parent: relay, fallback_parents: [trainer]}}
heartbeat: {{interval_s: 0.1, suspect_after_s: 0.3, lost_after_s: 0.6}}
leases: {{ttl_s: 0.8, prompts_per_lease: 2, batch_s: 0.3}}
learner: {{kind: synthetic, params: 8000, tensors: 2, density: 0.05, interval_s: 0.3}}
engine: {{kind: synthetic, max_new_tokens: 4, token_s: 0.01}}
run: {{steps: {STEPS}}}
"""
NAMES = ("trainer", "relay", "r1")


def test_peer_fault_names_the_peers_errors_only() -> None:
    from aurora.errors import AuthError, DeltaFormatError, TransportClosed

    assert peer_fault(DeltaFormatError("x"))
    assert peer_fault(AuthError("x"))
    assert peer_fault(TransportClosed("x"))
    assert peer_fault(ProtocolError("x", remote=True))
    assert not peer_fault(ProtocolError("x", remote=False))
    assert not peer_fault(StoreError("disk full"))
    assert not peer_fault(KeyError("a bug"))


async def _cluster(tmp: Path, inject: Any) -> tuple[dict[str, Node], list[dict[str, Any]]]:
    """Run the three nodes until r1 holds the last version (or 30 s pass)."""
    return await run_in_process(
        tmp, TOPOLOGY, NAMES, lambda nodes: nodes["r1"].flow.version == STEPS, timeout_s=30, inject=inject
    )


async def test_a_local_failure_on_the_uplink_crashes_it_and_never_blames_the_parent(tmp_path: Path) -> None:
    """A full disk while committing what the parent sent is the node's own failure: the uplink actor
    crashes and is restarted, the healthy parent is not quarantined, and the node goes on under it."""

    def inject(nodes: dict[str, Node]) -> None:
        flow = nodes["r1"].flow
        real = flow.on_parent_message
        failed: list[bool] = []

        async def disk_full_once(msg: Any) -> int | None:
            if flow.version is not None and flow.version >= 2 and not failed:
                failed.append(True)
                raise StoreError("No space left on device")
            return await real(msg)

        flow.on_parent_message = disk_full_once  # type: ignore[method-assign]

    nodes, logs = await _cluster(tmp_path, inject)
    assert not [e for e in logs if e["event"] == PARENT_FAILED], "a healthy parent was blamed"
    restarted = [e for e in logs if e["event"] == CHILD_RESTARTING and e["supervisor"] == "r1"]
    assert [e["child"] for e in restarted] == ["uplink"]
    attached = [e["path"] for e in logs if e["event"] == PARENT_ATTACHED]
    assert attached.count(["trainer", "relay"]) == 2, "r1 attached again under its planned parent"
    assert attached.count(["trainer"]) == 1, "and never fell back to the trainer (only the relay is under it)"
    assert nodes["r1"].flow.version == STEPS


async def test_a_bug_while_serving_a_child_crashes_the_children_actor_and_is_counted(tmp_path: Path) -> None:
    """A local bug while serving a child is not forgotten: the children actor crashes, its supervisor
    counts and restarts it, and the child attaches again."""

    def inject(nodes: dict[str, Node]) -> None:
        flow = nodes["relay"].flow
        real = flow.on_child_version
        failed: list[bool] = []

        def bug_once(peer: str, version: int) -> None:
            if version >= 2 and not failed:
                failed.append(True)
                raise RuntimeError("a bug in the relay")
            real(peer, version)

        flow.on_child_version = bug_once  # type: ignore[method-assign]

    nodes, logs = await _cluster(tmp_path, inject)
    restarted = [e for e in logs if e["event"] == CHILD_RESTARTING and e["supervisor"] == "relay"]
    assert [e["child"] for e in restarted] == ["children"]
    assert not [e for e in logs if e["event"] == PARENT_FAILED]
    assert nodes["r1"].flow.version == STEPS
