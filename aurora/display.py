"""What `aurora run` and `aurora status --watch` show: one live table on a terminal, one line per step in a file.

`RunView` takes messages (``message``) and the cluster's gathered status (``status``, a
`Snapshot`, or the versions seen in the logs until the trainer answers). On a terminal it
redraws one table in place (rich's `Live`) with a progress line for the whole run (step N of
M, elapsed, ETA), messages scrolling above it. Piped to a file it prints each message once,
and one line per new learner step — never the whole block again.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from aurora.protocol.messages import Snapshot

STATUS_SILENT_S = 3.0
"""A node whose last report is older than this is shown as silent."""


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def step_line(snap: Snapshot, total: int | None, elapsed_s: float, eta_s: float | None) -> str:
    """One line about the learner's last step and the cluster (what a log file gets per step)."""
    t, step = snap.trainer, snap.step
    syncs = list(snap.sync_s.values())
    parts = [f"step {t.version}" + (f"/{total}" if total else "")]

    def num(key: str) -> float | None:
        v = step.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    if (r := num("reward")) is not None:
        parts.append(f"reward {r:.3f}")
    if (a := num("accuracy")) is not None:
        parts.append(f"accuracy {a:.3f}")
    if (e := num("eval_accuracy")) is not None:
        parts.append(f"eval {e:.3f} (v{step.get('eval_version')})")
    if (b := num("bytes")) is not None:
        d = num("density")
        parts.append(f"delta {b / 1e3:.1f} kB" + (f" ({100 * d:.2f} % changed)" if d is not None else ""))
    if syncs:
        parts.append(f"sync {syncs[-1] * 1e3:.0f} ms")
    tok = sum(r.tok_s or 0.0 for r in snap.nodes.values())
    if tok:
        parts.append(f"rollouts {tok:.0f} tok/s")
    parts.append(f"results {t.accepted} ok / {sum(t.rejected.values())} rejected")
    parts.append(f"elapsed {_clock(elapsed_s)}" + (f", ETA {_clock(eta_s)}" if eta_s is not None else ""))
    return "  ".join(parts)


def table(snap: Snapshot) -> Any:
    """The nodes as a rich table."""
    from rich.table import Table

    tab = Table(box=None, pad_edge=False, header_style="bold")
    for col, just in (
        ("node", "left"),
        ("version", "right"),
        ("parent", "left"),
        ("in MB", "right"),
        ("results ok/rejected", "right"),
        ("tok/s", "right"),
        ("switch ms", "right"),
        ("", "left"),
    ):
        tab.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, r in sorted(snap.nodes.items()):
        parent = r.parent or "-"
        if r.parent is not None and not r.planned:
            parent += f" (planned {snap.planned.get(name, '?')})"
        work = f"{r.accepted}/{r.rejected}" if r.completions is not None else ""
        tab.add_row(
            name,
            "-" if r.version is None else str(r.version),
            parent,
            f"{r.bytes_in / 1e6:.2f}",
            work,
            f"{r.tok_s:.0f}" if r.tok_s is not None else "",
            f"{r.switch_ms:.1f}" if r.switch_ms else "",
            f"silent {r.age_s:.0f} s" if r.age_s > STATUS_SILENT_S else "",
        )
    return tab


class RunView:
    """See the module docstring. ``total``: the run's steps (None: no end, as `aurora status`)."""

    def __init__(self, total: int | None = None, *, out: IO[str] | None = None, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.total = total
        self.live_mode = self.out.isatty() if live is None else live
        self.t0 = time.monotonic()
        self._first: tuple[float, int] | None = None
        self._last_step: int | None = None
        self._live: Any = None

    def _eta(self, version: int | None) -> float | None:
        if version is None or self.total is None:
            return None
        now = time.monotonic()
        if self._first is None:
            self._first = (now, version)
            return None
        t0, v0 = self._first
        if version <= v0:
            return None
        return (self.total - version) * (now - t0) / (version - v0)

    def message(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.out, flush=True)

    def status(self, snap: Snapshot | None, fallback: str = "") -> None:
        elapsed = time.monotonic() - self.t0
        version = snap.trainer.version if snap is not None else None
        eta = self._eta(version)
        if not self.live_mode:
            if snap is not None and version != self._last_step and snap.step:
                self._last_step = version
                print(step_line(snap, self.total, elapsed, eta), file=self.out, flush=True)
            return
        self._render(snap, fallback, elapsed, eta)

    def _render(self, snap: Snapshot | None, fallback: str, elapsed: float, eta: float | None) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress_bar import ProgressBar
        from rich.text import Text

        if snap is None:
            body: Any = Text(fallback or "waiting for the trainer ...")
        else:
            done = snap.trainer.version or 0
            bar = ProgressBar(total=self.total or max(done, 1), completed=done, width=40)
            progress = Text(
                f" step {done}"
                + (f" of {self.total}" if self.total else "")
                + f"  elapsed {_clock(elapsed)}"
                + (f"  ETA {_clock(eta)}" if eta is not None else "")
            )
            body = Group(Text(step_line(snap, self.total, elapsed, eta)), table(snap), Group(bar, progress))
        if self._live is None:
            self._live = Live(body, console=Console(file=self.out), refresh_per_second=4, transient=False)
            self._live.start()
        else:
            self._live.update(body)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
