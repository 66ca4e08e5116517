"""`aurora chaos T.yaml --steps N --seed S`: a topology's cluster under a seeded fault schedule, then a verdict.

Every node runs as its own process on this machine, as `aurora run` starts them (`aurora.run.Cluster`),
each with a store, at debug log level and with ``--faults`` (`aurora.transport.faults`). While the
trainer publishes ``N`` versions, the faults of `aurora.chaos.schedule` fire as it reaches their
versions: processes SIGKILLed and restarted, parent links silently partitioned and healed, a node that
stops reading. Once the trainer has published version ``N``, every fault still running ends (a killed
node restarts, a partition heals), the cluster is given until every node holds version ``N``, and the
nodes are stopped. `aurora.chaos.check` then reads the history — every node's log, one per life of its
process — and verifies its rules; each fault injected is in ``STATE/faults.jsonl``.

The verdict: the counts and "no violation", or the first violation with the history around it (every
node's events, and the faults, in time order). Invariants: the schedule is the seed's (what a
real cluster makes of it varies with timing); a node is signalled only while it is up and armed
(listening, or attached to its parent) — an unarmed process would die of SIGUSR1.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aurora.chaos.check import Report, Violation, check
from aurora.chaos.netns import NetnsNetwork
from aurora.chaos.schedule import Fault, schedule
from aurora.config.plan import Tree, plan
from aurora.config.topology import Topology, load_topology
from aurora.errors import AuroraError
from aurora.logs import event_time, read_events
from aurora.run import Cluster, ensure_keys, ensure_model

SETTLE_TIMEOUT_S = 300.0
"""After the last version: how long every node has to reach it (a killed rollout reloads its engine)."""
PROGRESS_EVERY_S = 10.0
"""How often the nodes' versions are printed while the run goes on."""
AROUND = 12
"""Events of the history shown before a violation (and half as many after)."""


@dataclass
class _Active:
    fault: Fault
    ends: float


@dataclass
class Outcome:
    report: Report
    faults: list[Fault]
    injected: int
    seconds: float
    state: Path
    history: list[dict[str, Any]] = field(default_factory=list)


def run_chaos(
    path: Path,
    *,
    steps: int,
    seed: int,
    faults: int | None = None,
    state: Path | None = None,
    progress: Callable[[str], None] = print,
    cache: Path | None = None,
    net: str = "auto",
) -> Outcome:
    """See the module docstring. ``net``: ``netns`` (every node in a network namespace of its own, a
    partition a black-holed link: needs root), ``process`` (a partition is the node silencing its parent
    link), or ``auto`` (namespaces where they can be made)."""
    topo = load_topology(path)
    topo = dataclasses.replace(topo, run=dataclasses.replace(topo.run, steps=steps))  # as the nodes' --steps
    tree = plan(topo, str(path))
    ensure_model(topo, path, progress, cache)
    ensure_keys(topo, path, progress)
    n_faults = max(1, steps // 10) if faults is None else faults
    plan_ = schedule(topo, tree, steps, seed, n_faults)
    if state is None:
        state = Path("runs") / f"chaos-{topo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    state.mkdir(parents=True, exist_ok=True)
    progress(f"state and logs: {state}")
    progress(f"{len(plan_)} faults (seed {seed}): " + "; ".join(f.describe() for f in plan_))
    old = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the nodes and removes the namespaces
    try:
        return _run(path, topo, tree, plan_, steps, state, progress, net)
    finally:
        signal.signal(signal.SIGTERM, old)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(
    path: Path,
    topo: Topology,
    tree: Tree,
    plan_: list[Fault],
    steps: int,
    state: Path,
    progress: Callable[[str], None],
    net: str,
) -> Outcome:
    why = NetnsNetwork.available()
    if net == "netns" and why is not None:
        raise AuroraError(f"--net netns: {why}")
    network = NetnsNetwork(topo, tree) if net != "process" and why is None else None
    try:
        node_args = ("--faults", "--steps", str(steps))
        if network is None:
            progress("partitions: each node silences its parent link itself (in-process)")
            cluster = Cluster(path, topo, tree, state, node_args=node_args, log_level="debug")
        else:
            progress("partitions: every node in a network namespace of its own, links cut for real")
            derived = network.topology(path, state / "topology.yaml")
            cluster = Cluster(derived, topo, tree, state, node_args=node_args, log_level="debug", wrap=network.wrap)
        t0 = time.monotonic()
        injected = _drive(cluster, plan_, steps, progress, network)
        seconds = time.monotonic() - t0
    finally:
        if network is not None:
            network.close()
    lives = {
        n.name: [read_events(cluster.log_path(n.name, k)) for k in range(cluster.lives.get(n.name, 0) + 1)]
        for n in topo.nodes
    }
    report = check(lives, topo.trainer.name, topo.staleness.max_versions, steps)
    history = _history(lives, state / "faults.jsonl")
    return Outcome(report, plan_, injected, seconds, state, history)


def _drive(
    cluster: Cluster, plan_: list[Fault], steps: int, progress: Callable[[str], None], network: NetnsNetwork | None
) -> int:
    topo = cluster.topo
    trainer = topo.trainer.name
    log = (cluster.state / "faults.jsonl").open("a")
    active: dict[str, _Active] = {}
    queue = list(plan_)
    injected = 0

    def record(what: str, f: Fault) -> None:
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        e = {"event": what, "fault": f.kind, "target": f.node, "at_version": f.at_version, "timestamp": now}
        log.write(json.dumps(e) + "\n")
        log.flush()

    def armed(name: str) -> bool:
        st = cluster.status[name]
        return name in cluster.procs and (st.listening if name == trainer else st.parent is not None)

    def toggle(f: Fault, *, on: bool) -> None:
        """A partition or a stop of reading, begun (``on``) or ended."""
        parent = cluster.tree.parent[f.node]
        if f.kind == "partition" and network is not None and parent is not None:
            network.cut(f.node, parent, up=not on)
        elif f.node in cluster.procs:
            cluster.procs[f.node].send_signal(signal.SIGUSR1 if f.kind == "partition" else signal.SIGUSR2)

    def end(a: _Active) -> None:
        f = a.fault
        if f.kind == "kill":
            cluster.start(f.node)
        else:
            toggle(f, on=False)
        record("fault_ended", f)
        progress(f"ended: {f.kind} {f.node}")

    try:
        cluster.start_all(progress)
        shown = 0.0
        while True:
            if (why := cluster.died()) is not None:
                raise AuroraError(why)
            now = time.monotonic()
            for name, a in list(active.items()):
                if now >= a.ends:
                    del active[name]
                    end(a)
            version = cluster.status[trainer].version or 0
            if version >= steps:
                break
            for f in list(queue):
                if f.at_version > version:
                    break
                if f.node in active or not armed(f.node):
                    continue  # its last fault is still on, or it is starting: later
                queue.remove(f)
                if f.kind == "kill":
                    cluster.kill(f.node)
                else:
                    toggle(f, on=True)
                active[f.node] = _Active(f, now + f.hold_s)
                injected += 1
                record("fault_injected", f)
                progress(f"v{version}: {f.describe()}")
            if now - shown >= PROGRESS_EVERY_S:
                progress(cluster.line())
                shown = now
            time.sleep(0.05)
        while active:  # the run is done: end what is still on (each taken off first, so never twice)
            end(active.popitem()[1])
        if queue:
            progress(f"{len(queue)} fault(s) not injected: the run ended before their nodes were up")
        progress(f"the trainer published version {steps}; waiting for every node to hold it")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not cluster.done() and time.monotonic() < deadline:
            if (why := cluster.died()) is not None:
                raise AuroraError(why)
            time.sleep(0.1)
        progress(cluster.line())
    finally:
        try:
            cluster.stop()
        finally:
            log.close()
    return injected


def _history(lives: dict[str, list[list[dict[str, Any]]]], faults: Path) -> list[dict[str, Any]]:
    """Every event of every node's lives and every fault, in time order (each with its ``node`` and ``life``)."""
    out = [
        dict(e, node=n, life=k)
        for n, ls in lives.items()
        for k, life in enumerate(ls)
        for e in life
        if "timestamp" in e
    ]
    if faults.is_file():
        out += [dict(e, node="chaos", life=0) for e in read_events(faults)]
    out.sort(key=event_time)
    return out


def around(history: list[dict[str, Any]], v: Violation) -> list[dict[str, Any]]:
    """The events of ``history`` around violation ``v`` (the end of the history when it names no event)."""
    if v.event is None or "timestamp" not in v.event:
        return history[-AROUND:]
    t = event_time(v.event)
    i = next((k for k, e in enumerate(history) if event_time(e) >= t), len(history))
    return history[max(0, i - AROUND) : i + AROUND // 2 + 1]


def line(e: dict[str, Any]) -> str:
    """One event as a line of the history: time, node (and life), event, its fields."""
    skip = {"timestamp", "node", "life", "event", "level", "role", "region"}
    fields = " ".join(f"{k}={json.dumps(v)[:80]}" for k, v in e.items() if k not in skip)
    life = f"#{e['life']}" if e.get("life") else ""
    return f"{str(e.get('timestamp', ''))[11:23]} {e.get('node')}{life} {e.get('event')} {fields}"


__all__ = ["Outcome", "around", "line", "run_chaos"]
