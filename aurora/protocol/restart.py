"""`RestartBudget`: restart intensity as a pure value (OTP ``intensity``/``period``).

Invariant: `allow` returns True at most ``max_restarts`` times within any window
of ``within_s`` seconds; the first refusal is the escalation point.
"""

from __future__ import annotations

from collections import deque


class RestartBudget:
    def __init__(self, *, max_restarts: int, within_s: float) -> None:
        if max_restarts < 0 or within_s <= 0:
            raise ValueError("max_restarts must be >= 0 and within_s > 0")
        self.max_restarts = max_restarts
        self.within_s = within_s
        self._stamps: deque[float] = deque()

    def _trim(self, now: float) -> None:
        while self._stamps and self._stamps[0] <= now - self.within_s:
            self._stamps.popleft()

    def recent(self, now: float) -> int:
        """Restarts counted in the window ending at ``now``."""
        self._trim(now)
        return len(self._stamps)

    def allow(self, now: float) -> bool:
        """Record a restart at ``now`` if the budget allows it; False means escalate."""
        self._trim(now)
        if len(self._stamps) >= self.max_restarts:
            return False
        self._stamps.append(now)
        return True
