"""Dataset tasks and their rewards (`aurora.rl.data`, `aurora.rl.rewards`): the three file formats read
with `datasets`, a held-out split that is fixed and never trained on, every built-in reward, a user's
``module:function``, and one clear error naming the file, field or function for each bad input."""

from __future__ import annotations

import itertools
import json
import textwrap
import time
from pathlib import Path

import pytest

from aurora.config.rl import ArithmeticSpec, SyntheticSpec, TaskSpec, resolve_paths
from aurora.config.strict import convert
from aurora.errors import ConfigError
from aurora.rl.data import DatasetTask, split
from aurora.rl.rewards import make_reward
from aurora.rl.tasks import ArithmeticTask, make_task
from aurora.rl.types import Prompt

ROWS = [{"question": f"What is {i} times 3?", "solution": str(3 * i)} for i in range(40)]


def _write(tmp: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        f = tmp / "data.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "csv":
        f = tmp / "data.csv"
        f.write_text("question,solution\n" + "".join(f'"{r["question"]}",{r["solution"]}\n' for r in ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        f = tmp / "data.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), f)
    return f


def _task(tmp: Path, **fields: object) -> DatasetTask:
    raw = {"kind": "dataset", "prompt_field": "question", "answer_field": "solution", **fields}
    spec = convert(TaskSpec, raw, path="task")  # type: ignore[arg-type]
    spec = resolve_paths(spec, None, SyntheticSpec(), None, str(tmp / "topology.yaml"))[0]
    task = make_task(spec)
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_format_reads_the_named_fields_and_holds_out_the_same_rows(tmp_path: Path, fmt: str) -> None:
    f = _write(tmp_path, fmt)
    task = _task(tmp_path, path=f.name, heldout=0.25)
    held = task.heldout()
    assert len(held) == 10
    assert all(p.id < 0 for p in held)
    trained = {p.text for p in itertools.islice(task.prompts(3), 200)}
    assert len(trained) == 30
    assert not trained & {p.text for p in held}
    assert {(p.text, p.answer) for p in held} | {
        (r["question"], r["solution"]) for r in ROWS if r["question"] in trained
    } == {(r["question"], r["solution"]) for r in ROWS}
    # the split depends on the prompts only: the same rows in any order, in every run
    again = split([(r["question"], r["solution"]) for r in reversed(ROWS)], 0.25)[1]
    assert sorted(again) == sorted((p.text, p.answer) for p in held)
    assert task.score(held[0], f" {held[0].answer}\n").correct  # exact: the whole reply, stripped
    assert not task.score(held[0], f"it is {held[0].answer}").correct


def test_a_count_holds_out_that_many_and_a_whole_dataset_is_refused(tmp_path: Path) -> None:
    f = _write(tmp_path, "jsonl")
    assert len(_task(tmp_path, path=f.name, heldout=7).heldout()) == 7
    with pytest.raises(ConfigError, match="leaves none to train on"):
        _task(tmp_path, path=f.name, heldout=40)
    with pytest.raises(ConfigError, match="heldout"):
        _task(tmp_path, path=f.name, heldout=0.7)


def test_bad_files_and_fields_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.jsonl: no such dataset file"):
        _task(tmp_path, path="nope.jsonl")
    f = _write(tmp_path, "jsonl")
    with pytest.raises(ConfigError, match=r"no field 'prompt' \(fields: question, solution\)") as e:
        _task(tmp_path, path=f.name, prompt_field="prompt")
    assert e.value.path == "task.prompt_field"
    c = _write(tmp_path, "csv")
    with pytest.raises(ConfigError, match=r"data\.csv has no field 'answer'"):
        _task(tmp_path, path=c.name, answer_field="answer")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        _task(tmp_path, path="data.txt")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl: not a readable json dataset"):
        _task(tmp_path, path="bad.jsonl")
    with pytest.raises(ConfigError, match="not a reward"):
        _task(tmp_path, path=f.name, reward="fuzzy")
    with pytest.raises(ConfigError, match="system prompt needs chat"):
        _task(tmp_path, path=f.name, system_prompt="Be brief.")


def test_the_built_in_rewards() -> None:
    exact, number, math = (make_reward(r) for r in ("exact", "number", "math"))
    assert exact("p", " 42 \n", "42").correct
    assert not exact("p", "42.", "42").correct
    assert number("p", "so it is 1,234.", "1234").correct
    assert not number("p", "12", "1234").correct
    assert number("p", "-7", "-7").correct
    assert not number("p", "no number", "7").correct
    assert math("p", r"The answer is $\boxed{\frac{1}{2}}$.", "0.5").correct
    assert math("p", r"\boxed{2\sqrt{2}}", r"\sqrt{8}").correct
    assert not math("p", r"\boxed{3}", "4").correct
    assert math("p", "", "4").reward == 0.0


def test_a_users_reward_function_is_imported_checked_and_guarded(tmp_path: Path) -> None:
    (tmp_path / "myreward.py").write_text(
        textwrap.dedent(
            """
            def score(prompt, completion, answer):
                if completion == "boom":
                    raise RuntimeError("boom")
                if completion == "big":
                    return 3.0
                return 1.0 if completion.strip() == answer else 0.25

            def two(prompt, completion):
                return 1.0

            def nan(prompt, completion, answer):
                return float("nan")
            """
        )
    )
    r = make_reward("myreward:score", str(tmp_path))
    assert r("p", "6", "6").correct
    assert r("p", "5", "6").reward == 0.25
    assert r("p", "boom", "6").reward == 0.0
    assert r("p", "big", "6").reward == 0.0
    assert r.errors == 2
    assert make_reward("myreward:nan", str(tmp_path))("p", "x", "y").reward == 0.0
    with pytest.raises(ConfigError, match=r"must take \(prompt, completion, answer\)"):
        make_reward("myreward:two", str(tmp_path))
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        make_reward("myreward:missing", str(tmp_path))
    with pytest.raises(ConfigError, match="module 'nosuchmodule' does not load"):
        make_reward("nosuchmodule:fn", str(tmp_path))
    # through the task: the reward's module is looked for next to the topology file
    f = _write(tmp_path, "jsonl")
    task = _task(tmp_path, path=f.name, reward="myreward:score")
    p = Prompt(0, "q", "6")
    assert task.score(p, "6").correct
    assert task.score(p, "boom").reward == 0.0
    assert task.reward_errors == 1


def test_arithmetic_holds_out_sums_it_never_asks() -> None:
    task = ArithmeticTask(ArithmeticSpec(max_operand=9))
    held = {p.text for p in task.heldout()}
    assert 3 <= len(held) <= 25  # ~10 % of the 100 sums
    asked = {p.text for p in itertools.islice(task.prompts(0), 3000)}
    assert len(asked) == 100 - len(held)
    assert not asked & held
    big = ArithmeticTask(ArithmeticSpec(max_operand=999))
    held_big = big.heldout()
    assert len(held_big) == ArithmeticTask.HELDOUT_MAX == len({p.text for p in held_big})
    assert not {p.text for p in itertools.islice(big.prompts(0), 5000)} & {p.text for p in held_big}
    # between the two (1,089 sums, about 107 held out): a bounded search, not an endless one
    mid = ArithmeticTask(ArithmeticSpec(max_operand=32)).heldout()
    assert 50 < len(mid) < ArithmeticTask.HELDOUT_MAX
    # the fraction is the task's: more of them, or none
    assert 20 < len(ArithmeticTask(ArithmeticSpec(max_operand=9, heldout=0.3)).heldout()) < 45
    assert ArithmeticTask(ArithmeticSpec(max_operand=999, heldout=0)).heldout() == []
    with pytest.raises(ConfigError, match="heldout"):
        ArithmeticSpec(heldout=0.7)


def test_csv_cells_are_read_as_written_and_whole_floats_lose_their_point(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("prompt,answer\n007,1.50\nNA,3\nnan,\n")
    task = _task(tmp_path, path="d.csv", prompt_field="prompt", answer_field="answer", heldout=0)
    assert sorted((p.text, p.answer) for p in itertools.islice(task.prompts(0), 3)) == [
        ("007", "1.50"),
        ("NA", "3"),
        ("nan", ""),
    ]
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": 3}\n{"prompt": "b", "answer": 2.5}\n')
    task = _task(tmp_path, path="d.jsonl", prompt_field="prompt", answer_field="answer", heldout=0)
    assert sorted(p.answer for p in itertools.islice(task.prompts(0), 2)) == ["2.5", "3"]
    (tmp_path / "e.jsonl").write_text('{"prompt": "  ", "answer": 3}\n')
    with pytest.raises(ConfigError, match="row 0 has an empty 'prompt'"):
        _task(tmp_path, path="e.jsonl", prompt_field="prompt", answer_field="answer")


def test_a_prompt_that_repeats_is_held_out_whole_or_not_at_all() -> None:
    rows = [(f"q{i % 5}", f"a{i}") for i in range(10)]
    for k in (1, 2, 3, 4, 0.4):
        train, held = split(rows, k)
        assert not {p for p, _ in train} & {p for p, _ in held}
        assert len(train) + len(held) == 10
        assert len({p for p, _ in held}) == (k if k >= 1 else 2)


def test_a_reward_that_hangs_loops_or_exits_scores_zero_in_bounded_time(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        textwrap.dedent(
            """
            import sys

            def score(prompt, completion, answer):
                if completion == "loop":
                    while True:
                        pass
                if completion == "exit":
                    sys.exit(3)
                if completion == "numpy":
                    import numpy
                    return numpy.float32(0.5)
                return 1.0
            """
        )
    )
    r = make_reward("bad:score", str(tmp_path), timeout_s=1.0)
    assert r("p", "fine", "a").reward == 1.0
    t0 = time.monotonic()
    assert r("p", "loop", "a").reward == 0.0  # its worker is killed after 1 s
    assert time.monotonic() - t0 < 30
    assert r("p", "exit", "a").reward == 0.0
    assert r("p", "numpy", "a").reward == 0.5  # a numpy number is a number
    assert r("p", "fine", "a").correct  # a new worker took over
    assert r.errors == 2
    math = make_reward("math", timeout_s=1.0)
    t0 = time.monotonic()
    assert math("p", r"\boxed{9^{9^{9}}}", "3").reward == 0.0
    assert time.monotonic() - t0 < 60
    assert math("p", r"\boxed{3}", "3").correct


def test_number_compares_decimals_and_fractions_exactly() -> None:
    number = make_reward("number")
    assert number("p", "2.5", "2.5").correct
    assert not number("p", "2.5", "7.5").correct
    assert not number("p", "1/2", "3/2").correct
    assert number("p", "it is 3.0", "3").correct
    assert number("p", "0.5", "1/2").correct
