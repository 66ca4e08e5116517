"""`aurora run T.yaml`: every node of a topology on this machine, as separate processes.

Nodes start parents first: a child starts once its parent has attached to the
tree (so it is not refused and sent to a fallback), or, below the trainer, once
the trainer listens (it loads its model first: a child dialling it earlier hears
nothing and counts it lost). Each node's JSON log lines
are read as they come (and kept as ``STATE/NODE.log``); the status display is
the trainer's gathered status, read over the control channel as ``aurora
status`` does (the versions seen in the logs until the trainer answers); the run
ends when the trainer has published ``run.steps`` versions and every other node
holds the last one — or on Ctrl-C / SIGTERM. Nodes are stopped children first
(SIGTERM, then SIGKILL after a grace period), each by its process group.
A node that exits on its own is an error that names the node and its last log line.
At every step the trainer logs, the CPU time each node process has used so far
is appended to ``STATE/cpu.jsonl`` (``{"version": v, "cpu_s": {node: s}}``, read
with `aurora.runtime.processes.cpu_s`; a node that is gone is left out): what `aurora bench rl`
splits by role.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from aurora.actors.status import STATUS_EVERY_S, fetch_status, render
from aurora.config.plan import Tree, plan
from aurora.config.topology import Topology, load_topology
from aurora.errors import AuroraError
from aurora.events import (
    NODE_RESUMED,
    NODE_STARTED,
    PARENT_ATTACHED,
    STEP,
    TRAINER_RESUMED,
    VERSION_COMMITTED,
    VERSION_PUBLISHED,
)
from aurora.logs import read_events
from aurora.metrics import collect, plot, write_jsonl
from aurora.protocol.messages import Snapshot
from aurora.rl.model import init_model_dir
from aurora.runtime.processes import cpu_s, end_groups, node_argv, start_group

Progress = Callable[..., None]
"""``progress(text)``: show a message; ``progress((snapshot, line), redraw=True)``: the cluster's status now
(the trainer's `Snapshot`, or None and the versions seen in the logs), which a view redraws in place."""

ATTACH_TIMEOUT_S = 180.0  # a clean checkout compiles the codec kernels on first use
STOP_GRACE_S = 10.0


@dataclass
class NodeStatus:
    name: str
    role: str
    version: int | None = None
    parent: str | None = None
    listening: bool = False
    last: str = ""


class Cluster:
    def __init__(
        self,
        path: Path,
        topo: Topology,
        tree: Tree,
        state: Path,
        *,
        node_args: tuple[str, ...] = (),
        log_level: str | None = None,
        wrap: Callable[[str, list[str]], list[str]] | None = None,
    ) -> None:
        self.path = path
        self.node_args = node_args
        """More `aurora node` options for every node (`aurora chaos`: ``--faults``, ``--steps``)."""
        self.wrap = wrap
        """How a node's command runs (`aurora chaos` in namespaces: inside the node's own)."""
        self.log_level = log_level
        self.lives: dict[str, int] = {}
        """How often each node was started: its first life logs to ``NAME.log``, the k-th restart to
        ``NAME.life{k}.log`` (`log_path`)."""
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        self.topo = topo
        self.tree = tree
        self.status = {n.name: NodeStatus(n.name, n.role) for n in topo.nodes}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self.threads = compute_threads(topo)
        """Each node's share of this machine's cores (OMP_NUM_THREADS), None when the user set it."""
        self.codec_threads = max(1, (os.cpu_count() or 1) // len(topo.nodes))
        """Each node's codec threads (`aurora node --threads`): every node shares this machine."""

    def order(self) -> list[str]:
        """Parents before children (breadth-first from the trainer)."""
        out, frontier = [], [self.topo.trainer.name]
        while frontier:
            out += frontier
            frontier = [c for p in frontier for c in self.tree.children(p)]
        return out

    def log_path(self, name: str, life: int = 0) -> Path:
        return self.state / (f"{name}.log" if life == 0 else f"{name}.life{life}.log")

    def start(self, name: str) -> None:
        """Start node ``name`` (again, after `kill`: it resumes from its store)."""
        argv = node_argv(
            self.path,
            name,
            "--store",
            str(self.state / name),
            "--threads",
            str(self.codec_threads),
            *self.node_args,
            log_level=self.log_level,
        )
        if self.wrap is not None:
            argv = self.wrap(name, argv)
        env = os.environ | ({} if self.threads is None else {"OMP_NUM_THREADS": str(self.threads)})
        life = self.lives.get(name, -1) + 1
        self.lives[name] = life
        with self._lock:
            st = self.status[name]
            st.listening, st.parent = False, None
        p = start_group(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.procs[name] = p
        assert p.stderr is not None
        threading.Thread(target=self._read, args=(name, p.stderr, self.log_path(name, life)), daemon=True).start()

    def start_all(self, progress: Progress) -> None:
        """Start every node, parents first: each child once its parent is ready (`wait_ready`)."""
        progress(f"starting {len(self.topo.nodes)} nodes of {self.topo.name!r} (parents first)")
        for name in self.order():
            if (parent := self.tree.parent[name]) is not None:
                self.wait_ready(parent, ATTACH_TIMEOUT_S)
            self.start(name)

    def kill(self, name: str) -> None:
        """SIGKILL node ``name``'s process group (a crash: nothing is flushed or said goodbye)."""
        end_groups([self.procs.pop(name)], close_pipes=False)

    def _read(self, name: str, stream: IO[bytes], path: Path) -> None:
        with path.open("ab") as keep:
            for raw in stream:
                keep.write(raw)
                keep.flush()
                self._note(name, raw.decode(errors="replace").strip())

    def _note(self, name: str, line: str) -> None:
        if line:
            try:
                e: dict[str, Any] = json.loads(line)
            except ValueError:
                e = {"event": line}
            with self._lock:
                st = self.status[name]
                st.last = line[:300]
                ev = e.get("event")
                if ev in (VERSION_COMMITTED, VERSION_PUBLISHED, NODE_RESUMED, TRAINER_RESUMED):
                    st.version = int(e["version"])
                elif ev == PARENT_ATTACHED:
                    st.parent = str(e.get("parent"))
                elif ev == NODE_STARTED:
                    st.listening = True
            if ev == STEP and name == self.topo.trainer.name and isinstance(e.get("version"), int):
                self._sample_cpu(int(e["version"]))

    def _sample_cpu(self, version: int) -> None:
        cpu = {n: c for n, p in list(self.procs.items()) if (c := cpu_s(p.pid)) is not None}
        if cpu:
            with (self.state / "cpu.jsonl").open("a") as f:
                f.write(json.dumps({"version": version, "cpu_s": cpu}) + "\n")

    def display(self) -> tuple[Snapshot | None, str]:
        """The trainer's gathered status (the control channel), or the versions seen in the logs until then."""
        try:
            return asyncio.run(fetch_status(self.topo, timeout_s=2.0, file=str(self.path))), ""
        except AuroraError:
            return None, self.line()

    def died(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"node {name!r} exited with code {p.returncode}; its last log line: {self.status[name].last}"
        return None

    def wait_ready(self, name: str, timeout_s: float) -> None:
        """Until node ``name`` can take children: the trainer listening, any other node attached to its parent."""
        st = self.status[name]
        trainer = name == self.topo.trainer.name
        deadline = time.monotonic() + timeout_s
        while not (st.listening if trainer else st.parent is not None):
            if (why := self.died()) is not None:
                raise AuroraError(why)
            if time.monotonic() > deadline:
                what = "start listening" if trainer else "attach to its parent"
                raise AuroraError(f"node {name!r} did not {what} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def done(self) -> bool:
        trainer = self.status[self.topo.trainer.name]
        if trainer.version is None or trainer.version < self.topo.run.steps:
            return False
        if not self.topo.sync.deliver:
            return True  # the sync-free ideal: nobody else gets the versions
        return all(s.version == trainer.version for s in self.status.values())

    def line(self) -> str:
        with self._lock:
            parts = [f"{s.name} v{'-' if s.version is None else s.version}" for s in self.status.values()]
        return " | ".join(parts)

    def stop(self) -> None:
        """Children first: reverse start order, SIGTERM then SIGKILL after the grace period (each
        node's process group; its stderr stays with the thread reading it)."""
        order = [self.procs[n] for n in reversed(self.order()) if n in self.procs]
        end_groups(order, grace_s=STOP_GRACE_S, close_pipes=False)


def run(
    path: Path,
    *,
    progress: Progress = print,
    interval_s: float = 1.0,
    state: Path | None = None,
    cache: Path | None = None,
    log_level: str | None = None,
) -> dict[str, NodeStatus]:
    """Run the topology at ``path``; ``state`` defaults to ``runs/NAME-TIME`` (kept); ``log_level``: the
    nodes' (default: `aurora node`'s)."""
    topo = load_topology(path)
    tree = plan(topo, str(path))
    ensure_model(topo, path, progress, cache)
    ensure_keys(topo, path, progress)
    if state is None:
        state = Path("runs") / f"{topo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    progress(f"state, logs and metrics: {state}")
    cluster = Cluster(path, topo, tree, state, log_level=log_level)
    if cluster.threads is not None:
        progress(f"{cluster.threads} torch thread(s) per node ({os.cpu_count()} CPUs; OMP_NUM_THREADS overrides)")
    status = _run(cluster, progress, interval_s)
    report(state / f"{topo.trainer.name}.log", state, topo.name, progress)
    return status


def compute_threads(topo: Topology) -> int | None:
    """Torch threads per node when every node runs on this machine: the cores shared out among
    the nodes that compute (the trainer and the rollouts with an engine), at least 1, so that
    their thread pools do not oversubscribe the cores (each would otherwise take them all).
    None when ``OMP_NUM_THREADS`` is already set: the user's choice stands."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    computing = 1 + sum(1 for n in topo.nodes if n.role == "rollout") if topo.engine is not None else 1
    return max(1, (os.cpu_count() or 1) // computing)


def ensure_model(topo: Topology, path: Path, progress: Progress, cache: Path | None = None) -> None:
    """Make the topology's model directory if it is missing: fetch the known model ``model.fetch``
    names (``aurora model fetch``; the download is kept in ``cache``), else build ``model.preset``
    (``aurora model init``)."""
    if topo.model is None or topo.model.path is None:
        return
    m = topo.model.resolved(str(path))
    assert m.path is not None
    if (Path(m.path) / "config.json").is_file():
        return
    if m.fetch is not None:
        from aurora.rl.fetch import fetch_model

        progress(f"fetching the model {m.fetch} into {m.path} (once; as `aurora model fetch` does)")
        fetch_model(m.fetch, Path(m.path), progress=lambda line: progress(f"  {line}"), cache_dir=cache)
        return
    progress(f"creating the model {m.path} (preset {m.preset}, seed {m.seed}; as `aurora model init` does)")
    init_model_dir(Path(m.path), m.preset, m.seed, m.max_positions)


def ensure_keys(topo: Topology, path: Path, progress: Progress) -> None:
    """Make the keys a topology's key directory lacks (every node runs here, so every secret may too)."""
    from aurora.auth.keys import generate_topology_keys, key_dir

    if key_dir(topo, str(path)) is None:
        return
    made = [p for p, new in generate_topology_keys(topo, str(path)) if new]
    if made:
        progress(f"made {len(made)} key files in {made[0].parent} (as `aurora keys generate --topology` does)")


def report(trainer_log: Path, state: Path, title: str, progress: Progress) -> None:
    """Write ``metrics.jsonl`` and ``metrics.png`` from the trainer's log (when it trained)."""
    if not trainer_log.is_file():
        return
    rows = collect(read_events(trainer_log))
    if not any(r.get("reward") is not None for r in rows):
        return
    write_jsonl(rows, state / "metrics.jsonl")
    plot(rows, state / "metrics.png", title)
    rewards = [r["reward"] for r in rows if r.get("reward") is not None]
    k = max(1, min(10, len(rewards) // 3))
    evals = [(r["version"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    said = ""
    if len(evals) >= 2:
        said = f"; eval accuracy v{evals[0][0]} {evals[0][1]:.3f}, v{evals[-1][0]} {evals[-1][1]:.3f}"
    progress(
        f"reward: first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps {sum(rewards[-k:]) / k:.3f}{said}; "
        f"metrics: {state / 'metrics.jsonl'}, plot: {state / 'metrics.png'}"
    )


def _run(cluster: Cluster, progress: Progress, interval_s: float) -> dict[str, NodeStatus]:
    topo = cluster.topo
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start_all(progress)
        last = 0.0
        while not stopping and not cluster.done():
            if (why := cluster.died()) is not None:
                raise AuroraError(why)
            if time.monotonic() - last >= interval_s:
                progress(cluster.display(), redraw=True)
                last = time.monotonic()
            time.sleep(0.05)
        if not stopping:
            time.sleep(STATUS_EVERY_S + 0.2)  # the nodes' reports of the last version reach the trainer
        final, line = cluster.display()
        progress((final, line), redraw=True)
        progress(render(final) if final is not None else line)  # the last status, once, as text
        progress("stopping (children first)" if stopping else f"done: every node holds version {topo.run.steps}")
    except KeyboardInterrupt:
        progress("interrupted: stopping (children first)")
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, old)
    return cluster.status
