"""`PoolRoster`: the trainer's count of each elastic pool's members, as a value — who has a place.

A pool member (`aurora.auth.pool`) is a rollout worker not named in the topology; its name is
``POOL.`` and 16 hex digits (`member_pool` reads the pool back). The parent it says hello to checks
its certificate, then asks the trainer for a place (`Join`); the trainer answers from this roster
(`Admitted`), and the parent attaches the member only when it has one.

Rules and invariants (tests/test_roster.py):

* a pool never holds more than its ``max_size`` members: `join` refuses one more, with the reason;
* a member keeps its place while it is heard from (`seen`: its status reports, about once a second,
  and its work messages); one not heard from for ``hold_s`` has left, and its place is free for
  the next — a member killed without a word frees its place within ``hold_s``;
* `join` and `seen` of a member that holds a place only refresh it (a member that re-attaches
  elsewhere takes one place, never two); `seen` of a member without one would give it one while
  there is room, but the trainer calls it only for members that hold one (one that lost its place
  is evicted and must `join` again);
* `remove` takes a member's place away (a revoked one);
* names outside every pool are not members and never get a place.

Pure: ``now`` comes in as an argument; nothing here reads a clock, opens a socket or logs (the
trainer's node and coordinator drive it and log what it returns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MEMBER_HASH_HEX = 16
"""Hex digits of a member's key hash in its name: 64 bits, so no one finds a second key for a name."""


def member_pool(name: str, pools: Mapping[str, object]) -> str | None:
    """The pool ``name`` is a member name of (``POOL.`` and 16 lowercase hex digits), or None."""
    pool, dot, tail = name.rpartition(".")
    if not dot or pool not in pools or not re.fullmatch(f"[0-9a-f]{{{MEMBER_HASH_HEX}}}", tail):
        return None
    return pool


class PoolRoster:
    """Each pool's members and when each was last heard from. ``max_size``: each pool's limit."""

    def __init__(self, max_size: Mapping[str, int], hold_s: float) -> None:
        if hold_s <= 0:
            raise ValueError("hold_s must be positive")
        self.max_size = dict(max_size)
        self.hold_s = hold_s
        self.heard: dict[str, dict[str, float]] = {p: {} for p in self.max_size}
        """Each pool's members, and when each was last heard from."""

    def pool_of(self, name: str) -> str | None:
        return member_pool(name, self.max_size)

    def prune(self, now: float) -> list[str]:
        """Members not heard from for ``hold_s``: they have left (returned; the driver logs them)."""
        gone = []
        for members in self.heard.values():
            for m, at in list(members.items()):
                if now - at > self.hold_s:
                    del members[m]
                    gone.append(m)
        return gone

    def join(self, member: str, now: float) -> str | None:
        """Give ``member`` a place (or refresh the one it holds); the reason it gets none, or None."""
        pool = self.pool_of(member)
        if pool is None:
            return f"{member!r} is no pool's member"
        members = self.heard[pool]
        if member not in members and len(members) >= self.max_size[pool]:
            return f"pool {pool!r} is full ({len(members)} of {self.max_size[pool]} members)"
        members[member] = now
        return None

    def seen(self, member: str, now: float) -> bool:
        """``member`` was heard from: True if it holds a place (kept, or given while there is room)."""
        return self.join(member, now) is None

    def remove(self, member: str) -> None:
        """``member`` has no place any more (it left, or was revoked)."""
        pool = self.pool_of(member)
        if pool is not None:
            self.heard[pool].pop(member, None)

    def holds(self, member: str) -> bool:
        pool = self.pool_of(member)
        return pool is not None and member in self.heard[pool]

    def members(self) -> dict[str, list[str]]:
        """Each pool's members, sorted."""
        return {p: sorted(m) for p, m in self.heard.items()}
