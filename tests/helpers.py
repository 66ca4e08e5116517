"""Small builders shared by the tests."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aurora.codec import Weights
from aurora.codec.dtypes import BY_NAME, tensor_from_bits
from aurora.logs import read_events as log_events  # the tests' name for it


def tensor_from_raw(dtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    d = BY_NAME[dtype]
    return tensor_from_bits(raw.astype(d.uint), d, shape).clone()


def perturb(w: Weights, density: float, seed: int) -> Weights:
    """A copy of ``w`` with about ``density`` of the elements' bits changed (never to equal)."""
    rng = np.random.default_rng(seed)
    out = w.copy()
    for name in out:
        bits = out[name].bits
        m = rng.random(bits.size) < density
        if m.any():
            kind = rng.integers(0, 3)
            width = bits.dtype.itemsize * 8
            if kind == 0:  # +-1 ulp steps
                step = rng.choice(np.array([1, 2**width - 1], dtype=np.uint64), size=int(m.sum()))
                bits[m] = ((bits[m].astype(np.uint64) + step) & np.uint64(2**width - 1)).astype(bits.dtype)
            elif kind == 1:  # random new bits
                bits[m] = bits[m] ^ np.maximum(
                    rng.integers(0, 2 ** min(width, 63), size=int(m.sum()), dtype=np.uint64), 1
                ).astype(bits.dtype)
            else:  # sign flips
                bits[m] = bits[m] ^ (bits.dtype.type(1) << bits.dtype.type(width - 1))
    out.forget_digests()
    return out


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free a moment ago, for topology files that must name addresses
    (a node binds its own; another process could take one in between, which is rare)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def events_in(log: Path, event: str) -> list[dict[str, Any]]:
    """The ``event`` events of a node's log (none while the file does not exist)."""
    return [e for e in log_events(log) if e["event"] == event] if log.exists() else []


def version_in(log: Path, trainer: bool) -> int:
    """The newest version a node's log says it published (the trainer) or committed (-1: none yet)."""
    from aurora.events import VERSION_COMMITTED, VERSION_PUBLISHED

    key = VERSION_PUBLISHED if trainer else VERSION_COMMITTED
    return max((e["version"] for e in events_in(log, key)), default=-1)


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Poll ``cond`` (a process's log, say) until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def rl_topology(tmp_path: Path, steps: int, engine: str = "torch", lr: float = 1e-3) -> Path:
    """A small RL cluster (trainer, relay, 2 rollouts) learning single-digit addition with GRPO."""
    p = free_ports(2)
    topo = tmp_path / "rl.yaml"
    topo.write_text(f"""
name: rl-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{p[0]}"}}
  - {{name: relay, role: relay, region: local, listen: "tcp://127.0.0.1:{p[1]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: local, parent: relay}}
  - {{name: rollout-2, role: rollout, region: local, parent: relay}}
heartbeat: {{interval_s: 0.5, suspect_after_s: 1.5, lost_after_s: 3.0}}
leases: {{ttl_s: 10.0, prompts_per_lease: 8, batch_s: 1.0}}
staleness: {{max_versions: 1}}
model: {{path: model, preset: tiny, seed: 0}}
task: {{kind: arithmetic, max_operand: 9}}
learner: {{kind: grpo, group_size: 8, prompts_per_step: 32, lr: {lr}, warm_start_steps: 70,
          checkpoint_every: 10, seed: 0}}
engine: {{kind: {engine}, max_new_tokens: 5, temperature: 1.0, seed: 0}}
run: {{steps: {steps}}}
""")
    return topo


def one_rollout_topology(tmp_path: Path, *, learner: str, engine: str, steps: int, model: str = "") -> Path:
    """A trainer and one rollout under it on loopback learning single-digit addition (``learner`` and
    ``engine``: the sections' YAML mappings; ``model``: the model section, default the tiny preset
    built in ``tmp_path/model``)."""
    topo = tmp_path / "one-rollout.yaml"
    topo.write_text(f"""
name: one-rollout
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{free_ports(1)[0]}"}}
  - {{name: rollout-1, role: rollout, region: local, parent: trainer}}
heartbeat: {{interval_s: 0.5, suspect_after_s: 1.5, lost_after_s: 3.0}}
leases: {{ttl_s: 10.0, prompts_per_lease: 8, batch_s: 1.0}}
staleness: {{max_versions: 1}}
model: {model or "{path: model, preset: tiny, seed: 0}"}
task: {{kind: arithmetic, max_operand: 9}}
learner: {learner}
engine: {engine}
run: {{steps: {steps}}}
""")
    return topo


async def run_in_process(
    tmp_path: Path,
    topology: str,
    names: tuple[str, ...],
    done: Callable[[dict[str, Any]], bool],
    *,
    timeout_s: float = 30.0,
    inject: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the nodes ``names`` of ``topology`` (YAML text; ``mem://`` listen addresses) in this event
    loop over in-memory links, until ``done(nodes)`` or ``timeout_s``; ``inject(nodes)`` is called once
    every node is built. Returns the nodes (`aurora.actors.node.Node`) and every log event."""
    import asyncio
    import contextlib

    from structlog.testing import capture_logs

    from aurora.config.plan import plan
    from aurora.config.topology import load_topology
    from aurora.node import run_node
    from aurora.testing.links import LinkNet

    path = tmp_path / "topology.yaml"
    path.write_text(topology)
    topo = load_topology(path)
    tree = plan(topo, str(path))
    net = LinkNet()
    nodes: dict[str, Any] = {}
    stop = asyncio.Event()
    with capture_logs() as logs:
        tasks = [
            asyncio.create_task(
                run_node(
                    topo,
                    tree,
                    n,
                    stop,
                    transport=net.transport(n, bind=topo.node(n).listen),
                    observe=lambda node, n=n: nodes.__setitem__(n, node),
                )
            )
            for n in names
        ]
        try:
            async with asyncio.timeout(timeout_s):
                while len(nodes) < len(names):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                if inject is not None:
                    inject(nodes)
                while not done(nodes):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            for t in tasks:
                with contextlib.suppress(Exception):
                    await t
    return nodes, logs
