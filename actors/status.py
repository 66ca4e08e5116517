"""Cluster status: what every node reports up the tree, gathered at the trainer.

Every node sends its parent a `Status` message about once a second (its
version, parent, whether that is its planned parent, bytes received, and a
rollout's work counters); relays forward these upward unchanged, like `Held`
notices, which a node sends the moment it commits a version. The trainer keeps
the latest report of each node of the topology (nothing for names it does not
know: memory is bounded by the topology) and, per version, the time from
publication to the last `Held` notice: the sync time (it includes the notice's
trip back up, so it slightly overstates the true one).

A client reads the gathered status over the control channel: it connects to
the trainer like a child would, but its hello is `StatusQuery`, and it gets one
`StatusSnapshot` before the trainer closes the channel. With keys, the client
authenticates with the ``operator`` key of the topology's key directory (or
another node's key).

`ClusterStatus` is a value: every call that needs the time takes ``now`` (the trainer's clock,
`aurora.runtime.Clock`), and it reads none itself.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aurora.transport.zmq import LinkConfig, ZmqTransport

from aurora.config.topology import Topology
from aurora.errors import AuroraError, TransportClosed
from aurora.protocol.messages import NodeReport, Snapshot, StatusQuery, StatusSnapshot, TrainerStats
from aurora.runtime.clock import Clock, LoopClock
from aurora.runtime.groups import unwrap_group

STATUS_EVERY_S = 1.0
LINK_REPORT_S = 10 * STATUS_EVERY_S
"""A node's measured link rate counts for the coding choice while its reports are this recent."""
KEEP_VERSIONS = 64


@dataclass
class ClusterStatus:
    nodes: list[str]
    """Every node of the topology except the trainer."""
    planned: dict[str, str] = field(default_factory=dict)
    """Each node's planned parent."""
    reports: dict[str, tuple[NodeReport, float]] = field(default_factory=dict)
    published: OrderedDict[int, float] = field(default_factory=OrderedDict)
    held: dict[int, set[str]] = field(default_factory=dict)
    sync_s: OrderedDict[int, float] = field(default_factory=OrderedDict)
    step: dict[str, Any] = field(default_factory=dict)
    """The learner's last step (reward, accuracy, ...) and its delta's size."""
    evaluated: dict[str, Any] = field(default_factory=dict)
    """The last held-out evaluation: ``eval_version``, ``eval_accuracy`` (shown with every step)."""

    def rollout_figures(self) -> dict[str, float | None]:
        """From the nodes' last reports: ``rollout_tok_s`` (all rollouts together) and ``switch_ms`` (their
        mean pause per version switch); None where no rollout reported it."""
        rs = [r for r, _ in self.reports.values() if r.tok_s is not None]
        sw = [r.switch_ms for r in rs if r.switch_ms is not None and r.switches]
        return {
            "rollout_tok_s": round(sum(r.tok_s or 0.0 for r in rs), 1) if rs else None,
            "switch_ms": round(sum(sw) / len(sw), 2) if sw else None,
        }

    def on_published(self, version: int, started: float) -> None:
        """Version ``version`` began publication at ``started`` (its sync time counts from then)."""
        self.published[version] = started
        self.held[version] = set()
        while len(self.published) > KEEP_VERSIONS:
            v, _ = self.published.popitem(last=False)
            self.held.pop(v, None)

    def on_held(self, node: str, version: int, now: float) -> float | None:
        """Record a commit notice that came at ``now``; returns the version's sync time once the last
        node holds it."""
        got = self.held.get(version)
        if got is None or version in self.sync_s or node not in self.nodes:
            return None
        got.add(node)
        if not set(self.nodes) <= got:
            return None
        dt = now - self.published[version]
        self.sync_s[version] = dt
        while len(self.sync_s) > KEEP_VERSIONS:
            self.sync_s.popitem(last=False)
        return dt

    def on_report(self, node: str, report: NodeReport, now: float, *, member: bool = False) -> None:
        """``node``'s status report, come at ``now`` (``member``: a pool member that holds a place)."""
        if node in self.nodes or member:
            self.reports[node] = (report, now)

    def forget(self, member: str) -> None:
        """A pool member left its pool: its reports go (memory stays bounded by the pools' sizes)."""
        self.reports.pop(member, None)

    def slowest_link(self, now: float) -> tuple[float, str] | None:
        """The lowest rate a node reports receiving a bulk transfer at, and that node (None: no node
        has timed one yet), among reports heard in the last `LINK_REPORT_S` (a node gone, or one that
        left the parent it timed, stops counting). A node behind a relay times the whole path to it,
        so the minimum is the slowest link a version crosses. Pool members do not count: one spot
        machine, slow or lying, does not choose the coding for the whole tree."""
        got = [
            (r.link_mbit, n)
            for n, (r, at) in self.reports.items()
            if r.link_mbit is not None and now - at <= LINK_REPORT_S and n in self.nodes  # no pool member's
        ]
        return min(got) if got else None

    def snapshot(self, version: int | None, pool: dict[str, Any], now: float) -> Snapshot:
        """What a status client is sent at ``now`` (each report's age counts to it)."""
        nodes = {n: msgspec.structs.replace(r, age_s=round(now - at, 1)) for n, (r, at) in self.reports.items()}
        step = {k: v for k, v in self.step.items() if v is None or isinstance(v, bool | int | float | str)}
        return Snapshot(
            trainer=TrainerStats(version=version, **pool),
            nodes=nodes,
            sync_s={str(v): round(s, 4) for v, s in self.sync_s.items()},
            step=step,
            planned=self.planned,
        )


def render(snap: Snapshot) -> str:
    """One screenful: the trainer's line, then one line per node (pool members too), then each pool's members."""
    t = snap.trainer
    syncs = list(snap.sync_s.values())
    rej = sum(t.rejected.values())
    head = (
        f"trainer v{t.version}  results accepted {t.accepted} rejected {rej} (leased {t.in_flight}, pooled {t.pending})"
    )
    if syncs:
        head += f"  sync last {syncs[-1] * 1e3:.0f} ms, mean {sum(syncs) / len(syncs) * 1e3:.0f} ms"
    lines = [head]
    step = snap.step
    if isinstance(step.get("reward"), int | float):
        tok = sum(r.tok_s or 0.0 for r in snap.nodes.values())
        size = b if isinstance(b := step.get("bytes"), int) else 0
        dens = d if isinstance(d := step.get("density"), int | float) else 0.0
        ev = step.get("eval_accuracy")
        lines.append(
            f"learner step {step.get('version')}  reward {step['reward']:.3f}  "
            f"accuracy {step.get('accuracy') or 0:.3f}  delta {size / 1e3:.1f} kB "
            f"({100 * dens:.2f} % changed)  rollouts {tok:.0f} tok/s"
            + (f"  eval accuracy {ev:.3f} (v{step.get('eval_version')})" if isinstance(ev, int | float) else "")
        )
    for name, r in sorted(snap.nodes.items()):
        via = r.parent or "-"
        if r.parent is not None and not r.planned:
            via += f" (planned {snap.planned.get(name, '?')})"
        parts = [
            f"{name:<12} v{'-' if r.version is None else r.version:<4} via {via:<10}",
            f"in {r.bytes_in / 1e6:7.2f} MB",
        ]
        if r.link_mbit is not None:
            parts.append(f"link {r.link_mbit:.0f} Mbit/s")
        if r.completions is not None:
            parts.append(
                f"done {r.completions} ok {r.accepted} rejected {r.rejected} "
                f"{r.tok_s or 0:.0f} tok/s, switches {r.switches} ({r.switch_ms or 0:.1f} ms avg)"
            )
        if name in snap.speeds:
            parts.append(f"speed {snap.speeds[name]:.2f} prompts/s")
        if r.age_s > 3 * STATUS_EVERY_S:
            parts.append(f"(silent {r.age_s:.0f} s)")
        lines.append("  ".join(parts))
    for pool, members in sorted(snap.pools.items()):
        lines.append(
            f"pool {pool}: {len(members)} member{'' if len(members) == 1 else 's'}  {' '.join(members)}".rstrip()
        )
    return "\n".join(lines)


async def fetch_status(
    topo: Topology,
    timeout_s: float = 5.0,
    *,
    file: str | None = None,
    as_node: str | None = None,
    clock: Clock | None = None,
) -> Snapshot:
    """Ask the trainer of ``topo`` for the gathered status over the control channel (``timeout_s`` on
    ``clock``, default real time).

    With keys in the topology the client authenticates with the key pair named ``as_node``
    (default: the key directory's ``operator`` key, else the trainer's own)."""
    clock = clock or LoopClock()
    from aurora.auth.keys import load_client_keys

    t = topo.trainer
    if t.listen is None:
        raise AuroraError(f"the trainer {t.name!r} has no listen address to ask for status")
    hb = topo.heartbeat
    cfg = LinkConfig(heartbeat_s=hb.interval_s, suspect_after_s=hb.suspect_after_s, lost_after_s=hb.lost_after_s)
    keys, me = load_client_keys(topo, file, as_node)
    zt = ZmqTransport(me or f"status-{os.getpid()}-{secrets.token_hex(4)}", cfg=cfg, keys=keys, clock=clock)
    with unwrap_group():
        async with asyncio.TaskGroup() as tg:
            await zt.start_in(tg)
            try:
                async with clock.timeout(timeout_s):
                    ch = await zt.connect(t.name, t.listen)
                    await ch.send(StatusQuery())
                    answer = (await ch.recv()).msg
            except (TimeoutError, TransportClosed) as e:
                raise AuroraError(f"no status from the trainer {t.name!r} at {t.listen}: {e or 'timed out'}") from None
            finally:
                await zt.close()
    if not isinstance(answer, StatusSnapshot):
        raise AuroraError(f"the trainer {t.name!r} answered {type(answer).__name__}, not a status")
    return answer.snap
