"""A training loop of your own on Aurora's network: plain PyTorch, no Aurora learner.

Aurora's trainer node (`aurora.loop.TrainerLoop`) leases prompts to the rollout workers, checks what
they return, and hands this loop each step's accepted groups; the loop computes its own loss (here
REINFORCE with each group's mean reward as the baseline, plus a small supervised term on the task's
reference answers), steps its own optimiser, and publishes the module: the trainer node sends the
new version down the tree as a verified delta.

    python examples/own_loop/train.py [--steps N]
    torchrun --nproc-per-node 2 examples/own_loop/train.py --fsdp     # the model sharded with FSDP2

For the demo it starts the rollout node itself (`aurora node --name rollout-1`); on real machines
the rollouts and relays run `aurora node` on their own hosts, and only this loop runs here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from reinforce import loss
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from aurora.config.topology import load_topology
from aurora.logs import configure
from aurora.loop import Group, TrainerLoop
from aurora.run import ensure_model

HERE = Path(__file__).resolve().parent


def loss_of(model: torch.nn.Module, tok: object, batch: list[Group], sft: float) -> torch.Tensor:
    groups = [
        (list(g.prompt.tokens), [s.tokens for s in g.completion.samples], g.rewards, g.prompt.answer) for g in batch
    ]
    return loss(model, tok, groups, sft)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", type=Path, default=HERE / "topology.yaml")
    p.add_argument("--steps", type=int, default=None, help="versions to publish (default: the topology's run.steps)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sft", type=float, default=0.1, help="weight of the supervised term")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 over the ranks of `torchrun --nproc-per-node N` (gloo on CPU, "
        "NCCL on GPUs); each rank trains on its part of each batch, rank 0 runs the trainer node",
    )
    args = p.parse_args()
    configure("warning")
    rank, ranks = 0, 1
    if args.fsdp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, ranks = dist.get_rank(), dist.get_world_size()
    topo = load_topology(args.topology)
    if rank == 0:
        ensure_model(topo, args.topology, lambda m: print(m, flush=True))  # the tiny model, made if missing
    if args.fsdp:
        dist.barrier()
    assert topo.model is not None
    model_dir = topo.model.resolved(str(args.topology)).directory()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if args.fsdp:  # each decoder layer a unit of its own, then the rest
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    topology = args.topology
    if args.steps is not None:  # the same topology with fewer steps, beside it (a file per rank)
        topology = args.topology.with_name(f".{args.topology.stem}-{args.steps}-{rank}.yaml")
        text = args.topology.read_text().replace(f"run: {{steps: {topo.run.steps}}}", f"run: {{steps: {args.steps}}}")
        topology.write_text(text)
        topo = replace(topo, run=replace(topo.run, steps=args.steps))
    argv = [sys.executable, "-m", "aurora", "--log-level", "warning", "node", "--topology", str(topology)]
    rollout = subprocess.Popen([*argv, "--name", "rollout-1"]) if rank == 0 else None
    try:
        with TrainerLoop(topology, model, tok) as loop:
            for batch in loop.batches():
                mine = batch[rank::ranks]  # FSDP averages the ranks' gradients: the mean over the batch
                loss = loss_of(model, tok, mine, args.sft)
                loss.backward()
                opt.step()
                opt.zero_grad()
                reward = sum(sum(g.rewards) for g in batch) / sum(len(g.rewards) for g in batch)
                lv = float(loss.detach())
                v = loop.publish({"reward": round(reward, 4), "loss": round(lv, 4)})
                if rank == 0:
                    print(f"version {v}: reward {reward:.3f} loss {lv:.3f}", flush=True)
        # leaving the `with` waited (up to a minute) for every node to hold the last version
        if rank == 0:
            synced = ", and every node holds it" if loop.synced() else ""
            print(f"done: version {loop.version} published{synced}" + (f" ({ranks} ranks)" if args.fsdp else ""))
    finally:
        if rollout is not None:
            rollout.terminate()
            rollout.wait()
        if topology != args.topology:
            topology.unlink(missing_ok=True)
        if args.fsdp:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
