"""GRPO on a real model: the loss moves probability towards better samples, training raises reward,
the published version is the bf16 cast of the master weights, and checkpoints resume exactly."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from aurora.config.rl import (
    ArithmeticSpec,
    EngineSpec,
    EvalSpec,
    GrpoSpec,
    JsonlSpec,
    ModelSpec,
    SyntheticSpec,
    TaskSpec,
    resolve_paths,
)
from aurora.config.strict import convert
from aurora.errors import ConfigError
from aurora.rl.engines import WeightUpdate
from aurora.rl.engines.torch_engine import TorchEngine
from aurora.rl.learners.grpo import GrpoLearner
from aurora.rl.tasks import ArithmeticTask, JsonlTask, make_task
from aurora.rl.types import Prompt

TASK = ArithmeticTask(ArithmeticSpec(max_operand=9))
MODEL = ModelSpec(preset="tiny", seed=0)


def _learner(tmp: Path | None = None, **kw: object) -> GrpoLearner:
    spec = GrpoSpec(**{"group_size": 8, "prompts_per_step": 32, "lr": 1e-3, "warm_start_steps": 70, **kw})  # type: ignore[arg-type]
    return GrpoLearner(spec, MODEL, TASK, temperature=1.0, checkpoint_dir=tmp)


def _response_logp(learner: GrpoLearner, prompt: Sequence[int], response: Sequence[int]) -> float:
    """log P(response | prompt) under the learner's weights at the sampling temperature, as its loss scores it."""
    with torch.no_grad():
        return float(learner._logp(learner.model, learner._pack([[*prompt, *response]], [len(prompt)])).sum())


def _rollouts(engine: TorchEngine, prompts: list[Prompt], version: int, g: int = 8) -> list:  # type: ignore[type-arg]
    return list(zip(prompts, engine.generate(prompts, version, n=g), strict=True))


def test_training_raises_reward_over_its_start_with_a_fixed_seed() -> None:
    torch.manual_seed(0)
    learner = _learner()
    w = learner.initial()
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=5, temperature=1.0, seed=1))
    prompts = TASK.prompts(7)
    accuracy = []
    for v in range(90):
        engine.apply(WeightUpdate(v, w.digest(), w, None))
        w = learner.step(_rollouts(engine, [next(prompts) for _ in range(32)], v))
        accuracy.append(learner.stats["accuracy"])
        assert learner.version == v + 1
    first, last = sum(accuracy[:15]) / 15, sum(accuracy[-15:]) / 15
    assert first > 0.05  # the warm start puts reward above zero
    assert last > first + 0.08, (first, last)


def test_the_published_version_is_the_bf16_cast_of_the_master_weights() -> None:
    learner = _learner(warm_start_steps=0)
    w0 = learner.initial()
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=4))
    engine.apply(WeightUpdate(0, w0.digest(), w0, None))
    w1 = learner.step(_rollouts(engine, [next(TASK.prompts(1)) for _ in range(4)], 0))
    for n, p in learner.params.items():
        assert p.dtype == torch.float32
        assert torch.equal(w1.to_tensors()[n].view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))
    assert learner.stats["samples"] == 32


def test_the_loss_moves_probability_from_worse_to_better_samples_of_a_group() -> None:
    learner = _learner(epochs=1)
    w = learner.initial()
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=5, seed=3))
    engine.apply(WeightUpdate(0, w.digest(), w, None))
    batch = _rollouts(engine, [next(TASK.prompts(11)) for _ in range(32)], 0)

    def logp(correct: bool) -> float:
        vals = [
            _response_logp(learner, c.prompt_tokens, s.tokens)
            for p, c in batch
            for s in c.samples
            if TASK.score(p, learner.tok.decode(s.tokens)).correct is correct
        ]
        return sum(vals) / len(vals)

    good, bad = logp(True), logp(False)
    for _ in range(8):
        learner.step(batch)
    assert logp(True) - logp(False) > good - bad + 0.5


@pytest.mark.parametrize("skip", [True, False])
def test_flat_groups_are_skipped_or_trained_on_with_advantage_zero(skip: bool) -> None:
    """Greedy samples of a prompt are all the same, so every group is flat: skipped by default;
    with ``skip_flat_groups: false`` the step still does its forward and backward (loss 0)."""
    learner = _learner(warm_start_steps=0, skip_flat_groups=skip)
    w0 = learner.initial()
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=4, temperature=0.0))
    engine.apply(WeightUpdate(0, w0.digest(), w0, None))
    w1 = learner.step(_rollouts(engine, [next(TASK.prompts(2)) for _ in range(4)], 0, g=4))
    assert learner.stats["groups_skipped"] == (4 if skip else 0)
    assert learner.stats["loss"] == (None if skip else 0.0)
    assert learner.stats["grad_norm"] == 0.0
    assert w1.digest() == w0.digest()  # no signal, no change (a first AdamW step on zero gradients)


def test_a_checkpoint_resumes_master_weights_and_optimiser_state_exactly(tmp_path: Path) -> None:
    a = _learner(tmp_path, warm_start_steps=10, checkpoint_every=2)
    w = a.initial()
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=4))
    prompts = [next(TASK.prompts(5)) for _ in range(8)]
    for v in range(2):
        engine.apply(WeightUpdate(v, w.digest(), w, None))
        w = a.step(_rollouts(engine, prompts, v))
    assert json.loads((tmp_path / "v00000002" / "meta.json").read_text())["version"] == 2
    engine.apply(WeightUpdate(2, w.digest(), w, None))
    batch = _rollouts(engine, prompts, 2)
    b = _learner(tmp_path, warm_start_steps=10, checkpoint_every=2)
    b.restore(w, 2)
    assert b.version == 2
    wa, wb = a.step(batch), b.step(batch)  # the same step from the same state
    assert wa.digest() == wb.digest()


def test_restoring_without_a_checkpoint_starts_from_the_stored_version(tmp_path: Path) -> None:
    a = _learner(warm_start_steps=5)
    w = a.initial()
    b = _learner(tmp_path, warm_start_steps=0)
    b.restore(w, 7)
    assert b.weights().digest() == w.digest()
    assert b.version == 7


def test_bad_hyper_parameters_are_config_errors_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="group_size"):
        GrpoSpec(group_size=1)
    with pytest.raises(ConfigError, match="clip_eps"):
        GrpoSpec(clip_eps=1.5)
    with pytest.raises(ConfigError, match=r"engine\.temperature"):
        GrpoLearner(GrpoSpec(), MODEL, TASK, temperature=0.0)


def test_a_jsonl_task_reads_prompts_and_answers_and_names_a_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "abc reversed:", "answer": "cba"}\n\n{"prompt": "xy reversed:", "answer": "yx"}\n')
    (spec,) = [convert(TaskSpec, {"kind": "jsonl", "path": "data.jsonl"})]  # type: ignore[arg-type]
    task = make_task(resolve_paths(spec, None, SyntheticSpec(), None, str(tmp_path / "topo.yaml"))[0])
    assert isinstance(task, JsonlTask)
    seen = [p for _, p in zip(range(4), task.prompts(0), strict=False)]
    assert sorted({(p.text, p.answer) for p in seen}) == [("abc reversed:", "cba"), ("xy reversed:", "yx")]
    assert [p.id for p in seen] == [0, 1, 2, 3]
    assert task.score(Prompt(0, "abc reversed:", "cba"), " cba").correct
    assert task.score(Prompt(0, "abc reversed:", "cba"), "cbx").reward == pytest.approx(0.5 * 2 / 3)
    f.write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=r"data\.jsonl:1"):
        make_task(JsonlSpec(path=str(f)))
    with pytest.raises(ConfigError, match=r"task\.kind"):
        convert(TaskSpec, {"kind": "poetry"}, path="task")  # type: ignore[arg-type]


def test_shared_parts_run_once_with_the_same_log_probs_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that share a prefix (a chat template's system turn) and groups that share a prompt run those
    parts once; what the loss sees is the same as when every row runs in full."""
    import random

    from aurora.rl.learners import grpo

    learner = _learner(warm_start_steps=0)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 30) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, 30) for _ in range(k)] for k in (0, 3, 5)]
    seqs, starts = [], []
    for p in prompts:
        for _ in range(3):
            seqs.append(p + [rng.randrange(3, 30) for _ in range(rng.randint(1, 7))])
            starts.append(len(p))

    def run(min_shared: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        monkeypatch.setattr(grpo, "MIN_SHARED_PREFIX", min_shared)
        packed = learner._pack(seqs, starts)
        learner.model.zero_grad()
        logp = learner._logp(learner.model, packed) * packed.targets
        logp.sum().backward()  # type: ignore[no-untyped-call]
        grads = torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None])
        return logp.detach(), grads, [st.ids.shape[0] for st in packed.stages]

    whole, g_whole, rows_whole = run(10**9)
    shared, g_shared, rows_shared = run(8)
    assert rows_whole == [9]
    assert rows_shared == [1, 3, 9]  # the prefix once, each prompt once, each sample
    assert torch.allclose(whole, shared, atol=1e-5)
    assert torch.allclose(g_whole, g_shared, rtol=1e-4, atol=1e-6)
    assert _response_logp(learner, seqs[0][: starts[0]], seqs[0][starts[0] :]) == pytest.approx(
        float(whole[0].sum()), abs=1e-4
    )


def test_evaluation_scores_the_versions_greedy_replies_to_held_out_prompts_and_trains_nothing() -> None:
    learner = _learner(eval=EvalSpec(every=2, prompts=8, max_new_tokens=4))
    w0 = learner.initial()
    master = {n: p.detach().clone() for n, p in learner.params.items()}
    figs = learner.evaluate(0)
    assert figs is not None
    assert figs["eval_prompts"] == 8
    assert learner.evaluate(1) is None
    assert all(torch.equal(master[n], p) for n, p in learner.params.items())
    # the same figure as a rollout engine's greedy replies on version 0, scored by the task
    held = TASK.heldout()[:8]
    assert not {p.text for p in held} & {p.text for p in itertools.islice(TASK.prompts(0), 2000)}
    engine = TorchEngine(EngineSpec(model=MODEL, max_new_tokens=4, temperature=0.0))
    engine.apply(WeightUpdate(0, w0.digest(), w0, None))
    correct = [
        TASK.score(p, engine.tok.decode(c.samples[0].tokens)).correct
        for p, c in zip(held, engine.generate(held, 0), strict=True)
    ]
    assert figs["eval_accuracy"] == round(sum(correct) / 8, 4)
    assert figs["eval_accuracy"] > 0  # the warm start answers some sums right
