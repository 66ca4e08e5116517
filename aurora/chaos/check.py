"""The history checker of `aurora chaos`: what a cluster's logs must show after any fault schedule.

The history is every node's JSON log, one list of events per life of its process (a restart begins a
new life), as `aurora node --log-level debug` writes them. It verifies:

1. **no prompt accepted twice** — across every life of the trainer (``result_accepted``);
2. **staleness** — every accepted result's version is within ``staleness.max_versions`` of the
   trainer's version then and not ahead of it, and so is every result the learner took
   (``batch_taken``: taken at ``at`` to make ``at + 1``);
3. **order** — every node's versions only move forward within a life: committed versions strictly
   increase from the one it resumed with; the trainer publishes each next version, from the one it
   resumed;
4. **one history of versions** — every version committed or resumed anywhere has the digest the
   trainer published it with (and the trainer never made two different versions of one number);
5. **the end** — every node's last life holds the trainer's last version, with its digest;
6. **nothing acknowledged lost, nothing trained twice** — at each restart of the trainer, every result
   it accepted (or took back at its previous start) and did not train into a version it resumed from,
   nor drop by the staleness rule, is among the results it takes back (``results_restored``), and
   none it trained into such a version is.

Digests in the logs are the weights' digests cut to 64 bits (16 hex digits): equal digests are
bit-identical weights. Pure: events in, `Violation`s out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora.events import (
    BATCH_RETURNED,
    BATCH_TAKEN,
    NODE_RESUMED,
    RESULT_ACCEPTED,
    RESULTS_RESTORED,
    TRAINER_RESUMED,
    VERSION_COMMITTED,
    VERSION_PUBLISHED,
)

Event = Mapping[str, Any]
Lives = Mapping[str, Sequence[Sequence[Event]]]
"""Per node, its lives in order, each its events in order."""


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    node: str
    what: str
    event: Event | None = None
    """The event that shows it (its ``timestamp`` places it in the history), if one does."""


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, rule: str, node: str, what: str, event: Event | None = None) -> None:
        self.violations.append(Violation(rule, node, what, event))


def check(lives: Lives, trainer: str, max_stale: int, steps: int) -> Report:
    """Every rule of the module docstring over the history ``lives``."""
    r = Report()
    digests = _trainer_versions(lives.get(trainer, []), trainer, r)
    _results(lives.get(trainer, []), trainer, max_stale, r)
    for node, node_lives in lives.items():
        _order(node, node_lives, node == trainer, r)
        if node != trainer:
            _same_versions(node, node_lives, digests, r)
    _end(lives, trainer, steps, digests, r)
    r.counts.update(
        nodes=len(lives),
        restarts=sum(len(x) - 1 for x in lives.values()),
        commits=sum(1 for x in lives.values() for life in x for e in life if e.get("event") == VERSION_COMMITTED),
    )
    return r


def _int(e: Event, key: str) -> int | None:
    v = e.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _events(life: Sequence[Event], *names: str) -> Iterator[Event]:
    return (e for e in life if e.get("event") in names)


def _trainer_versions(lives: Sequence[Sequence[Event]], trainer: str, r: Report) -> dict[int, str]:
    """The digest of each version the trainer made or resumed; two different ones for a number are a violation."""
    out: dict[int, str] = {}
    for life in lives:
        for e in _events(life, VERSION_PUBLISHED, TRAINER_RESUMED):
            v, d = _int(e, "version"), e.get("digest")
            if v is None or not isinstance(d, str):
                continue
            if out.setdefault(v, d) != d:
                r.add("one history", trainer, f"the trainer made version {v} twice: digests {out[v]} and {d}", e)
    r.counts["versions"] = len(out)
    return out


def _results(lives: Sequence[Sequence[Event]], trainer: str, max_stale: int, r: Report) -> None:
    seen: dict[int, Event] = {}
    owed: set[int] = set()
    """Results acknowledged and not yet known to be in a stored version or dropped."""
    taken_at: dict[int, int] = {}
    """Since the trainer last started: each result's take (a returned one is not taken)."""
    for k, life in enumerate(lives):
        for e in life:
            ev = e.get("event")
            if ev == RESULTS_RESTORED:
                resumed = next((_int(x, "version") for x in _events(life, TRAINER_RESUMED)), None)
                if resumed is None:
                    continue
                trained = {i for i, at in taken_at.items() if at < resumed}  # in a version it resumed from
                owed -= trained
                back = {i for i in e.get("items", []) if isinstance(i, int)}
                lost = sorted(owed - back)
                if lost:
                    r.add(
                        "nothing acknowledged lost",
                        trainer,
                        f"restart {k} (resumed at version {resumed}) lost {len(lost)} acknowledged result(s): "
                        f"prompts {lost[:10]}",
                        e,
                    )
                twice = sorted(back & trained)
                if twice:
                    r.add(
                        "trained once",
                        trainer,
                        f"restart {k} (resumed at version {resumed}) took back {len(twice)} result(s) already "
                        f"trained into a version it resumed from: prompts {twice[:10]}",
                        e,
                    )
                owed, taken_at = back, {}
            elif ev == RESULT_ACCEPTED:
                item, v, cur = _int(e, "item"), _int(e, "version"), _int(e, "current")
                if item is None or v is None or cur is None:
                    continue
                if item in seen:
                    r.add("accepted once", trainer, f"prompt {item} was accepted twice", e)
                seen[item] = e
                owed.add(item)
                if not 0 <= cur - v <= max_stale:
                    r.add("staleness", trainer, f"prompt {item}'s result of version {v} accepted at {cur}", e)
            elif ev == BATCH_TAKEN:
                at = _int(e, "at")
                if at is None:
                    continue
                taken_at.update((i, at) for i in e.get("items", []) if isinstance(i, int))
                owed.difference_update(i for i in e.get("dropped", []) if isinstance(i, int))
                for v in e.get("versions", []):
                    if isinstance(v, int) and not 0 <= at - v <= max_stale:
                        r.add("staleness", trainer, f"a result of version {v} taken at version {at}", e)
            elif ev == BATCH_RETURNED:
                for i in e.get("items", []):
                    taken_at.pop(i, None)
    r.counts["accepted"] = len(seen)


def _order(node: str, lives: Sequence[Sequence[Event]], is_trainer: bool, r: Report) -> None:
    moves = (VERSION_PUBLISHED,) if is_trainer else (VERSION_COMMITTED,)
    resumes = (TRAINER_RESUMED,) if is_trainer else (NODE_RESUMED,)
    for k, life in enumerate(lives):
        held: int | None = 0 if is_trainer else None
        for e in _events(life, *moves, *resumes):
            v = _int(e, "version")
            if v is None:
                continue
            if e.get("event") in resumes:
                held = v
                continue
            if held is not None and (v != held + 1 if is_trainer else v <= held):
                r.add("order", node, f"life {k}: version {v} after version {held}", e)
            held = v


def _same_versions(node: str, lives: Sequence[Sequence[Event]], digests: Mapping[int, str], r: Report) -> None:
    for life in lives:
        for e in _events(life, VERSION_COMMITTED, NODE_RESUMED):
            v, d = _int(e, "version"), e.get("digest")
            if v is not None and isinstance(d, str) and v in digests and digests[v] != d:
                r.add("one history", node, f"holds version {v} as {d}; the trainer made it as {digests[v]}", e)


def _end(lives: Lives, trainer: str, steps: int, digests: Mapping[int, str], r: Report) -> None:
    want = digests.get(steps)
    if want is None:
        r.add("the end", trainer, f"the trainer never published version {steps}")
        return
    for node, node_lives in lives.items():
        if node == trainer or not node_lives:
            continue
        last: Event | None = None
        for e in _events(node_lives[-1], VERSION_COMMITTED, NODE_RESUMED):
            last = e
        if last is None or _int(last, "version") != steps or last.get("digest") != want:
            held = "nothing" if last is None else f"version {last.get('version')} ({last.get('digest')})"
            r.add("the end", node, f"holds {held} at the end, not version {steps} ({want})", last)
