"""The GRPO learner sharded over ranks (`aurora.rl.learners.ranks`): real torch.distributed jobs (gloo)
started by torch's launcher on the tiny model (`aurora.bench.trainer_job`). Two ranks train as one does
(the same steps on the same work; only the order of gradient sums differs), hold about half the
state each, and write checkpoints that any number of ranks resumes bit for bit; in the slow layer,
an `aurora run` whose trainer has two ranks, one SIGKILLed mid-run: torch's launcher starts the job
again and the trainer resumes from its store and newest checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from aurora.events import TRAINER_RESUMED
from aurora.rl.model import init_model_dir
from tests.helpers import one_rollout_topology


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=3)


def _job(ranks: int, model: Path, out: Path, *extra: str) -> dict[str, Any]:
    """One job of ``ranks`` ranks under torch's launcher; its report (rank 0's)."""
    report = out.with_suffix(".json")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    argv += ["-m", "aurora.bench.trainer_job", "--model", str(model), "--report", str(report), "--weights", str(out)]
    r = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return dict(json.loads(report.read_text()))


def test_two_ranks_train_as_one_does_on_half_the_state_each(tiny: Path, tmp_path: Path) -> None:
    one = _job(1, tiny, tmp_path / "one.safetensors", "--steps", "3", "--checkpoints", str(tmp_path / "ck1"))
    two = _job(2, tiny, tmp_path / "two.safetensors", "--steps", "3", "--checkpoints", str(tmp_path / "ck2"))
    assert one["version"] == two["version"] == 3
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert set(a) == set(b)
    # the same training; the ranks' gradients are summed in another order, so fp32 rounding may differ
    assert max(float((a[n] - b[n]).abs().max()) for n in a) < 1e-4
    same = sum(int((a[n].bfloat16() == b[n].bfloat16()).sum()) for n in a) / sum(t.numel() for t in a.values())
    assert same > 0.99  # the published (bf16) versions: all but a few elements equal
    # weights, gradients and AdamW state: each rank holds its half (the shards are padded to even rows)
    assert two["state_bytes_rank0"] <= 0.55 * one["state_bytes_rank0"]
    # checkpoints of every rank's shards, published whole
    assert sorted(p.name for p in (tmp_path / "ck2").iterdir()) == ["v00000001", "v00000002", "v00000003"]
    meta = json.loads((tmp_path / "ck2" / "v00000003" / "meta.json").read_text())
    assert meta["format"] == "dcp"
    assert meta["ranks"] == 2
    assert len(list((tmp_path / "ck2" / "v00000003").glob("*.distcp"))) == 2

    # a checkpoint resumes, bit for bit, with another number of ranks: two ranks' with one, one's with two
    for ranks, ckpt, want in ((1, "ck2", b), (2, "ck1", a)):
        out = tmp_path / f"resumed{ranks}.safetensors"
        got = _job(ranks, tiny, out, "--steps", "0", "--resume", "3", "--checkpoints", str(tmp_path / ckpt))
        assert got["version"] == 3
        resumed = load_file(out)
        assert all(torch.equal(resumed[n], want[n]) for n in want)

    # with no checkpoint, two ranks resume from the stored (bf16) version rank 0 holds: each takes its shards
    out = tmp_path / "from-version.safetensors"
    _job(2, tiny, out, "--steps", "0", "--resume", "0", "--warm-start", "0")
    stored = load_file(tiny / "model.safetensors")
    resumed = load_file(out)
    assert all(torch.equal(resumed[n], stored[n].float()) for n in resumed)


def test_a_checkpoint_of_another_model_is_refused_with_its_directory(tiny: Path, tmp_path: Path) -> None:
    _job(1, tiny, tmp_path / "one.safetensors", "--steps", "1", "--checkpoints", str(tmp_path / "ck"))
    other = init_model_dir(tmp_path / "small", "small", seed=3)
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "aurora.bench.trainer_job", "--model", str(other), "--report", str(report)]
    r = subprocess.run(
        [*argv, "--steps", "0", "--resume", "1", "--checkpoints", str(tmp_path / "ck"), "--warm-start", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert f"checkpoint {tmp_path / 'ck' / 'v00000001'} does not fit the model" in r.stderr
    assert not report.exists()


LEARNER = """{kind: grpo, group_size: 8, prompts_per_step: 16, lr: 1.0e-3, warm_start_steps: 20, checkpoint_every: 2,
  ranks: 2, restarts: 2, skip_flat_groups: false}"""


def _rank(launcher: psutil.Process, rank: int) -> psutil.Process | None:
    for p in launcher.children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skip(
    reason="not reliable yet: under CI's load the launcher's restarted gloo job once failed to form its mesh "
    "(connection refused between the new ranks) and the next attempt hung; it passes on an idle machine"
)
def test_a_rank_killed_mid_run_restarts_the_job_and_the_trainer_resumes(tmp_path: Path) -> None:
    engine = "{kind: torch, max_new_tokens: 5, temperature: 1.0}"
    topo = one_rollout_topology(tmp_path, learner=LEARNER, engine=engine, steps=14)
    state = tmp_path / "state"
    run = subprocess.Popen(
        [sys.executable, "-m", "aurora", "run", str(topo), "--state", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = state / "trainer.log"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until a checkpoint of version 4 is written
            if log.exists() and re.search(r'"version": (4|5|6), [^\n]*"event": "checkpoint_saved"', log.read_text()):
                break
            assert run.poll() is None, run.communicate()[0][-3000:]
            time.sleep(0.5)
        launcher = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if "aurora.rl.learners.launch" in " ".join(p.info["cmdline"] or [])
        )
        victim = _rank(launcher, 1)
        assert victim is not None
        os.kill(victim.pid, signal.SIGKILL)
        out, _ = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, out[-3000:]
    assert "done: every node holds version 14" in out
    text = (state / "trainer.log").read_text()
    assert TRAINER_RESUMED in text  # rank 0 started again: the node resumed from its store
    resumed = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"learner_restored"' in line]
    assert resumed
    assert resumed[-1]["checkpoint"] >= 4  # from its newest checkpoint
