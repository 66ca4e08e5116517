"""The examples run as a user would run them: `aurora run` on examples/reverse (a dataset of its own
and a reward function of its own, on the tiny model), with the held-out evaluation in the run's
metrics and TensorBoard files beside them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_ports

ROOT = Path(__file__).resolve().parent.parent


def _here(tmp: Path, steps: int) -> Path:
    shutil.copytree(ROOT / "examples" / "reverse", tmp / "reverse")
    path = tmp / "reverse" / "topology.yaml"
    text = path.read_text()
    text = text.replace("../../runs/models/tiny-0", str(tmp / "models" / "tiny-0"))
    text = text.replace("../../runs/keys/reverse", str(tmp / "keys"))
    ports = iter(free_ports(2))
    text = re.sub(r"127\.0\.0\.1:4720\d", lambda _: f"127.0.0.1:{next(ports)}", text)
    text = text.replace("run: {steps: 60}", f"run: {{steps: {steps}}}").replace("every: 10", "every: 5")
    path.write_text(text)
    return path


@pytest.mark.timeout(600)
def test_the_reverse_example_trains_on_its_dataset_with_its_reward_and_evaluates(tmp_path: Path) -> None:
    steps = 10
    state = tmp_path / "state"
    check = subprocess.run(
        [sys.executable, "-m", "aurora", "topology", "check", str(_here(tmp_path, steps))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    assert "600 rows, 60 held out; reward reward:score" in check.stdout
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "run", str(tmp_path / "reverse" / "topology.yaml"), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [row["version"] for row in rows] == list(range(steps + 1))
    evals = {row["version"]: row["eval_accuracy"] for row in rows if row.get("eval_accuracy") is not None}
    assert sorted(evals) == [0, 5, 10]
    assert all(0 <= a <= 1 for a in evals.values())
    assert all(row["reward_errors"] == 0 and 0 <= row["reward"] <= 1 for row in rows[1:])
    assert "eval accuracy v0" in r.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(state / "trainer" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 5, 10]
    assert [e.step for e in acc.Scalars("train/reward")] == list(range(1, steps + 1))


def test_the_own_loop_example_drives_the_trainer_from_a_plain_pytorch_loop(tmp_path: Path) -> None:
    """examples/own_loop/train.py as a user runs it: its loop gets each step's accepted groups, trains
    with its own loss and optimiser, publishes, and the rollout ends on the last version."""
    shutil.copytree(ROOT / "examples" / "own_loop", tmp_path / "own_loop")
    path = tmp_path / "own_loop" / "topology.yaml"
    text = path.read_text().replace("../../runs/models/tiny-0", str(tmp_path / "models" / "tiny-0"))
    path.write_text(text.replace("127.0.0.1:47210", f"127.0.0.1:{free_ports(1)[0]}"))
    r = subprocess.run(
        [sys.executable, str(tmp_path / "own_loop" / "train.py"), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    versions = [int(m) for m in re.findall(r"^version (\d+): reward", r.stdout, re.M)]
    assert versions == list(range(1, 7))
    assert "done: version 6 published, and every node holds it" in r.stdout
    assert not (tmp_path / "own_loop" / ".topology-6.yaml").exists()


def test_the_own_learner_example_runs_under_aurora_run_as_grpo_would(tmp_path: Path) -> None:
    """examples/own_loop/learner.yaml: a learner of its own, made by its `make` factory and driven by
    `aurora run` through the same interface as the built-in GRPO learner."""
    shutil.copytree(ROOT / "examples" / "own_loop", tmp_path / "own_loop")
    path = tmp_path / "own_loop" / "learner.yaml"
    text = path.read_text().replace("../../runs/models/tiny-0", str(tmp_path / "models" / "tiny-0"))
    text = text.replace("127.0.0.1:47211", f"127.0.0.1:{free_ports(1)[0]}").replace("steps: 20", "steps: 4")
    path.write_text(text)
    state = tmp_path / "state"
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "run", str(path), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [row["version"] for row in rows] == [1, 2, 3, 4]
    assert all(isinstance(row["loss"], float) and 0 <= row["reward"] <= 1 for row in rows)


@pytest.mark.slow
def test_the_own_loop_example_trains_an_fsdp_sharded_module_on_two_ranks(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 train.py --fsdp`: FSDP2 shards the module over two gloo ranks, each
    trains on its part of each batch, rank 0 runs the trainer node and gathers each version whole."""
    shutil.copytree(ROOT / "examples" / "own_loop", tmp_path / "own_loop")
    path = tmp_path / "own_loop" / "topology.yaml"
    text = path.read_text().replace("../../runs/models/tiny-0", str(tmp_path / "models" / "tiny-0"))
    node_port, master_port = free_ports(2)
    path.write_text(text.replace("127.0.0.1:47210", f"127.0.0.1:{node_port}"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(master_port)]
    r = subprocess.run(
        [*argv, str(tmp_path / "own_loop" / "train.py"), "--fsdp", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [int(m) for m in re.findall(r"^version (\d+): reward", r.stdout, re.M)] == [1, 2, 3]
    assert "done: version 3 published, and every node holds it (2 ranks)" in r.stdout
