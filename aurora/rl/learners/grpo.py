"""`GrpoLearner`: group-relative policy optimisation on fp32 master weights; versions are their bf16 cast.

One step takes ``prompts_per_step`` groups (a prompt and the ``group_size``
samples an engine made for it, each with its behaviour log-probabilities and
the version that made it) and:

1. scores every sample with the task (on the trainer: workers never see answers);
2. normalises rewards within each group, ``A = (r - mean) / (std + eps)``;
   groups whose samples all scored the same carry no signal and are skipped (unless
   ``skip_flat_groups`` is off: then they are trained on with advantage 0, so that a step's
   compute does not depend on the rewards, as `aurora bench rl` needs);
3. minimises the clipped surrogate ``-min(ρA, clip(ρ, 1±ε)A)`` per response token,
   with ``ρ = π_θ / π_behaviour`` against the log-probabilities the engine
   returned, so samples made by an older version (one-step asynchrony) are
   corrected for, plus optionally ``kl_coef`` × the k3 estimate of KL to the
   reference (the weights at version 0);
4. takes ``epochs`` AdamW steps (gradient clipped) on the fp32 master weights and
   returns their bf16 cast: the published weights are exactly what training made.

Version 0 is the model as loaded, after ``warm_start_steps`` of supervised
training on the task's answers (so that a small random model starts with a
reward above zero). Every ``checkpoint_every`` versions the master weights and
the optimiser state are written (atomically) under ``checkpoint_dir``; a
restarted trainer resumes from the newest checkpoint at or before its store's
latest version (versions after it are trained again from there).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file, save_file

from aurora.codec import Weights
from aurora.config.rl import GrpoSpec, ModelSpec
from aurora.errors import ConfigError, LearnerError
from aurora.rl.algos import clip_fraction, clipped_surrogate, group_advantages, k3_kl
from aurora.rl.model import Tokenizer, build_model
from aurora.rl.tasks import Task
from aurora.rl.types import Completion, Prompt

log = structlog.get_logger("aurora.grpo")


Batch = Sequence[tuple[Prompt, Completion]]
_Row = tuple[Sequence[int], Sequence[int], float, Sequence[float]]
"""A training row: prompt tokens, response tokens, advantage, behaviour log-probs."""


@dataclass(slots=True)
class _Scored:
    rewards: list[float]
    correct: list[bool]
    rows: list[_Row]
    train: bool
    """False: a flat group, skipped."""


@dataclass(slots=True)
class _Trained:
    losses: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    clipped: list[float] = field(default_factory=list)
    grad_norm: float | None = 0.0
    """The last finite one (0.0 when nothing was trained)."""
    skipped: int = 0
    """Epochs skipped for a non-finite loss or gradient norm."""
    stepped: int = 0
    """Optimizer steps taken."""


def _mean(xs: list[float], digits: int) -> float | None:
    return round(sum(xs) / len(xs), digits) if xs else None


class GrpoLearner:
    """See the module docstring. Not thread-safe: one caller (the trainer's publisher)."""

    def __init__(self, spec: GrpoSpec, model: ModelSpec, task: Task, *, temperature: float,
                 checkpoint_dir: Path | None = None, chat: bool = False) -> None:  # fmt: skip
        if temperature <= 0:
            raise ConfigError("GRPO needs sampled rollouts: engine.temperature must be > 0", path="engine.temperature")
        self.spec = spec
        self.task = task
        self.chat = chat
        self.temperature = temperature
        self.checkpoint_dir = checkpoint_dir
        self.tok = Tokenizer.for_model(model)
        torch.manual_seed(spec.seed)
        self.model = build_model(model).float().train()
        self.params = dict(self.model.named_parameters())
        self.opt = self._optimizer()
        self.ref: Any = None
        self._published: Weights | None = None
        """The last version returned: a step that trains nothing returns it again (unchanged, same arrays)."""
        self.version = 0
        self.stats: dict[str, Any] = {}
        self.batch_size, self.interval_s, self.group_size, self.seed = (
            spec.prompts_per_step,
            0.0,
            spec.group_size,
            spec.seed,
        )

    def _optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self.model.parameters(), lr=self.spec.lr, betas=self.spec.betas,
                                 weight_decay=self.spec.weight_decay)  # fmt: skip

    # -- versions
    def weights(self) -> Weights:
        """The bf16 cast of the master weights: the next version. Raises `LearnerError` rather than
        return one with a non-finite value."""
        with torch.no_grad():
            cast = {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}
            bad = [n for n, t in cast.items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise LearnerError(f"version {self.version} would hold non-finite values (first in {bad[0]!r}); "
                               "not published")  # fmt: skip
        self._published = Weights.from_tensors(cast)
        return self._published

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids, as workers generate from them and the learner trains on them."""
        return tuple(self.tok.chat(prompt.text) if self.chat else self.tok.encode(prompt.text))

    @property
    def vocab_size(self) -> int:
        """Token ids a result may hold: the model's embedding rows."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def initial(self) -> Weights:
        if self.spec.warm_start_steps:
            self._warm_start()
        self._set_reference()
        self.version = 0
        return self.weights()

    def restore(self, weights: Weights, version: int) -> None:
        """Continue after ``version`` (the store's latest): from the newest checkpoint at or before it,
        else from its weights with a fresh optimiser."""
        ckpt = self._latest_checkpoint(version)
        self._published = None
        if ckpt is None:
            tensors = weights.to_tensors()
            if set(tensors) != set(self.params):
                raise ConfigError("the stored weights do not fit the model (different tensors)", path="model")
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(tensors[n])
            log.warning("learner_restored_without_checkpoint", version=version,
                        detail="master weights from the bf16 version; optimiser state starts afresh")  # fmt: skip
        else:
            v, path = ckpt
            master = load_file(path / "master.safetensors")
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(master[n])
            self.opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
            log.info("learner_restored", checkpoint=v, version=version, retrained_steps=version - v)
        self._set_reference()
        self.version = version

    def _set_reference(self) -> None:
        if self.spec.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    # -- supervised warm start
    def _warm_start(self) -> None:
        spec = self.spec
        opt = torch.optim.AdamW(self.model.parameters(), lr=spec.warm_start_lr)
        prompts = self.task.prompts(spec.seed + 1)
        t0 = time.monotonic()
        for step in range(1, spec.warm_start_steps + 1):
            batch = [next(prompts) for _ in range(spec.warm_start_batch)]
            seqs, starts = [], []
            for p in batch:
                prompt = list(self.tokenize(p))
                starts.append(len(prompt))
                answer = self.tok.hf(p.answer, add_special_tokens=False)["input_ids"]
                seqs.append(prompt + list(answer) + [self.tok.eos_id])
            ids, mask, targets = self._pack(seqs, starts)
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logp * targets).sum() / targets.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0 or step == spec.warm_start_steps:
                log.info("warm_start", step=step, of=spec.warm_start_steps, loss=round(float(loss.detach()), 4),
                         elapsed_s=round(time.monotonic() - t0, 1))  # fmt: skip

    def _pack(self, seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids, attention mask, and a mask over predicted positions (token t+1 is a response token)."""
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        targets = torch.zeros((len(seqs), width - 1))
        for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            targets[i, start - 1 : len(s) - 1] = 1.0
        return ids, mask, targets

    # -- RL step
    def step(self, batch: Batch = ()) -> Weights:
        """Score, normalise within groups, train ``epochs`` AdamW steps, return the next version.

        A step whose loss or gradient norm is not finite changes nothing (counted in the stats as
        ``nonfinite_skipped``); a version with a non-finite value is never returned (`LearnerError`)."""
        t0 = time.monotonic()
        scored = [self._score(prompt, comp) for prompt, comp in batch]
        rows = [row for sc in scored if sc.train for row in sc.rows]
        train = self._train(rows) if rows else _Trained()
        self.version += 1
        rewards = [r for sc in scored for r in sc.rewards]
        n = max(1, len(rewards))
        stale = [self.version - 1 - comp.version for _, comp in batch]
        self.stats = {
            "reward": round(sum(rewards) / n, 4), "accuracy": round(sum(c for sc in scored for c in sc.correct) / n, 4),
            "groups": len(batch), "groups_skipped": sum(not sc.train for sc in scored), "samples": len(rewards),
            "tokens": int(sum(len(s.tokens) for _, c in batch for s in c.samples)),
            "loss": _mean(train.losses, 5), "kl": _mean(train.kls, 6), "clip_frac": _mean(train.clipped, 4),
            "grad_norm": round(train.grad_norm, 4) if train.grad_norm is not None else None,
            "nonfinite_skipped": train.skipped,
            "staleness": round(sum(stale) / len(stale), 3) if stale else None,
            "learn_s": round(time.monotonic() - t0, 4),
        }  # fmt: skip
        if train.skipped:
            log.warning("learner_step_skipped", version=self.version, epochs=train.skipped,
                        why="the loss or the gradient norm was not finite; the weights were left as they were")  # fmt: skip
        if (
            self.checkpoint_dir is not None
            and self.spec.checkpoint_every
            and self.version % self.spec.checkpoint_every == 0
        ):
            self.save_checkpoint(self.version)
        if train.stepped == 0 and self._published is not None:
            return self._published  # nothing trained: the same version, every tensor the very same array
        return self.weights()

    def _score(self, prompt: Prompt, comp: Completion) -> _Scored:
        """Rewards from the tokens the learner trains on (decoded here, never a worker's text), and
        each sample's training row: prompt and response tokens, advantage, behaviour log-probs."""
        scores = [self.task.score(prompt.answer, self.tok.decode(s.tokens)) for s in comp.samples]
        r = torch.tensor([sc.reward for sc in scores])
        adv, std = group_advantages(r)  # all 0 for a flat group
        rows: list[_Row] = [(comp.prompt_tokens, s.tokens, float(a), s.logprobs)
                            for s, a in zip(comp.samples, adv.tolist(), strict=True)]  # fmt: skip
        return _Scored(r.tolist(), [sc.correct for sc in scores], rows, std >= 1e-6 or not self.spec.skip_flat_groups)

    def _train(self, rows: list[_Row]) -> _Trained:
        seqs = [list(pt) + list(st) for pt, st, _, _ in rows]
        starts = [len(pt) for pt, _, _, _ in rows]
        ids, mask, targets = self._pack(seqs, starts)
        old = torch.zeros_like(targets)
        for i, ((_, _, _, lps), start) in enumerate(zip(rows, starts, strict=True)):
            old[i, start - 1 : start - 1 + len(lps)] = torch.tensor(lps)
        adv = torch.tensor([a for _, _, a, _ in rows])[:, None]
        ref_logp = self._logp(self.ref, ids, mask).detach() if self.ref is not None else None
        out = _Trained()
        for _ in range(self.spec.epochs):
            logp = self._logp(self.model, ids, mask)
            loss, ratio = clipped_surrogate(logp, old, adv, targets, self.spec.clip_eps)
            if ref_logp is not None:
                kl = k3_kl(ref_logp, logp, targets)
                loss = loss + self.spec.kl_coef * kl
                out.kls.append(float(kl.detach()))
            self.opt.zero_grad(set_to_none=True)
            if not bool(torch.isfinite(loss)):
                out.skipped += 1
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm))
            if not math.isfinite(norm):
                self.opt.zero_grad(set_to_none=True)
                out.skipped += 1
                continue
            self.opt.step()
            out.stepped += 1
            out.grad_norm = norm
            out.losses.append(float(loss.detach()))
            out.clipped.append(clip_fraction(ratio, targets, self.spec.clip_eps))
        return out

    def _logp(self, model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Log-probability of each next token at the sampling temperature, shape [batch, len-1]."""
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / self.temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    # -- checkpoints
    def save_checkpoint(self, version: int) -> Path:
        assert self.checkpoint_dir is not None
        dest = self.checkpoint_dir / f"v{version:08d}"
        tmp = self.checkpoint_dir / f".tmp-v{version:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({n: p.detach().contiguous() for n, p in self.params.items()}, str(tmp / "master.safetensors"))
        torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps({"version": version, "spec": self.spec.kind}))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)  # a checkpoint is whole or absent
        log.info("checkpoint_saved", version=version, path=str(dest))
        return dest

    def _latest_checkpoint(self, at_most: int) -> tuple[int, Path] | None:
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return None
        found = [(int(p.name[1:]), p) for p in self.checkpoint_dir.glob("v*")
                 if (p / "meta.json").is_file() and p.name[1:].isdigit() and int(p.name[1:]) <= at_most]  # fmt: skip
        return max(found) if found else None
