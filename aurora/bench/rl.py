"""`aurora bench rl`: the cluster's rollout throughput with weight sync on, next to the sync-free ideal.

Both runs are the same `aurora run` of one topology (trainer, relays, rollout
engines as processes, the GRPO learner training on the task), with every
sample generated to a fixed length (``engine.fixed_length``) and the learner
training on every group (``learner.skip_flat_groups: false``), so that a sample and
a step cost the same in both whatever the weights say (the ideal's rollouts stay on
version 0, so its rewards differ: with flat groups skipped, its learner did less
than half the work per step and the ratio measured the learner, not the sync):

* **sync**: every version goes down the relay tree as a delta; each rollout
  commits it and switches its engine between batches;
* **ideal**: ``sync.deliver: false`` — the trainer keeps its versions, rollouts
  stay on version 0, and the staleness bound is lifted: no encode, transfer,
  decode or switch, the sync cost removed.

Measured from the logs (one host clock): tokens/s = tokens of the results the
learner trained on, from the end of step ``warmup`` to the last step, over that
time; *paused* = for each rollout, the time its engine spent switching versions
(``engine_switched``: a batch engine's whole switch, a continuous engine's pause) within that window,
over the window, averaged over rollouts; the median switch, and a continuous engine's check per version
(``engine_checked``, after generation resumed). An
engine's first load (``from_version`` null: a rollout that attached late, or restarted) is
start-up, not a switch, and is not counted.

*CPU per step*, by role: each node's CPU time over the same window (``cpu.jsonl``,
sampled by `aurora.run` at every step), over the steps in it, averaged over the
nodes of a role. On this machine every node shares the same few cores, so the
sync run's extra CPU slows everyone; on a cluster each node has its own, and a
role's extra CPU per step is what sync costs *that* node.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from aurora.config.rl import ModelSpec
from aurora.config.topology import load_topology
from aurora.errors import ConfigError
from aurora.events import BATCH_GENERATED, ENGINE_CHECKED, ENGINE_SWITCHED, STEP, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.logs import event_time, read_events
from aurora.metrics import collect
from aurora.run import run


def _variant(raw: dict[str, Any], file: Path, steps: int, ideal: bool) -> dict[str, Any]:
    d = copy.deepcopy(raw)
    if d.get("learner", {}).get("kind") != "grpo":
        raise ConfigError("aurora bench rl needs a grpo learner", file=str(file), path="learner.kind")
    model = ModelSpec(**d.get("model", {})).resolved(str(file))  # paths stay right from a temporary file
    d["model"] = {**d.get("model", {}), "path": model.path}
    keys = d.get("keys")
    if isinstance(keys, dict) and keys.get("dir") and not Path(keys["dir"]).is_absolute():
        keys["dir"] = str((file.parent / keys["dir"]).resolve())  # the topology's keys, not a stray copy
    task = d.get("task", {})
    if task.get("kind") == "jsonl" and not Path(task["path"]).is_absolute():
        task["path"] = str((file.parent / task["path"]).resolve())
    d["run"] = {**d.get("run", {}), "steps": steps}
    d["engine"] = {**d.get("engine", {}), "fixed_length": True}
    d["learner"] = {**d["learner"], "skip_flat_groups": False}
    if ideal:
        d["sync"] = {**d.get("sync", {}), "deliver": False}
        d["staleness"] = {"max_versions": steps + 1}
    return d


def cpu_per_step(path: Path, first: int, last: int, roles: dict[str, str]) -> dict[str, float] | None:
    """Mean CPU ms per step of each role's nodes from version ``first`` to ``last`` (None without samples)."""
    if not path.exists():
        return None
    at = {int(r["version"]): r["cpu_s"] for r in map(json.loads, path.read_text().splitlines()) if r}
    if first not in at or last not in at or last <= first:
        return None
    per_role: dict[str, list[float]] = {}
    for node, role in roles.items():
        if node in at[first] and node in at[last]:
            per_role.setdefault(role, []).append((at[last][node] - at[first][node]) / (last - first) * 1e3)
    out = {role: sum(v) / len(v) for role, v in per_role.items()}
    out["all"] = sum(sum(v) for v in per_role.values())
    return out


def measure(
    state: Path, trainer: str, rollouts: list[str], warmup: int, roles: dict[str, str] | None = None
) -> dict[str, Any]:
    events = read_events(state / f"{trainer}.log")
    steps = [e for e in events if e.get("event") == STEP]
    if len(steps) <= warmup + 1:
        raise ConfigError(f"the run made {len(steps)} steps; need more than warmup + 1 = {warmup + 1}")
    t0, t1 = event_time(steps[warmup]), event_time(steps[-1])
    tokens = sum(int(e["tokens"]) for e in steps[warmup + 1 :])
    paused = []
    leased = {}
    switch_ms: list[float] = []
    check_ms: list[float] = []
    for r in rollouts:
        log = read_events(state / f"{r}.log")
        sw = [
            e
            for e in log
            if e.get("event") == ENGINE_SWITCHED and e.get("from_version") is not None and t0 <= event_time(e) <= t1
        ]
        paused.append(sum(float(e["switch_ms"]) for e in sw) / 1e3 / (t1 - t0))
        switch_ms += [float(e["switch_ms"]) for e in sw]
        check_ms += [
            float(e["check_ms"]) for e in log if e.get("event") == ENGINE_CHECKED and t0 <= event_time(e) <= t1
        ]
        leased[r] = sum(
            int(e["prompts"]) for e in log if e.get("event") == BATCH_GENERATED and t0 <= event_time(e) <= t1
        )
    rows = [r for r in collect(events) if r["version"] > warmup]
    cpu = cpu_per_step(state / "cpu.jsonl", int(steps[warmup]["version"]), int(steps[-1]["version"]), roles or {})

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    trust = _trust(state, trainer, [n for n, role in (roles or {}).items() if role != "trainer"], events, t0, t1)
    return {
        **trust,
        "tokens_s": tokens / (t1 - t0),
        "steps_s": (len(steps) - 1 - warmup) / (t1 - t0),
        "window_s": t1 - t0,
        "paused": sum(paused) / len(paused),
        "switch_ms_median": statistics.median(switch_ms) if switch_ms else None,
        "check_ms": statistics.mean(check_ms) if check_ms else None,
        "sync_ms": (mean("sync_s") or 0.0) * 1e3,
        "delta_kb": (mean("bytes") or 0.0) / 1e3,
        "density": mean("density"),
        "reward": mean("reward"),
        "cpu_ms_per_step": cpu,
        # each rollout's part of the prompts generated in the window (its `batch_generated` events)
        "shares": {r: n / sum(leased.values()) for r, n in leased.items()} if sum(leased.values()) else {},
    }


def _trust(
    state: Path, trainer: str, others: list[str], events: list[dict[str, Any]], t0: float, t1: float
) -> dict[str, Any]:
    """What authenticating versions and results cost, from the logs within the timed window: the
    trainer's seal per version (state hash waited for + signature) against its publish time, each
    node's seal check per commit, and the coordinator's checks per result; and the learner's scoring
    per sample (decode + reward)."""

    def within(e: dict[str, Any]) -> bool:
        return t0 <= event_time(e) <= t1

    pubs = [e for e in events if e.get("event") == VERSION_PUBLISHED and e.get("seal_s") is not None and within(e)]
    commits = [
        e
        for n in others
        for e in read_events(state / f"{n}.log")
        if e.get("event") == VERSION_COMMITTED and e.get("verify_s") is not None and within(e)
    ]
    checks = [e["validate_us"] for e in events if e.get("event") == STEP and e.get("validate_us") is not None]
    scoring = [float(e["score_us"]) for e in events if e.get("event") == STEP and e.get("score_us") is not None]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    seal = mean([float(e["seal_s"]) + float(e.get("hash_wait_s", 0.0)) for e in pubs])
    return {
        "seal_ms": None if seal is None else 1e3 * seal,
        "publish_ms": None if not pubs else 1e3 * sum(float(e["publish_s"]) for e in pubs) / len(pubs),
        "verify_ms": None if not commits else 1e3 * sum(float(e["verify_s"]) for e in commits) / len(commits),
        "verified_by": sorted({str(e.get("verified")) for e in commits}),
        "validate_us": checks[-1] if checks else None,
        "score_us": mean(scoring),
    }


def bench(
    topology: Path, *, steps: int = 40, warmup: int = 5, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    raw = yaml.safe_load(topology.read_text())
    topo = load_topology(topology)
    rollouts = [n.name for n in topo.nodes if n.role == "rollout"]
    roles: dict[str, str] = {n.name: n.role for n in topo.nodes}
    out: dict[str, Any] = {"topology": str(topology), "steps": steps, "warmup": warmup}
    with tempfile.TemporaryDirectory(prefix="aurora-bench-rl-") as tmp:
        for mode in ("sync", "ideal"):
            f = Path(tmp) / f"{mode}.yaml"
            f.write_text(yaml.safe_dump(_variant(raw, topology, steps, mode == "ideal")))
            progress(f"-- {mode}: {steps} steps")

            def quiet(text: str, *, redraw: bool = False) -> None:
                if not redraw:
                    progress(f"   {text}")

            run(f, progress=quiet, state=Path(tmp) / mode)
            out[mode] = measure(Path(tmp) / mode, topo.trainer.name, rollouts, warmup, roles)
    out["ratio"] = out["sync"]["tokens_s"] / out["ideal"]["tokens_s"]
    return out


def render(r: dict[str, Any]) -> str:
    lines = [
        f"aurora bench rl: {r['topology']}, {r['steps']} steps (the first {r['warmup']} not timed), "
        "fixed-length generation",
        f"{'run':<6} {'tokens/s':>9} {'steps/s':>8} {'paused':>7} {'sync ms':>8} {'delta kB':>9} {'changed':>8}",
    ]
    for mode in ("sync", "ideal"):
        m = r[mode]
        changed = "-" if m["density"] is None else f"{100 * m['density']:.1f} %"
        lines.append(
            f"{mode:<6} {m['tokens_s']:>9.0f} {m['steps_s']:>8.2f} {100 * m['paused']:>6.2f}% "
            f"{m['sync_ms']:>8.0f} {m['delta_kb']:>9.1f} {changed:>8}"
        )
    lines.append(
        f"sync / ideal tokens/s: {r['ratio']:.3f} (target >= 0.95); generation paused for switches: "
        f"{100 * r['sync']['paused']:.2f} % of wall time (target <= 2 %)"
    )
    s = r["sync"]
    if s.get("switch_ms_median") is not None:
        check = (
            f"; its check (after resuming: read back in the engine and hashed) {s['check_ms']:.1f} ms per version"
            if s.get("check_ms") is not None
            else " (a batch engine: its check is inside the switch)"
        )
        lines.append(f"switch: median {s['switch_ms_median']:.1f} ms of stopped generation (target <= 100 ms){check}")
    for mode in ("sync", "ideal"):
        if r[mode].get("shares"):
            parts = ", ".join(f"{w} {v:.2f}" for w, v in r[mode]["shares"].items())
            lines.append(f"work shares ({mode}, prompts generated in the window): {parts}")
    if s.get("seal_ms") is not None and s.get("publish_ms"):
        lines.append(
            f"trust: sealing a version (state hash waited for + Ed25519) {s['seal_ms']:.2f} ms = "
            f"{100 * s['seal_ms'] / s['publish_ms']:.1f} % of its publish ({s['publish_ms']:.1f} ms); "
            f"a node's seal check per commit {s['verify_ms'] or 0:.2f} ms "
            f"(verified by {'/'.join(s['verified_by'])}); result checks {s['validate_us'] or 0:.0f} µs "
            "per result"
        )
    if s.get("score_us") is not None:
        lines.append(f"scoring: {s['score_us']:.0f} µs per sample on the trainer (decode + reward), mean of the steps")
    cpu = {mode: r[mode].get("cpu_ms_per_step") for mode in ("sync", "ideal")}
    if cpu["sync"] and cpu["ideal"]:
        cols = [c for c in ("trainer", "relay", "rollout", "all") if c in cpu["sync"] and c in cpu["ideal"]]
        lines.append("CPU ms per step: a node of each role (mean), and all nodes together")
        lines.append(f"{'run':<6} " + " ".join(f"{c:>9}" for c in cols))
        lines.extend(
            f"{mode:<6} " + " ".join(f"{cpu[mode][c]:>9.0f}" for c in cols)  # type: ignore[index]
            for mode in ("sync", "ideal")
        )
        lines.append(
            f"{'extra':<6} " + " ".join(f"{100 * (cpu['sync'][c] / cpu['ideal'][c] - 1):>8.0f}%" for c in cols)
        )
    return "\n".join(lines)


def to_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2)
