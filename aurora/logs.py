"""structlog configuration: the one place it is done.

JSON lines when stderr is not a terminal (machines read them), the console
renderer on a terminal. Actors bind ``node``, ``role``, ``region``, ``actor``
with `structlog.contextvars.bind_contextvars`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import structlog

Format = Literal["auto", "json", "console"]


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is *now* (tests and embedders swap it)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", fmt: Format = "auto") -> None:
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None) -> structlog.types.FilteringBoundLogger:
    log: structlog.types.FilteringBoundLogger = structlog.get_logger(name)
    return log


def read_events(log: Path) -> list[dict[str, Any]]:
    """The JSON events in a node's log file so far (other lines, and a line still being written,
    are skipped; a missing file has none). For `aurora run`'s log files and the benchmarks."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def event_time(e: Mapping[str, Any]) -> float:
    """An event's timestamp (ISO 8601, UTC, as `configure` writes it) as seconds since the epoch."""
    return datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()


class Throttle:
    """At most one log line per key every ``every_s`` seconds, each saying how many were suppressed.

    For what peers can make happen at any rate (malformed messages): the log stays readable and
    bounded. Keys are forgotten oldest first past ``max_keys``, so memory is bounded too."""

    def __init__(self, every_s: float = 5.0, max_keys: int = 1024) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None: stay quiet; else log now, with this many events suppressed since the last line."""
        last, suppressed = self._last.pop(key, (None, 0))
        if last is not None and now - last < self.every_s:
            self._last[key] = (last, suppressed + 1)
            return None
        self._last[key] = (now, 0)
        while len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        return suppressed
