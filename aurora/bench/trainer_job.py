"""A sharded GRPO learner's job on fixed work, for `aurora bench trainer` and the tests: run under torch's
launcher (``python -m torch.distributed.run --nproc-per-node N -m aurora.bench.trainer_job ...``) or as
one process.

It builds the GRPO learner (``ranks`` from the launcher's environment), makes version 0 (after a
short warm start), optionally resumes from a checkpoint directory first, then takes ``steps`` RL
steps on batches that depend only on the seed (each prompt's group: half the samples its answer,
half random tokens, so that rewards differ), timing each step and each version's making (the
gather and bf16 cast on the learner, then the codec's encode of the delta against the version
before and its digest, as the trainer's publisher does). Rank 0 writes a JSON report and, with
``--weights``, the last version and the master weights as safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from aurora.codec.encoder import encode
from aurora.config.rl import ArithmeticSpec, GrpoSpec, ModelSpec
from aurora.rl.learners.grpo import GrpoLearner
from aurora.rl.learners.ranks import Ranks
from aurora.rl.tasks import make_task
from aurora.rl.types import Completion, Prompt, Sample
from aurora.runtime.processes import peak_rss_bytes


def batch(learner: GrpoLearner, prompts: Any, rng: random.Random, n: int, group: int, version: int) -> list[Any]:
    out = []
    for _ in range(n):
        p: Prompt = next(prompts)
        ids = list(learner.tokenize(p))
        answer = learner.tok.hf(p.answer, add_special_tokens=False)["input_ids"] + [learner.tok.eos_id]
        samples = []
        for i in range(group):
            toks = list(answer) if i % 2 == 0 else [rng.randrange(learner.vocab_size) for _ in range(len(answer))]
            samples.append(Sample(toks, [-rng.uniform(0.5, 3.0) for _ in toks]))
        out.append((p, Completion(p.id, ids, samples, version)))
    return out


def state_bytes(learner: GrpoLearner) -> int:
    """Bytes this rank holds of the master weights, their gradients and the optimiser's state."""
    total = 0
    for p in learner.model.parameters():
        local = Ranks.local(p)
        total += local.numel() * local.element_size()
        if p.grad is not None:
            g = Ranks.local(p.grad)
            total += g.numel() * g.element_size()
    for state in learner.opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = Ranks.local(v)
                total += local.numel() * local.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--ranks", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--warm-start", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-positions", type=int, default=256)
    ap.add_argument("--checkpoints", type=Path, default=None, help="checkpoint after every step here")
    ap.add_argument("--resume", type=int, default=None, help="resume from this version's checkpoint")
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--weights", type=Path, default=None)
    args = ap.parse_args()

    spec = GrpoSpec(
        group_size=args.group,
        prompts_per_step=args.prompts,
        lr=args.lr,
        warm_start_steps=args.warm_start,
        warm_start_batch=8,
        checkpoint_every=1 if args.checkpoints else 0,
        ranks=args.ranks,
    )
    model = ModelSpec(path=args.model, max_positions=args.max_positions)
    task = make_task(ArithmeticSpec(max_operand=9))
    ranks = Ranks.join(args.ranks)
    learner = GrpoLearner(spec, model, task, temperature=1.0, checkpoint_dir=args.checkpoints, ranks=ranks)
    steps: list[dict[str, float]] = []
    if ranks.rank > 0:
        learner.follow()
        return
    if args.resume is not None:
        learner.restore(learner.weights(), args.resume)  # from its checkpoint (the weights are unused)
    version = learner.initial() if args.resume is None else learner.weights()
    rng = random.Random(1)
    prompts = task.prompts(7)
    for i in range(args.steps):
        work = batch(learner, prompts, rng, args.prompts, args.group, learner.version)
        t0 = time.perf_counter()
        before = version
        version = learner.step(work)
        t1 = time.perf_counter()
        made = learner.weights()  # the version made again, timed on its own: gather, cast
        t2 = time.perf_counter()
        delta = encode(before, made, base_version=i, target_version=i + 1)
        t3 = time.perf_counter()
        made.digest()
        t4 = time.perf_counter()
        steps.append(
            {
                "step_s": t1 - t0,
                "make_version_s": t4 - t1,
                "cast_s": t2 - t1,
                "encode_s": t3 - t2,
                "digest_s": t4 - t3,
                "delta_bytes": float(delta.nbytes),
                "changed": delta.stats.changed / max(1, delta.stats.elements),
            }
        )
    report = {
        "ranks": ranks.size,
        "steps": steps,
        "state_bytes_rank0": state_bytes(learner),
        "peak_rss_bytes_rank0": peak_rss_bytes(os.getpid()),
        "version": learner.version,
    }
    args.report.write_text(json.dumps(report))
    if args.weights is not None:
        master = learner.master()
        save_file({n: t.detach().contiguous() for n, t in master.items()}, str(args.weights))
    learner.ranks.close()


if __name__ == "__main__":
    main()
