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


@dataclass(frozen=True, slots=True)
class ArithmeticTask:
    """``a+b=`` → ``a+b`` in decimal, operands uniform in [0, max_operand]."""

    spec: ArithmeticSpec = field(default_factory=ArithmeticSpec)

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        m = self.spec.max_operand
        for i in itertools.count():
            a, b = rng.randint(0, m), rng.randint(0, m)
            yield Prompt(i, f"{a}+{b}=", str(a + b))

    def score(self, answer: str, text: str) -> Score:
        return _exact(answer, text)


@dataclass(frozen=True, slots=True)
class JsonlTask:
    """Prompts and answers from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object a line,
    cycled in a seeded order."""

    path: str
    rows: tuple[tuple[str, str], ...]

    @classmethod
    def load(cls, path: Path) -> JsonlTask:
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
        return cls(str(path), tuple(rows))

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
        return _exact(answer, text)


def make_task(spec: TaskSpec) -> Task:
    """The task a topology's ``task:`` section describes (its paths already resolved)."""
    if isinstance(spec, ArithmeticSpec):
        return ArithmeticTask(spec)
    return JsonlTask.load(Path(spec.path))
