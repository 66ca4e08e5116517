"""`ResultJournal`: the trainer's record of the results it acknowledged, so that a restart loses none.

A worker's result is acknowledged when the trainer answers it with an accepting `Verdict`; from then
on the worker forgets it. The learner trains on it later (`WorkPool.take`), so a trainer that dies in
between would lose it. The journal is a JSON-lines file in the trainer's store, appended and fsynced:

* ``{"accepted": ...}`` — a result, with its prompt (the trainer's tokens) and samples, written
  before its verdict leaves;
* ``{"taken": [ids], "at": v}`` — the learner took these results at version ``v`` (to make ``v + 1``);
* ``{"returned": [ids]}`` — results taken and given back untrained (the learner's step failed);
* ``{"dropped": [ids]}`` — results that grew too stale before a take (the pool's rule dropped them);
* ``{"next": n}`` — prompts below id ``n`` are never issued again (the first line after a compaction).

`open` replays it for the version the trainer resumes from (``resumed``): a result taken at ``v <
resumed`` is in a stored version and done; one taken at ``v >= resumed`` made a version that was lost
with the process, so it is pending again, as is every result accepted and not taken. The file is then
rewritten (atomically) as ``next`` and the pending results only; a running trainer compacts it the same
way once it passes `COMPACT_BYTES` (`compact`, with the newest stored version), so it stays about the
size of the pool.

Invariants: a result acknowledged is in the journal (fsynced) before its verdict is sent; after a
restart from version L, every acknowledged result is either in a version ≤ L, dropped by the
staleness rule, or pending again; prompt ids never repeat across restarts (the prompt stream resumes
past every id the journal has seen). A torn last line (a crash mid-append) is ignored; any other
unreadable line is a `StoreError` naming the file and line. Blocking: run off the event loop.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aurora.errors import StoreError
from aurora.rl.types import Completion, Prompt, Sample
from aurora.store.atomic import atomic_writer

JOURNAL = "results.jsonl"
"""The journal's file name in the trainer's store directory."""
COMPACT_BYTES = 64 << 20
"""A journal past this size is compacted at the learner's next take."""


@dataclass(frozen=True, slots=True)
class Replayed:
    """What the journal says a resumed trainer starts with."""

    pending: list[tuple[Prompt, Completion]]
    """Acknowledged results no stored version trained on, in the order they were accepted."""
    next_id: int
    """The first prompt id the resumed trainer may issue."""
    done: int
    """Results the journal held that are in stored versions or were dropped as stale."""
    live_takes: dict[int, list[int]] = field(default_factory=dict)
    """Takes at or past the version replayed for (at -> prompt ids): pending after a restart, still
    taken in a running trainer."""


class ResultJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        """Appends (from the coordinator's and the learner's threads) and compactions, one at a time."""

    @classmethod
    def open(cls, store_dir: Path, resumed: int) -> tuple[ResultJournal, Replayed]:
        """The journal of the store at ``store_dir``, replayed for a trainer at version ``resumed``
        and compacted to what that trainer still needs (every take at or past ``resumed`` made a
        version that was lost: its results are pending again)."""
        j = cls(store_dir / JOURNAL)
        return j, j.compact(resumed, running=False)

    def compact(self, stored: int, *, running: bool = True) -> Replayed:
        """Rewrite the journal (atomically) as what a trainer holding stored version ``stored`` needs:
        the next prompt id and the results no version up to ``stored`` trained on. ``running``: the
        trainer goes on, so a take at or past ``stored`` (its version is being made or published) is
        kept as a take; False (a restart): it is forgotten, its results pending again. Holds the
        journal's lock: no append lands in the file being replaced."""
        with self._lock:
            replayed = self._replay(stored)
            lines: list[dict[str, Any]] = [{"next": replayed.next_id}]
            lines += [{"accepted": _accepted(p, c)} for p, c in replayed.pending]
            if running:
                lines += [{"taken": ids, "at": at} for at, ids in sorted(replayed.live_takes.items())]
            with atomic_writer(self.path) as f:
                f.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode())
        return replayed

    def too_big(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > COMPACT_BYTES

    def replay(self, resumed: int) -> Replayed:
        with self._lock:
            return self._replay(resumed)

    def _replay(self, resumed: int) -> Replayed:
        accepted: dict[int, tuple[Prompt, Completion]] = {}
        taken_at: dict[int, int] = {}
        """Each result's last take (a returned one is not taken)."""
        dropped: set[int] = set()
        next_id = 0
        if not self.path.exists():
            return Replayed([], 0, 0)
        lines = self.path.read_text().splitlines()
        for k, line in enumerate(lines):
            try:
                rec = json.loads(line)
                if "accepted" in rec:
                    p, c = _result(rec["accepted"])
                    accepted[p.id] = (p, c)
                    next_id = max(next_id, p.id + 1)
                elif "taken" in rec:
                    at = int(rec["at"])
                    taken_at.update((int(i), at) for i in rec["taken"])
                elif "returned" in rec:
                    for i in rec["returned"]:
                        taken_at.pop(int(i), None)
                elif "dropped" in rec:
                    dropped.update(int(i) for i in rec["dropped"])
                elif "next" in rec:
                    next_id = max(next_id, int(rec["next"]))
                else:
                    raise ValueError(f"no known record in {sorted(rec)}")
            except (ValueError, KeyError, TypeError) as e:
                if k == len(lines) - 1:
                    break  # torn by a crash mid-append: it was never acknowledged
                raise StoreError(f"{self.path}: line {k + 1} is not a journal record ({e})") from None
        finished = dropped | {i for i, at in taken_at.items() if at < resumed}
        pending = [r for i, r in accepted.items() if i not in finished]
        live: dict[int, list[int]] = {}
        for i, at in taken_at.items():
            if at >= resumed and i in accepted:
                live.setdefault(at, []).append(i)
        return Replayed(pending, next_id, len(accepted) - len(pending), live)

    def accepted(self, prompt: Prompt, completion: Completion) -> None:
        """Record an accepted result (before its verdict is sent)."""
        self._append([{"accepted": _accepted(prompt, completion)}])

    def returned(self, ids: Iterable[int]) -> None:
        """Record that results taken were given back untrained (the learner's step failed)."""
        self._append([{"returned": list(ids)}])

    def taken(self, ids: Iterable[int], at: int, dropped: Iterable[int] = ()) -> None:
        """Record a take at version ``at`` (and the results it dropped as stale)."""
        recs: list[dict[str, Any]] = [{"taken": list(ids), "at": at}]
        if dropped := list(dropped):
            recs.append({"dropped": dropped})
        self._append(recs)

    def _append(self, recs: list[dict[str, Any]]) -> None:
        """Append ``recs`` and fsync them (the file is opened for each append: nothing stays open)."""
        with self._lock, self.path.open("a") as f:
            f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs))
            f.flush()
            os.fsync(f.fileno())


def _accepted(p: Prompt, c: Completion) -> dict[str, Any]:
    return {
        "id": p.id,
        "text": p.text,
        "answer": p.answer,
        "tokens": list(p.tokens),
        "version": c.version,
        "samples": [[s.tokens, s.logprobs, *([[list(x) for x in s.spans]] if s.spans else [])] for s in c.samples],
    }


def _result(r: dict[str, Any]) -> tuple[Prompt, Completion]:
    tokens = [int(t) for t in r["tokens"]]
    p = Prompt(int(r["id"]), str(r["text"]), str(r["answer"]), tuple(tokens))
    samples = [
        Sample(
            [int(t) for t in s[0]],
            [float(x) for x in s[1]],
            [(int(v), int(i)) for v, i in s[2]] if len(s) > 2 else [],
        )
        for s in r["samples"]
    ]
    return p, Completion(p.id, tokens, samples, int(r["version"]))
