"""RL tasks with verifiable rewards: the `Task` interface, `ArithmeticTask`, `JsonlTask`.

A task yields an endless stream of `Prompt`s (id, text, reference answer) and
scores a completion's text against a prompt's answer. Rewards are computed
on the trainer (the coordinator keeps each leased prompt's answer; workers
only ever see the text), so a worker cannot make up its own reward.

Invariants: ``prompts(seed)`` is deterministic for a seed; `score` is pure
(a reward in [0, 1] and whether the answer is exactly right).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aurora.config.rl import ArithmeticSpec, TaskSpec
from aurora.errors import ConfigError
from aurora.rl.types import Prompt


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    correct: bool


class Task(Protocol):
    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of prompts (with answers), deterministic for ``seed``."""
        ...

    def score(self, answer: str, text: str) -> Score:
        """The reward of completion ``text`` for a prompt whose reference answer is ``answer``."""
        ...


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


def _same_number(a: str, b: str) -> bool:
    return a.startswith("-") == b.startswith("-") and (a.lstrip("-").lstrip("0") or "0") == (
        b.lstrip("-").lstrip("0") or "0"
    )


def _answered(answer: str, text: str, concise: bool = False) -> Score:
    """A chat reply: 1 when its last number is the answer, else 0. ``concise``: 1 only for a reply that
    is just the number (a trailing full stop allowed), 0.5 for the right number among other words."""
    got = last_number(text)
    if got is None or not _same_number(got, answer):
        return Score(0.0, False)
    if concise and not _same_number(text.strip().rstrip(".").strip(), answer):
        return Score(0.5, True)
    return Score(1.0, True)


@dataclass(frozen=True, slots=True)
class ArithmeticTask:
    """The sum of ``operands`` numbers uniform in [0, max_operand]: as ``a+b=`` (answer: the whole
    reply, with partial credit), or with ``chat`` as a question in words, the answer read as the
    reply's last number."""

    spec: ArithmeticSpec = field(default_factory=ArithmeticSpec)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        m, k = self.spec.max_operand, self.spec.operands
        for i in itertools.count():
            xs = [rng.randint(0, m) for _ in range(k)]
            expr = "+".join(map(str, xs))
            ask = "Reply with only the number." if self.spec.concise else "Give the answer as a number."
            text = f"What is {expr}? {ask}" if self.spec.chat else f"{expr}="
            yield Prompt(i, text, str(sum(xs)))

    def score(self, answer: str, text: str) -> Score:
        return _answered(answer, text, self.spec.concise) if self.spec.chat else _exact(answer, text)


@dataclass(frozen=True, slots=True)
class JsonlTask:
    """Prompts and answers from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object a line,
    cycled in a seeded order."""

    path: str
    rows: tuple[tuple[str, str], ...]
    chat: bool = False
    """Score the reply's last number (a chat model's answer) instead of the whole reply."""

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
        rng = random.Random(seed)
        order = list(range(len(self.rows)))
        ids = itertools.count()
        while True:
            rng.shuffle(order)
            for k in order:
                text, answer = self.rows[k]
                yield Prompt(next(ids), text, answer)

    def score(self, answer: str, text: str) -> Score:
        return _answered(answer, text) if self.chat else _exact(answer, text)


def make_task(spec: TaskSpec) -> Task:
    """The task a topology's ``task:`` section describes (its paths already resolved)."""
    if isinstance(spec, ArithmeticSpec):
        return ArithmeticTask(spec)
    return JsonlTask.load(Path(spec.path), spec.chat)
