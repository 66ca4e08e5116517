"""Cluster status: what every node reports up the tree, gathered at the trainer.

Every node sends its parent a ``status`` message about once a second (its
version, parent, bytes received, and a rollout's work counters); relays forward
these upward unchanged, like ``held`` notices, which a node sends the moment it
commits a version. The trainer keeps the latest report of each node and, per
version, the time from publication to the last ``held`` notice: the sync time
(it includes the notice's trip back up, so it slightly overstates the true one).

A client reads the gathered status over the control channel: it connects to
the trainer like a child would, but its hello is ``{"k": "status?"}``, and it
gets one ``status`` answer (`snapshot`) before the trainer closes the channel.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aurora.transport.zmq import LinkConfig, ZmqTransport

from aurora.config.topology import Topology
from aurora.errors import AuroraError, TransportClosed

STATUS_EVERY_S = 1.0
KEEP_VERSIONS = 64


@dataclass
class ClusterStatus:
    nodes: list[str]
    """Every node of the topology except the trainer."""
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    published: OrderedDict[int, float] = field(default_factory=OrderedDict)
    held: dict[int, set[str]] = field(default_factory=dict)
    sync_s: OrderedDict[int, float] = field(default_factory=OrderedDict)
    step: dict[str, Any] = field(default_factory=dict)
    """The learner's last step (reward, accuracy, ...) and its delta's size."""

    def on_published(self, version: int, started: float) -> None:
        self.published[version] = started
        self.held[version] = set()
        while len(self.published) > KEEP_VERSIONS:
            v, _ = self.published.popitem(last=False)
            self.held.pop(v, None)

    def on_held(self, node: str, version: int, now: float | None = None) -> float | None:
        """Record a commit notice; returns the version's sync time once the last node holds it."""
        got = self.held.get(version)
        if got is None or version in self.sync_s:
            return None
        got.add(node)
        if not set(self.nodes) <= got:
            return None
        dt = (time.monotonic() if now is None else now) - self.published[version]
        self.sync_s[version] = dt
        while len(self.sync_s) > KEEP_VERSIONS:
            self.sync_s.popitem(last=False)
        return dt

    def on_report(self, node: str, report: dict[str, Any]) -> None:
        self.reports[node] = {**report, "age_s": 0.0, "_at": time.monotonic()}

    def snapshot(self, trainer: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        nodes = {n: {k: v for k, v in r.items() if k != "_at"} | {"age_s": round(now - r["_at"], 1)}
                 for n, r in self.reports.items()}  # fmt: skip
        return {"trainer": trainer, "nodes": nodes, "sync_s": {str(v): round(s, 4) for v, s in self.sync_s.items()},
                "step": self.step}  # fmt: skip


def render(snap: dict[str, Any]) -> str:
    """One screenful: the trainer's line, then one line per node."""
    t = snap["trainer"]
    syncs = list(snap["sync_s"].values())
    rej = sum(t.get("rejected", {}).values())
    head = (f"trainer v{t['version']}  results accepted {t['accepted']} rejected {rej} "
            f"(leased {t['in_flight']}, pooled {t['pending']})")  # fmt: skip
    if syncs:
        head += f"  sync last {syncs[-1] * 1e3:.0f} ms, mean {sum(syncs) / len(syncs) * 1e3:.0f} ms"
    lines = [head]
    step = snap.get("step") or {}
    if step.get("reward") is not None:
        tok = sum(r.get("tok_s", 0.0) for r in snap["nodes"].values())
        lines.append(f"learner step {step['version']}  reward {step['reward']:.3f}  accuracy {step['accuracy']:.3f}  "
                     f"delta {step.get('bytes', 0) / 1e3:.1f} kB ({100 * (step.get('density') or 0):.2f} % changed)  "
                     f"rollouts {tok:.0f} tok/s")  # fmt: skip
    for name, r in sorted(snap["nodes"].items()):
        parts = [f"{name:<12} v{'-' if r.get('version') is None else r['version']:<4} via {r.get('parent') or '-':<10}",
                 f"in {r.get('bytes_in', 0) / 1e6:7.2f} MB"]  # fmt: skip
        if "completions" in r:
            parts.append(f"done {r['completions']} ok {r['accepted']} rejected {r['rejected']} "
                         f"{r['tok_s']:.0f} tok/s, switches {r['switches']} ({r['switch_ms']:.1f} ms avg)")  # fmt: skip
        if r["age_s"] > 3 * STATUS_EVERY_S:
            parts.append(f"(silent {r['age_s']:.0f} s)")
        lines.append("  ".join(parts))
    return "\n".join(lines)


async def fetch_status(topo: Topology, timeout_s: float = 5.0, *, file: str | None = None,
                       as_node: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Ask the trainer of ``topo`` for the gathered status over the control channel.

    With CurveZMQ keys in the topology the client authenticates with node ``as_node``'s key
    pair (default: the trainer's own, as on the trainer's machine)."""
    from aurora.actors.node import curve_options

    t = topo.trainer
    if t.listen is None:
        raise AuroraError(f"the trainer {t.name!r} has no listen address to ask for status")
    hb = topo.heartbeat
    cfg = LinkConfig(heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s, lost_after_s=hb.lost_after_s)
    curve = curve_options(topo, as_node or t.name, file)
    if curve:
        curve = {"curve": curve["curve"], "server_keys": {t.name: curve["server_keys"][t.name]}}
    zt = ZmqTransport(f"status-{os.getpid()}-{time.monotonic_ns()}", cfg=cfg, **curve)
    try:
        async with asyncio.TaskGroup() as tg:
            zt.start_in(tg)
            try:
                async with asyncio.timeout(timeout_s):
                    ch = await zt.connect(t.name, t.listen)
                    await ch.send({"k": "status?"})
                    answer = (await ch.recv()).header
            except (TimeoutError, TransportClosed) as e:
                raise AuroraError(f"no status from the trainer {t.name!r} at {t.listen}: {e or 'timed out'}") from None
            finally:
                await zt.close()
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    if answer.get("k") != "status":
        raise AuroraError(f"the trainer {t.name!r} answered {answer.get('k')!r}, not a status")
    return dict(answer["snap"])
