"""Per-step metrics of a run, from the trainer's log: a JSONL file and a PNG plot.

One row per published version, joining the trainer's events for it: ``step``
(the learner's figures: reward, accuracy, loss, staleness, ...),
``version_published`` (delta bytes, changed fraction, encode time),
``version_synced`` (seconds from publication until every node held it) and
``evaluated`` (``eval_accuracy`` on held-out prompts, on the versions evaluated; version 0's
row holds only that).
Rows are in version order; a field the log does not have is None. Both files are written
whole or not at all (`aurora.store.atomic`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aurora.events import EVALUATED, STEP, VERSION_PUBLISHED, VERSION_SYNCED
from aurora.store.atomic import atomic_path, write_bytes

STEP_FIELDS = (
    "reward",
    "accuracy",
    "loss",
    "kl",
    "clip_frac",
    "grad_norm",
    "staleness",
    "groups",
    "groups_skipped",
    "samples",
    "tokens",
    "learn_s",
    "reward_errors",
    "score_us",
)


def collect(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows from the trainer's events (`aurora.logs.read_events` of its log)."""
    rows: dict[int, dict[str, Any]] = {}

    def row(v: int) -> dict[str, Any]:
        return rows.setdefault(v, {"version": v})

    for e in events:
        ev, v = e.get("event"), e.get("version")
        if not isinstance(v, int):
            continue
        if ev == STEP:
            row(v).update({k: e.get(k) for k in STEP_FIELDS})
        elif ev == VERSION_PUBLISHED:
            row(v).update(bytes=e.get("bytes"), density=e.get("density"), publish_s=e.get("publish_s"))
        elif ev == VERSION_SYNCED:
            row(v)["sync_s"] = e.get("sync_s")
        elif ev == EVALUATED and e.get("eval_accuracy") is not None:
            row(v).update(eval_accuracy=e.get("eval_accuracy"), eval_s=e.get("eval_s"))
    return [rows[v] for v in sorted(rows) if v > 0 or "eval_accuracy" in rows[v]]


def write_jsonl(rows: list[dict[str, Any]], dest: Path) -> Path:
    write_bytes(dest, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return dest


def window(n: int) -> int:
    """The smoothing window for ``n`` points: a tenth of them, at least 1."""
    return max(1, n // 10)


def smooth(ys: list[float]) -> list[float]:
    """The trailing mean of `window` points at each point (fewer at the start)."""
    w, out, total = window(len(ys)), [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - w] if i >= w else 0.0)
        out.append(total / min(i + 1, w))
    return out


def plot(rows: list[dict[str, Any]], dest: Path, title: str = "") -> Path:
    """Reward and accuracy (raw points faint, their trailing mean over them) and the held-out eval
    accuracy, delta size, and sync time per step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        got = [(r["version"], float(r[key]) * scale) for r in rows if r.get(key) is not None]
        return [v for v, _ in got], [y for _, y in got]

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    for key, color in (("reward", "tab:blue"), ("accuracy", "tab:orange")):
        xs, ys = series(key)
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(xs, smooth(ys), color=color, label=f"{key} (mean of {window(len(ys))})")
    xs, ys = series("eval_accuracy")
    if xs:
        ax.plot(xs, ys, color="tab:green", marker="o", label="eval accuracy (held out, greedy)")
    ax.set_ylabel("per step")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    ax.set_title(title or "training")
    ax = axes[1]
    ax.plot(*series("bytes", 1e-3), color="tab:green")
    ax.set_ylabel("delta (kB)")
    twin = ax.twinx()
    twin.plot(*series("density", 100.0), color="tab:gray", linestyle=":")
    twin.set_ylabel("changed (%)")
    ax = axes[2]
    ax.plot(*series("sync_s", 1e3), color="tab:red")
    ax.set_ylabel("sync (ms)")
    ax.set_xlabel("version (step)")
    fig.tight_layout()
    with atomic_path(dest) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return dest
