"""RL tasks with verifiable rewards: the `Task` interface, `ArithmeticTask`, `JsonlTask` (and
`aurora.rl.data.DatasetTask`, a local dataset with a reward of one's choice).

A task yields an endless stream of `Prompt`s (id, text, reference answer), a fixed list of held-out
prompts that the stream never yields (for evaluation), and scores a completion's text against a
prompt's answer. Rewards are computed on the trainer (the coordinator keeps each leased prompt's
answer; workers only ever see the text), so a worker cannot make up its own reward.

Invariants: ``prompts(seed)`` is deterministic for a seed and disjoint from ``heldout()``; `score`
never raises (a reward in [0, 1] and whether the answer is right).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aurora.config.rl import ArithmeticSpec, DatasetSpec, TaskSpec
from aurora.errors import ConfigError
from aurora.rl.data import DatasetTask, cycle_rows
from aurora.rl.rewards import Score
from aurora.rl.types import Prompt

__all__ = ["ArithmeticTask", "JsonlTask", "Score", "Task", "make_task"]


class Task(Protocol):
    @property
    def chat(self) -> bool:
        """Prompts go through the model's chat template."""
        ...

    @property
    def system_prompt(self) -> str | None:
        """With ``chat``: a system turn before each prompt."""
        ...

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of prompts (with answers), deterministic for ``seed``; none held out."""
        ...

    def heldout(self) -> list[Prompt]:
        """The prompts kept out of training, in a fixed order (may be empty)."""
        ...

    def score(self, prompt: Prompt, text: str) -> Score:
        """The reward of completion ``text`` for ``prompt`` (its reference answer); never raises."""
        ...


def held_out(text: str, fraction: float) -> bool:
    """Whether a prompt of this text is held out at ``fraction``: by a hash of the text, so the same
    prompts are held out in every run and whatever the order of a dataset's rows."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return h < fraction * (1 << 64)


def _exact(answer: str, text: str) -> Score:
    """1 for exactly the answer (surrounding whitespace ignored); else partial credit for
    a same-length answer, by the fraction of characters in place (a denser signal for small models)."""
    got = text.strip()
    if got == answer:
        return Score(1.0, True)
    if len(got) == len(answer) and answer:
        return Score(0.5 * sum(a == b for a, b in zip(got, answer, strict=True)) / len(answer), False)
    return Score(0.0, False)


_NUMBER = re.compile(r"-?\d[\d,]*")


def last_number(text: str) -> str | None:
    """The last integer in a reply (thousands separators dropped), as a chat model states its answer."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def same_number(a: str, b: str) -> bool:
    return a.startswith("-") == b.startswith("-") and (a.lstrip("-").lstrip("0") or "0") == (
        b.lstrip("-").lstrip("0") or "0"
    )


def _answered(answer: str, text: str, concise: bool = False) -> Score:
    """A chat reply: 1 when its last number is the answer, else 0. ``concise``: 1 only for a reply that
    is just the number (a trailing full stop allowed), 0.5 for the right number among other words."""
    got = last_number(text)
    if got is None or not same_number(got, answer):
        return Score(0.0, False)
    if concise and not same_number(text.strip().rstrip(".").strip(), answer):
        return Score(0.5, True)
    return Score(1.0, True)


@dataclass(frozen=True, slots=True)
class ArithmeticTask:
    """The sum of ``operands`` numbers uniform in [0, max_operand]: as ``a+b=`` (answer: the whole
    reply, with partial credit), or with ``chat`` as a question in words, the answer read as the
    reply's last number."""

    spec: ArithmeticSpec = field(default_factory=ArithmeticSpec)
    system_prompt: str | None = None

    HELDOUT_MAX = 256
    """`heldout` lists at most this many of the held-out sums (``spec.heldout`` of them, by expression)."""

    @property
    def chat(self) -> bool:
        return self.spec.chat

    def _text(self, xs: list[int]) -> tuple[str, bool]:
        expr = "+".join(map(str, xs))
        ask = "Reply with only the number." if self.spec.concise else "Give the answer as a number."
        return (f"What is {expr}? {ask}" if self.spec.chat else f"{expr}="), held_out(expr, self.spec.heldout)

    def __post_init__(self) -> None:
        m, k = self.spec.max_operand, self.spec.operands
        if (m + 1) ** k <= 4 * self.HELDOUT_MAX and not any(
            not self._text(list(xs))[1] for xs in itertools.product(range(m + 1), repeat=k)
        ):
            raise ConfigError(f"heldout {self.spec.heldout} leaves no sum to train on", path="task.heldout")

    def _draws(self, seed: int) -> Iterator[tuple[str, str, bool]]:
        """Endless seeded draws: (prompt text, answer, held out)."""
        rng = random.Random(seed)
        m, k = self.spec.max_operand, self.spec.operands
        while True:
            xs = [rng.randint(0, m) for _ in range(k)]
            text, out = self._text(xs)
            yield text, str(sum(xs)), out

    def prompts(self, seed: int) -> Iterator[Prompt]:
        ids = itertools.count()
        for text, answer, out in self._draws(seed):
            if not out:
                yield Prompt(next(ids), text, answer)

    def heldout(self) -> list[Prompt]:
        """Up to `HELDOUT_MAX` held-out sums: all of them, in order, when there are few sums; else the
        distinct ones met in a bounded number of draws from a seed of their own."""
        m, k = self.spec.max_operand, self.spec.operands
        if not self.spec.heldout:
            return []
        if (m + 1) ** k <= 4 * self.HELDOUT_MAX:
            rows = [(*self._text(list(xs)), str(sum(xs))) for xs in itertools.product(range(m + 1), repeat=k)]
            kept = [(t, a) for t, out, a in rows if out][: self.HELDOUT_MAX]
        else:
            seen: dict[str, str] = {}
            for text, answer, out in itertools.islice(self._draws(-1), 1000 * self.HELDOUT_MAX):
                if out:
                    seen.setdefault(text, answer)
                    if len(seen) == self.HELDOUT_MAX:
                        break
            kept = list(seen.items())
        return [Prompt(-1 - i, t, a) for i, (t, a) in enumerate(kept)]

    def score(self, prompt: Prompt, text: str) -> Score:
        a = prompt.answer
        return _answered(a, text, self.spec.concise) if self.spec.chat else _exact(a, text)


@dataclass(frozen=True, slots=True)
class JsonlTask:
    """Prompts and answers from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object a line,
    cycled in a seeded order."""

    path: str
    rows: tuple[tuple[str, str], ...]
    chat: bool = False
    """Score the reply's last number (a chat model's answer) instead of the whole reply."""
    system_prompt: str | None = None

    @classmethod
    def load(cls, path: Path, chat: bool = False) -> JsonlTask:
        rows = []
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read the task file {path}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append((str(obj["prompt"]), str(obj["answer"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f'{path}:{n}: expected {{"prompt": ..., "answer": ...}} ({e!r})') from None
        if not rows:
            raise ConfigError(f"{path} holds no prompts")
        return cls(str(path), tuple(rows), chat)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return cycle_rows(self.rows, seed)

    def heldout(self) -> list[Prompt]:
        return []  # every row trains (a dataset task holds some out)

    def score(self, prompt: Prompt, text: str) -> Score:
        return _answered(prompt.answer, text) if self.chat else _exact(prompt.answer, text)


def make_task(spec: TaskSpec) -> Task:
    """The task a topology's ``task:`` section describes (its paths already resolved); raises
    `ConfigError` naming the file, field or function that is wrong."""
    if isinstance(spec, ArithmeticSpec):
        return ArithmeticTask(spec)
    if isinstance(spec, DatasetSpec):
        return DatasetTask.load(spec)
    return JsonlTask.load(Path(spec.path), spec.chat)
