"""`DatasetTask`: prompts and answers from a local dataset file, scored by a reward of one's choice.

The file (JSONL/JSON, Parquet or CSV) is read with Hugging Face `datasets` from the local disk only
(offline: nothing is looked up on a hub; its cache is a temporary directory, removed once the rows
are read). The topology names the prompt and answer fields (`aurora.config.rl.DatasetSpec`); every
row's two values are read as text: CSV cells as written (no number or NA conversion), numbers from
JSON or Parquet as Python writes them (a whole float without its ``.0``). A row with an empty prompt
or a missing value is an error naming the row.

Rows are split once into training and held-out ones by *prompt*: the distinct prompt texts with the
smallest hashes are held out, every row of each, so no prompt is on both sides, and the split is the
same in every run and whatever the file's order.

Training prompts cycle through the training rows in a seeded order, epoch after epoch; held-out
prompts are never leased (`heldout`, for `aurora.rl.evaluate`). Loading raises `ConfigError` naming
the file, the field or the reward function that is wrong, before any node starts (``aurora topology
check`` loads it too).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from aurora.config.rl import DatasetSpec
from aurora.errors import ConfigError
from aurora.rl.rewards import GuardedReward, Score, make_reward
from aurora.rl.types import Prompt

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_FILE_BYTES = 4 << 30
"""A larger dataset file is refused before it is read (its rows are held in memory as text)."""


def _format(spec: DatasetSpec) -> str:
    if spec.format != "auto":
        return spec.format
    fmt = FORMATS.get(Path(spec.path).suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"{spec.path}: cannot tell the format from the extension ({', '.join(FORMATS)}); set task.format",
            path="task.format",
        )
    return fmt


def _text(v: object) -> str | None:
    """A cell as text: None stays None; a whole float loses its ``.0`` (JSON readers widen int columns)."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    return str(v)


def read_rows(spec: DatasetSpec) -> list[tuple[str, str]]:
    """The (prompt, answer) text of every row of the dataset file; raises `ConfigError`."""
    path = Path(spec.path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such dataset file", path="task.path")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 30} GiB", path="task.path")
    fmt = _format(spec)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
    import datasets

    datasets.disable_progress_bars()
    # CSV cells as written: pandas would make "007" 7 and "NA" missing
    extra: dict[str, object] = {}
    if fmt == "csv":
        as_text = {spec.prompt_field: str, spec.answer_field: str}
        extra = {"converters": as_text, "keep_default_na": False, "na_filter": False}
    try:
        with tempfile.TemporaryDirectory(prefix="aurora-dataset-") as cache:
            ds = datasets.load_dataset(
                fmt, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache, **extra
            )
            cols = list(ds.column_names)
            for what, name in (("prompt_field", spec.prompt_field), ("answer_field", spec.answer_field)):
                if name not in cols:
                    raise ConfigError(f"{path} has no field {name!r} (fields: {', '.join(cols)})", path=f"task.{what}")
            prompts, answers = ds[spec.prompt_field], ds[spec.answer_field]
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (the readers raise many kinds on a malformed file)
        raise ConfigError(f"{path}: not a readable {fmt} dataset: {e}"[:500], path="task.path") from None
    if not prompts:
        raise ConfigError(f"{path} holds no rows", path="task.path")
    rows = []
    for n, (p, a) in enumerate(zip(map(_text, prompts), map(_text, answers), strict=True)):
        if p is None or a is None:
            which = spec.prompt_field if p is None else spec.answer_field
            raise ConfigError(f"{path}: row {n} has no {which!r}", path="task.path")
        if not p.strip():
            raise ConfigError(f"{path}: row {n} has an empty {spec.prompt_field!r}", path="task.path")
        rows.append((p, a))
    return rows


def _rank(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def split(rows: list[tuple[str, str]], heldout: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training rows, held-out rows): a fraction (< 1) or a count (>= 1) of the distinct prompts, those
    of the smallest hashes, with every row of each; raises `ConfigError` when no prompt would be left
    to train on."""
    distinct = sorted({p for p, _ in rows}, key=lambda t: (_rank(t), t))
    n = len(distinct)
    k = int(heldout) if heldout >= 1 else round(heldout * n)
    if k >= n:
        raise ConfigError(f"holding out {k} of {n} distinct prompts leaves none to train on", path="task.heldout")
    out = set(distinct[:k])
    return [r for r in rows if r[0] not in out], [r for r in rows if r[0] in out]


def cycle_rows(rows: Sequence[tuple[str, str]], seed: int) -> Iterator[Prompt]:
    """Endless prompts from (text, answer) rows: every row once per epoch, in a seeded order, ids 0, 1, ..."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    ids = itertools.count()
    while True:
        rng.shuffle(order)
        for k in order:
            text, answer = rows[k]
            yield Prompt(next(ids), text, answer)


@dataclass(frozen=True)
class DatasetTask:
    """See the module docstring."""

    spec: DatasetSpec
    train: tuple[tuple[str, str], ...]
    held: tuple[tuple[str, str], ...]
    reward: GuardedReward

    @classmethod
    def load(cls, spec: DatasetSpec) -> DatasetTask:
        reward = make_reward(spec.reward, spec.reward_dir, spec.reward_timeout_s)  # checked before the file is read
        train, held = split(read_rows(spec), spec.heldout)
        return cls(spec, tuple(train), tuple(held), reward)

    @property
    def chat(self) -> bool:
        return self.spec.chat

    @property
    def system_prompt(self) -> str | None:
        return self.spec.system_prompt

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return cycle_rows(self.train, seed)

    def heldout(self) -> list[Prompt]:
        return [Prompt(-1 - i, t, a) for i, (t, a) in enumerate(self.held)]

    def score(self, prompt: Prompt, text: str) -> Score:
        return self.reward(prompt.text, text, prompt.answer)

    @property
    def reward_errors(self) -> int:
        """Calls of the reward that raised or returned something not in [0, 1] (each scored 0)."""
        return self.reward.errors

    def describe(self) -> str:
        """One line for ``aurora topology check``."""
        return (
            f"task: {self.spec.path}: {len(self.train) + len(self.held)} rows, {len(self.held)} held out; "
            f"reward {self.spec.reward}"
        )
