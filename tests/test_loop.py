"""`aurora.loop.TrainerLoop`: a training loop of its own drives a real trainer node.

A loop trains on the batches it gets and publishes; a rollout node (a real process) ends on its last
version, bit-identical to the module's bf16 cast; the loop started again on the same store resumes from
that version with the module's weights set to it. Misuse is a clear error. (The example a user runs,
examples/own_loop, is in tests/test_examples.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aurora.codec import Weights
from aurora.config.rl import ArithmeticSpec, LoopSpec, ModelSpec
from aurora.config.topology import load_topology
from aurora.errors import AuroraError, ConfigError
from aurora.events import VERSION_COMMITTED
from aurora.loop import TrainerLoop
from aurora.rl.learners import make_learner
from aurora.rl.model import build_model, char_tokenizer, init_model_dir
from aurora.rl.tasks import make_task
from tests.helpers import free_ports, log_events, wait_until


def _topology(tmp: Path, steps: int, learner: str = "{kind: loop, prompts_per_step: 4, group_size: 2}") -> Path:
    model = tmp / "model"
    if not model.exists():
        init_model_dir(model)
    path = tmp / "t.yaml"
    path.write_text(f"""
name: loop-test
regions: [{{name: local}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:{free_ports(1)[0]}"}}
  - {{name: rollout-1, role: rollout, region: local, parent: trainer}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
leases: {{ttl_s: 5.0, prompts_per_lease: 4, batch_s: 0.5}}
model: {{path: model}}
task: {{kind: arithmetic, max_operand: 4}}
learner: {learner}
engine: {{kind: torch, max_new_tokens: 3}}
run: {{steps: {steps}}}
""")
    return path


@pytest.fixture
def rollout(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _start_rollout(path: Path, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    argv = [sys.executable, "-m", "aurora", "node", "--topology", str(path), "--name", "rollout-1"]
    with log.open("ab") as err:
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))


def test_a_loop_of_its_own_publishes_versions_that_rollouts_take_and_resumes_from_its_store(
    tmp_path: Path, rollout: list[subprocess.Popen[bytes]]
) -> None:
    path = _topology(tmp_path, steps=3)
    log = tmp_path / "rollout.log"
    _start_rollout(path, rollout, log)
    model = build_model(ModelSpec(path=str(tmp_path / "model"))).float()
    tok = char_tokenizer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    with TrainerLoop(path, model, tok, store=tmp_path / "store") as loop:
        assert loop.version == 0
        for batch in loop.batches():
            assert len(batch) == 4
            assert all(len(g.completion.samples) == 2 == len(g.rewards) == len(g.texts) for g in batch)
            assert all(g.version <= loop.version for g in batch)
            with pytest.raises(AuroraError, match="publish"):
                next(iter(loop.batches()))  # one batch at a time
            loss = sum(p.float().pow(2).mean() for p in model.parameters())  # any loss: weights change
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            opt.zero_grad()
            with pytest.raises(AuroraError, match="stat 'bad': list"):
                loop.publish({"bad": [1]})  # refused before anything changes
            seen.append(loop.publish({"loss": loss.detach(), "note": "mine", "accepted": 7}))
    assert seen == [1, 2, 3]
    assert loop.synced()
    last = Weights.from_tensors({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
    commits = [e for e in log_events(log) if e["event"] == VERSION_COMMITTED]
    assert commits[-1]["version"] == 3
    assert commits[-1]["digest"] == last.digest().hex()[:16]  # what the rollout holds is the module, bit for bit

    # the loop again on the same store, with a fresh module: it resumes at version 3, with its weights
    path.write_text(path.read_text().replace("run: {steps: 3}", "run: {steps: 4}"))
    fresh = build_model(ModelSpec(path=str(tmp_path / "model"))).float()
    with TrainerLoop(path, fresh, tok, store=tmp_path / "store") as again:
        assert again.version == 3
        resumed = Weights.from_tensors({n: p.detach().to(torch.bfloat16) for n, p in fresh.named_parameters()})
        assert resumed.digest() == last.digest()
        for _ in again.batches():
            again.publish()
    assert again.version == 4
    wait_until(lambda: any(e.get("version") == 4 for e in log_events(log) if e["event"] == VERSION_COMMITTED), 30, "v4")


def test_misuse_is_a_clear_error(tmp_path: Path) -> None:
    model = build_model(ModelSpec()).float()
    with pytest.raises(ConfigError, match=r"learner kind 'synthetic'.*kind: loop"):
        TrainerLoop(_topology(tmp_path, 2, "{kind: synthetic}"), model, char_tokenizer())
    loop = TrainerLoop(_topology(tmp_path, 2), model, char_tokenizer())
    with pytest.raises(AuroraError, match="follows a batch"):
        loop.publish()
    with pytest.raises(ConfigError, match="runs inside your own training loop"):
        make_learner(LoopSpec(), model=None, task=make_task(ArithmeticSpec()), temperature=1.0, checkpoint_dir=None)
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "node", "--topology", str(tmp_path / "t.yaml"), "--name", "trainer"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "aurora.loop.TrainerLoop" in r.stderr


def test_a_version_is_a_copy_names_are_checked_and_a_node_that_cannot_start_says_so(tmp_path: Path) -> None:
    path = _topology(tmp_path, 2)
    model = build_model(ModelSpec(path=str(tmp_path / "model")))  # bf16: a cast that copies nothing
    loop = TrainerLoop(path, model, char_tokenizer())
    w = loop._weights()
    digest = w.digest()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what an optimiser step does, in place
    w.forget_digests()
    assert w.digest() == digest  # the version did not move with the module

    wrapped = torch.nn.ModuleDict({"module": model})  # a wrapper's prefix: no rollout could take a version
    with pytest.raises(ConfigError, match=r"not in the model: module\."):
        TrainerLoop(path, wrapped, char_tokenizer())

    import socket

    with socket.socket() as taken:  # the trainer's port, in use: start() says so, and nothing keeps running
        port = int(load_topology(path).trainer.listen.rsplit(":", 1)[1])  # type: ignore[union-attr]
        taken.bind(("127.0.0.1", port))
        taken.listen()
        busy = TrainerLoop(path, model, char_tokenizer())
        with pytest.raises(AuroraError, match="cannot listen"):
            busy.start()
        assert busy._thread is None


@pytest.mark.parametrize(
    ("module", "factory", "error"),
    [
        ("", "nowhere:make", "module 'nowhere' does not load"),
        ("def other(context):\n    return None\n", "mine:make", "mine has no function 'make'"),
        ("def make():\n    return None\n", "mine:make", "must take one LearnerContext"),
        ("def make(context):\n    return object()\n", "mine:make", "lacks batch_size"),
        ("raise SystemExit(3)\n", "mine:make", "does not load: SystemExit"),
    ],
)
def test_a_learner_factory_that_cannot_make_a_learner_is_named(
    tmp_path: Path, module: str, factory: str, error: str
) -> None:
    """``learner: {kind: python, factory: module:function}``: what goes wrong is one clear error naming it."""
    if module:
        (tmp_path / "mine.py").write_text(module)
    path = _topology(tmp_path, 2, f'{{kind: python, factory: "{factory}"}}')
    topo = load_topology(path)
    with pytest.raises(ConfigError, match=error):
        make_learner(topo.learner, model=topo.model, task=make_task(topo.task), temperature=1.0, checkpoint_dir=None)
