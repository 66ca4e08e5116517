"""Control before bulk, in whole nodes (in-process, in-memory links): while a rollout's version stream
waits on a long commit, its lease renewals still come back — the uplink reads the control lane in a
reader of its own, which never waits on a commit (docs/transport.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aurora.actors.intake as intake_module
import pytest

from aurora.events import LEASE_EXPIRED, LEASE_GIVEN_UP, VERSION_COMMITTED
from tests.helpers import run_in_process

COMMIT_S = 4.0
"""How long the rollout's commit of one version takes (several lease TTLs)."""
TOPOLOGY = """
name: lanes
regions: [{name: local}]
nodes:
  - {name: trainer, role: trainer, region: local, listen: "mem://trainer"}
  - {name: r1, role: rollout, region: local, parent: trainer}
heartbeat: {interval_s: 0.2, suspect_after_s: 2.0, lost_after_s: 10.0}
leases: {ttl_s: 1.5, prompts_per_lease: 2, batch_s: 1.0}
learner: {kind: synthetic, params: 8000, tensors: 2, density: 0.05, interval_s: 1.0}
engine: {kind: synthetic, max_new_tokens: 8, token_s: 0.5}
run: {steps: 3}
"""


async def test_renewals_pass_while_the_version_stream_waits_on_a_long_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = intake_module._decode_and_apply
    slowed: list[float] = []

    def slow_commit(*args: Any) -> frozenset[str]:
        if not slowed:  # the first delta commit: long, as a big model's is
            slowed.append(time.monotonic())
            time.sleep(COMMIT_S)
        return real(*args)

    monkeypatch.setattr(intake_module, "_decode_and_apply", slow_commit)
    _, logs = await run_in_process(
        tmp_path, TOPOLOGY, ("trainer", "r1"), lambda nodes: nodes["r1"].flow.version == 3, timeout_s=60
    )
    assert slowed, "no delta was committed"
    committed = [e["version"] for e in logs if e["event"] == VERSION_COMMITTED and e.get("node") == "r1"]
    assert committed == [0, 1, 2, 3]
    assert not [e for e in logs if e["event"] == LEASE_EXPIRED], "the trainer saw a lease run out"
    v2 = next(i for i, e in enumerate(logs) if e["event"] == VERSION_COMMITTED and e.get("version") == 2)
    lost = [e for e in logs[:v2] if e["event"] == LEASE_GIVEN_UP]
    assert not lost, f"the worker gave up leases while the commit ran: {lost}"
