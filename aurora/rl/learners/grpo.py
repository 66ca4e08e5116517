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

import contextlib
import copy
import json
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import structlog
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from aurora.codec import Weights
from aurora.config.rl import GrpoSpec, ModelSpec
from aurora.errors import ConfigError, LearnerError
from aurora.rl.algos import clip_fraction, clipped_surrogate, group_advantages, k3_kl
from aurora.rl.evaluate import Evaluator
from aurora.rl.learners.base import LearnerContext, bf16_weights
from aurora.rl.learners.ranks import Ranks
from aurora.rl.model import Tokenizer, build_model
from aurora.rl.tasks import Task
from aurora.rl.types import Completion, Prompt
from aurora.store.atomic import publish_dir

log = structlog.get_logger("aurora.grpo")


Batch = Sequence[tuple[Prompt, Completion]]
_Row = tuple[Sequence[int], Sequence[int], float, Sequence[float]]
"""A training row: prompt tokens, response tokens, advantage, behaviour log-probs."""


@dataclass(frozen=True, slots=True)
class _Stage:
    """One forward call of a `_Packed` batch: its rows continue rows of the stage before."""

    ids: torch.Tensor
    """[n, W] token ids, left-padded."""
    parents: torch.Tensor | None
    """[n] the row of the stage before that each row continues (None: the first stage)."""
    mask: torch.Tensor
    """[n, columns of this and every earlier stage] 1 for real tokens."""
    pos: torch.Tensor
    """[n, W] position ids."""


@dataclass(frozen=True, slots=True)
class _Packed:
    """A batch of sequences as the model reads it, each shared part run once: the prefix every sequence
    starts with (a chat template's system turn), then each distinct prompt's rest (the G samples of a group
    share it), then each sequence's last prompt token and response. Keys and values of a stage are repeated
    for the rows that continue it; every stage is left-padded, so every response ends in the last column."""

    stages: tuple[_Stage, ...]
    targets: torch.Tensor
    """[batch, R]: 1 where the column's token is a response token the loss counts."""


MIN_SHARED_PREFIX = 8
"""A common prefix shorter than this is not split off (not worth a second forward call)."""


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


def _common_prefix(seqs: list[list[int]], limit: int) -> int:
    """The length of the longest prefix every sequence shares, at most ``limit``."""
    n = 0
    first = seqs[0]
    while n < limit and all(s[n] == first[n] for s in seqs):
        n += 1
    return n


class GrpoLearner:
    """See the module docstring. Not thread-safe: one caller (the trainer's publisher)."""

    def __init__(
        self,
        spec: GrpoSpec,
        model: ModelSpec,
        task: Task,
        *,
        temperature: float,
        checkpoint_dir: Path | None = None,
        chat: bool = False,
        max_new_tokens: int = 16,
        ranks: Ranks | None = None,
    ) -> None:
        if temperature <= 0:
            raise ConfigError("GRPO needs sampled rollouts: engine.temperature must be > 0", path="engine.temperature")
        self.spec = spec
        self.task = task
        self.chat = chat
        self.temperature = temperature
        self.checkpoint_dir = checkpoint_dir
        self.tok = Tokenizer.for_model(model)
        self.ranks = ranks or Ranks.single()
        torch.manual_seed(spec.seed)
        self.model = build_model(model).float().train()
        self.device = self.ranks.device
        """Where the learner computes: a GPU of its own where there is one (then in bf16, the master
        weights fp32), else the CPU."""
        self.model.to(self.device)
        self.ranks.shard(self.model)  # one rank: as built
        self.params = dict(self.model.named_parameters())
        self.opt = self._optimizer()
        self.evaluator = Evaluator(spec.eval, task, model, self.tokenize, max_new_tokens)
        if spec.eval.every and not self.evaluator.prompts:
            log.warning("no_evaluation", why="the task holds no prompts out (learner.eval.every is set)")
        self.ref: Any = None
        self._errors_seen = 0
        self._published: Weights | None = None
        """The last version returned (rank 0): a step that trains nothing returns it again (unchanged,
        same arrays)."""
        self._made = False
        """A version has been made since the start or a restore (on every rank alike)."""
        self.version = 0
        self.stats: dict[str, Any] = {}
        self.batch_size, self.interval_s, self.group_size, self.seed = (
            spec.prompts_per_step,
            0.0,
            spec.group_size,
            spec.seed,
        )

    def _optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            self.model.parameters(), lr=self.spec.lr, betas=self.spec.betas, weight_decay=self.spec.weight_decay
        )

    # -- versions
    def weights(self) -> Weights:
        """The bf16 cast of the master weights: the next version. Raises `LearnerError` rather than
        return one with a non-finite value."""
        with self.ranks.lockstep(LearnerError):
            self.ranks.command("weights")
            return self._weights()

    def master(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights, whole (tests, diagnostics)."""
        with self.ranks.lockstep():
            self.ranks.command("master")
            return {n: t.detach().clone() for n, t in self.ranks.full(self.params).items()}

    def _weights(self) -> Weights:
        """`weights` on every rank at once: the version gathered from every rank's shards onto rank 0,
        tensor by tensor (a follower returns the last version it knows of: none)."""
        self._made = True
        full = self.ranks.full(self.params)
        if self.ranks.rank > 0:
            return cast(Weights, self._published)
        self._published = bf16_weights(full, f"version {self.version}")
        return self._published

    def _reward_errors(self) -> int:
        """Reward calls that failed (each scored 0) since the last step, the evaluation's included."""
        total = int(getattr(self.task, "reward_errors", 0))
        new, self._errors_seen = total - self._errors_seen, total
        return new

    def evaluate(self, version: int) -> dict[str, Any] | None:
        """The held-out figures of the current weights (version ``version``) when ``eval.every`` says
        so, else None (`aurora.rl.evaluate`)."""
        if not self.evaluator.due(version) or self._published is None:
            return None
        return self.evaluator.run(self._published, version)

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids, as workers generate from them and the learner trains on them."""
        if self.chat:
            return tuple(self.tok.chat(prompt.text, self.task.system_prompt))
        return tuple(self.tok.encode(prompt.text))

    @property
    def vocab_size(self) -> int:
        """Token ids a result may hold: the model's embedding rows."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def initial(self) -> Weights:
        with self.ranks.lockstep(LearnerError):
            self.ranks.command("initial")
            return self._initial()

    def _initial(self) -> Weights:
        if self.spec.warm_start_steps:
            self._warm_start()
        self._set_reference()
        self.version = 0
        return self._weights()

    def restore(self, weights: Weights, version: int) -> None:
        """Continue after ``version`` (the store's latest): from the newest checkpoint at or before it,
        else from its weights with a fresh optimiser (rank 0 decides; every rank loads)."""
        ckpt = self._latest_checkpoint(version)
        with self.ranks.lockstep():
            self.ranks.command("restore", version, ckpt)
            self._restore(version, ckpt, weights)

    def _restore(self, version: int, ckpt: tuple[int, Path] | None, weights: Weights | None = None) -> None:
        self._published, self._made = None, False
        if ckpt is None:
            tensors = weights.to_tensors() if weights is not None else {}  # rank 0's; a follower's are sent
            if not self.ranks.same(set(tensors) == set(self.params)):
                raise ConfigError("the stored weights do not fit the model (different tensors)", path="model")
            self._load_master(tensors)
            log.warning(
                "learner_restored_without_checkpoint",
                version=version,
                detail="master weights from the bf16 version; optimiser state starts afresh",
            )
        else:
            v, path = ckpt
            if (path / "master.safetensors").is_file():  # a checkpoint of one rank from before DCP
                if self.ranks.size > 1:
                    raise ConfigError(
                        f"{path} is a one-rank checkpoint of an older Aurora: resume it with learner.ranks 1",
                        path="learner.ranks",
                    )
                self._load_master(load_file(path / "master.safetensors"))
                self.opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
            else:
                self._load_checkpoint(path)
            log.info("learner_restored", checkpoint=v, version=version, retrained_steps=version - v)
        self._set_reference()
        self.version = version

    def _load_master(self, tensors: dict[str, torch.Tensor]) -> None:
        """The master weights from whole tensors on rank 0 (each rank takes its shards, sent from rank 0)."""
        if self.ranks.size == 1:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(tensors[n])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {n: t.to(torch.float32) for n, t in tensors.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.model, full, options=options)

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
            mine, weight = self.ranks.share(batch)
            seqs, starts = [], []
            for p in mine:
                prompt = list(self.tokenize(p))
                starts.append(len(prompt))
                answer = self.tok.hf(p.answer, add_special_tokens=False)["input_ids"]
                seqs.append(prompt + list(answer) + [self.tok.eos_id])
            packed = self._pack(seqs, starts)
            logp = self._logp(self.model, packed, temperature=1.0)
            tokens = packed.targets.sum()
            total = self.ranks.sum(float(tokens) * weight)  # the batch's answer tokens, every rank's share
            loss = self._scaled(-(logp * packed.targets).sum() / tokens, float(tokens), weight, total)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            self.ranks.settle(self.model)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            opt.step()
            if step % 50 == 0 or step == spec.warm_start_steps:
                log.info(
                    "warm_start",
                    step=step,
                    of=spec.warm_start_steps,
                    loss=round(self.ranks.sum(float(loss.detach())) / self.ranks.size, 4),
                    elapsed_s=round(time.monotonic() - t0, 1),
                )

    def _scaled(self, loss: torch.Tensor, local: float, weight: float, total: float) -> torch.Tensor:
        """A rank's mean loss over its ``local`` tokens as its part of the step's mean over all ``total``:
        FSDP averages the ranks' gradients, so the part is taken ``size`` times. One rank: ``loss`` itself."""
        if self.ranks.size == 1:
            return loss
        return loss * (weight * self.ranks.size * local / total)

    def _pack(self, seqs: list[list[int]], starts: list[int]) -> _Packed:
        """``seqs`` (``starts[i]``: where sequence i's response begins) as a `_Packed` batch. The last
        stage always holds each sequence's last prompt token, whose logits predict the first response token."""
        n = len(seqs)
        shared = _common_prefix(seqs, min(starts) - 1)
        if shared < MIN_SHARED_PREFIX:
            shared = 0
        prompts = [tuple(s[shared : start - 1]) for s, start in zip(seqs, starts, strict=True)]
        distinct = list(dict.fromkeys(prompts))
        parts: list[tuple[list[list[int]], list[int] | None]] = [([seqs[0][:shared]], None)] if shared else []
        if shared and len(distinct) < n and any(distinct):
            index = {u: i for i, u in enumerate(distinct)}
            parts.append(([list(u) for u in distinct], [0] * len(distinct)))
            parts.append(([s[start - 1 :] for s, start in zip(seqs, starts, strict=True)], [index[u] for u in prompts]))
        else:
            parts.append(([s[shared:] for s in seqs], [0] * n if shared else None))
        stages: list[_Stage] = []
        for rows, parents in parts:
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
            own = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                own[i, width - len(r) :] = 1
            where = torch.tensor(parents) if parents is not None else None
            mask = own if where is None else torch.cat([stages[-1].mask[where], own], dim=1)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] - width :]
            stages.append(_Stage(ids, where, mask, pos))
        keep = max(len(s) - start for s, start in zip(seqs, starts, strict=True))
        targets = torch.zeros((n, keep))
        for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
            targets[i, keep - (len(s) - start) :] = 1.0
        if self.device.type != "cpu":
            d = self.device
            stages = [
                _Stage(st.ids.to(d), None if st.parents is None else st.parents.to(d), st.mask.to(d), st.pos.to(d))
                for st in stages
            ]
            targets = targets.to(d)
        return _Packed(tuple(stages), targets)

    # -- RL step
    def step(self, batch: Batch = ()) -> Weights:
        """Score, normalise within groups, train ``epochs`` AdamW steps, return the next version.

        A step whose loss or gradient norm is not finite changes nothing (counted in the stats as
        ``nonfinite_skipped``); a version with a non-finite value is never returned (`LearnerError`).
        Rank 0 scores; every rank trains on its share of the rows (`aurora.rl.learners.ranks`)."""
        t0 = time.monotonic()
        scored = [self._score(prompt, comp) for prompt, comp in batch]
        score_s = time.monotonic() - t0
        rows = [row for sc in scored if sc.train for row in sc.rows]
        with self.ranks.lockstep(LearnerError):
            self.ranks.command("advance", rows)
            train, version = self._advance(rows)
        rewards = [r for sc in scored for r in sc.rewards]
        n = max(1, len(rewards))
        stale = [self.version - 1 - comp.version for _, comp in batch]
        self.stats = {
            "reward": round(sum(rewards) / n, 4),
            "accuracy": round(sum(c for sc in scored for c in sc.correct) / n, 4),
            "groups": len(batch),
            "groups_skipped": sum(not sc.train for sc in scored),
            "samples": len(rewards),
            "tokens": int(sum(len(s.tokens) for _, c in batch for s in c.samples)),
            "loss": _mean(train.losses, 5),
            "kl": _mean(train.kls, 6),
            "clip_frac": _mean(train.clipped, 4),
            "grad_norm": round(train.grad_norm, 4) if train.grad_norm is not None else None,
            "nonfinite_skipped": train.skipped,
            "staleness": round(sum(stale) / len(stale), 3) if stale else None,
            "reward_errors": self._reward_errors(),
            "score_us": round(1e6 * score_s / n, 1),
            "learn_s": round(time.monotonic() - t0, 4),
        }
        if train.skipped:
            log.warning(
                "learner_step_skipped",
                version=self.version,
                epochs=train.skipped,
                why="the loss or the gradient norm was not finite; the weights were left as they were",
            )
        assert version is not None
        return version

    def _advance(self, rows: list[_Row]) -> tuple[_Trained, Weights | None]:
        """What every rank does for a step: train on its share of ``rows``, count the version, checkpoint
        when one is due, and make the version (the last one again when nothing trained)."""
        train = self._train(rows) if rows else _Trained()
        self.version += 1
        if (
            self.checkpoint_dir is not None
            and self.spec.checkpoint_every
            and self.version % self.spec.checkpoint_every == 0
        ):
            self.save_checkpoint(self.version)
        if train.stepped == 0 and self._made:
            return train, self._published  # nothing trained: the same version, every tensor the very same array
        return train, self._weights()

    def follow(self) -> None:
        """A follower rank (not rank 0): run rank 0's commands until it stops (`Ranks.follow`)."""
        self.ranks.follow(
            {
                "initial": self._initial,
                "restore": lambda version, ckpt: self._restore(version, ckpt),
                "advance": self._advance,
                "weights": self._weights,
                "master": lambda: self.ranks.full(self.params),
            }
        )

    def _score(self, prompt: Prompt, comp: Completion) -> _Scored:
        """Rewards from the tokens the learner trains on (decoded here, never a worker's text), and
        each sample's training row: prompt and response tokens, advantage, behaviour log-probs."""
        scores = [self.task.score(prompt, self.tok.decode(s.tokens)) for s in comp.samples]
        r = torch.tensor([sc.reward for sc in scores])
        adv, std = group_advantages(r)  # all 0 for a flat group
        rows: list[_Row] = [
            (comp.prompt_tokens, s.tokens, float(a), s.logprobs)
            for s, a in zip(comp.samples, adv.tolist(), strict=True)
        ]
        return _Scored(r.tolist(), [sc.correct for sc in scores], rows, std >= 1e-6 or not self.spec.skip_flat_groups)

    def _train(self, rows: list[_Row]) -> _Trained:
        total = float(sum(len(st) for _, st, _, _ in rows))  # the step's response tokens, every rank's
        rows, weight = self.ranks.share(rows)
        seqs = [list(pt) + list(st) for pt, st, _, _ in rows]
        starts = [len(pt) for pt, _, _, _ in rows]
        packed = self._pack(seqs, starts)
        targets = packed.targets
        local = float(targets.sum())
        old = torch.zeros_like(targets)
        for i, (_, _, _, lps) in enumerate(rows):
            old[i, targets.shape[1] - len(lps) :] = torch.tensor(lps)
        adv = torch.tensor([a for _, _, a, _ in rows], device=self.device)[:, None]
        ref_logp = self._logp(self.ref, packed).detach() if self.ref is not None else None
        out = _Trained()
        for _ in range(self.spec.epochs):
            logp = self._logp(self.model, packed)
            loss, ratio = clipped_surrogate(logp, old, adv, targets, self.spec.clip_eps)
            if ref_logp is not None:
                kl = k3_kl(ref_logp, logp, targets)
                loss = loss + self.spec.kl_coef * kl
                out.kls.append(float(kl.detach()))
            loss = self._scaled(loss, local, weight, total)
            self.opt.zero_grad(set_to_none=True)
            if not self.ranks.every(bool(torch.isfinite(loss))):
                self.ranks.settle(self.model)
                out.skipped += 1
                continue
            loss.backward()  # type: ignore[no-untyped-call]
            self.ranks.settle(self.model)
            norm = self.ranks.scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm))
            if not math.isfinite(norm):
                self.opt.zero_grad(set_to_none=True)
                out.skipped += 1
                continue
            self.opt.step()
            out.stepped += 1
            out.grad_norm = norm
            out.losses.append(self.ranks.sum(float(loss.detach())) / self.ranks.size)
            clipped = clip_fraction(ratio, targets, self.spec.clip_eps)
            out.clipped.append(clipped if self.ranks.size == 1 else self.ranks.sum(clipped * local * weight) / total)
        return out

    def _logp(self, model: Any, p: _Packed, temperature: float | None = None) -> torch.Tensor:
        """Log-probability of each token in the last ``R`` columns at the sampling temperature, [batch, R].
        Each stage but the last runs once for its rows and leaves its keys and values, gathered for the
        rows that continue them (gradients flow back through them); logits are made only for the
        positions that predict response tokens (the LM head over a 49k vocabulary is much of a small
        model's compute; prompts need none)."""
        keep = p.targets.shape[1]
        past = None
        for st in p.stages:
            if past is not None and st.parents is not None:
                past.batch_select_indices(st.parents)
            last = st is p.stages[-1]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):  # GPUs: bf16 compute
                out = model(
                    input_ids=st.ids,
                    attention_mask=st.mask,
                    position_ids=st.pos,
                    past_key_values=past,
                    use_cache=not last or past is not None,
                    logits_to_keep=keep + 1 if last else 1,
                )
            past = out.past_key_values
        logits = out.logits[:, :-1].float() / (self.temperature if temperature is None else temperature)
        return torch.log_softmax(logits, -1).gather(-1, p.stages[-1].ids[:, -keep:, None])[..., 0]

    # -- checkpoints
    def save_checkpoint(self, version: int) -> Path:
        """Master weights and optimiser state, sharded (``torch.distributed.checkpoint``: each rank
        writes its shards, readable by any number of ranks). Every rank calls this at once; rank 0
        makes the directory and publishes it whole."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.checkpoint_dir is not None
        dest = self.checkpoint_dir / f"v{version:08d}"
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        if self.ranks.rank > 0:
            dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=self.ranks.same(None))
            return dest
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # whole or not there, and one of this version (from a trainer's earlier life) is swapped out, never
        # deleted first: a crash at any point leaves a checkpoint to resume from
        with publish_dir(dest, replace=True) as tmp:
            self.ranks.same(str(tmp))
            with _one_process():
                dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=self.ranks.size == 1)
            meta = {"version": version, "spec": self.spec.kind, "format": "dcp", "ranks": self.ranks.size}
            (tmp / "meta.json").write_text(json.dumps(meta))
        log.info("checkpoint_saved", version=version, path=str(dest), ranks=self.ranks.size)
        return dest

    def _load_checkpoint(self, path: Path) -> None:
        """A checkpoint `save_checkpoint` wrote, with any number of ranks, into this job's shards."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        try:
            with _one_process():
                dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=self.ranks.size == 1)
        except (CheckpointException, RuntimeError, ValueError, KeyError) as e:  # another model's: names, shapes
            raise ConfigError(f"checkpoint {path} does not fit the model: {e}", path="model") from None
        set_state_dict(self.model, self.opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def _latest_checkpoint(self, at_most: int) -> tuple[int, Path] | None:
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return None
        found = [
            (int(p.name[1:]), p)
            for p in self.checkpoint_dir.glob("v*")
            if (p / "meta.json").is_file() and p.name[1:].isdigit() and int(p.name[1:]) <= at_most
        ]
        return max(found) if found else None


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Around DCP for one rank: it warns, each time, that it was asked to run in one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def make(context: LearnerContext) -> GrpoLearner:
    """The GRPO learner of a ``learner: {kind: grpo}`` section (the factory `make_learner` calls)."""
    return GrpoLearner(
        context.spec,
        context.model or ModelSpec(),
        context.task,
        temperature=context.temperature,
        checkpoint_dir=context.checkpoint_dir,
        chat=context.chat,
        max_new_tokens=context.max_new_tokens,
        ranks=Ranks.join(context.spec.ranks),
    )
