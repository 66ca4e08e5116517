"""A training loop of your own on Aurora's network: plain PyTorch, no Aurora learner.

Aurora's trainer node (`aurora.loop.TrainerLoop`) leases prompts to the rollout workers, checks what
they return, and hands this loop each step's accepted groups; the loop computes its own loss (here
REINFORCE with each group's mean reward as the baseline, plus a small supervised term on the task's
reference answers), steps its own optimiser, and publishes the module: the trainer node sends the
new version down the tree as a verified delta.

    python examples/own_loop/train.py [--steps N]

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
from reinforce import loss
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
    args = p.parse_args()
    configure("warning")
    topo = load_topology(args.topology)
    ensure_model(topo, args.topology, lambda m: print(m, flush=True))  # the tiny model, made if missing
    assert topo.model is not None
    model_dir = topo.model.resolved(str(args.topology)).directory()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    topology = args.topology
    if args.steps is not None:  # the same topology with fewer steps, beside it
        topology = args.topology.with_name(f".{args.topology.stem}-{args.steps}.yaml")
        text = args.topology.read_text().replace(f"run: {{steps: {topo.run.steps}}}", f"run: {{steps: {args.steps}}}")
        topology.write_text(text)
        topo = replace(topo, run=replace(topo.run, steps=args.steps))
    rollout = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aurora",
            "--log-level",
            "warning",
            "node",
            "--topology",
            str(topology),
            "--name",
            "rollout-1",
        ]
    )
    try:
        with TrainerLoop(topology, model, tok) as loop:
            for batch in loop.batches():
                loss = loss_of(model, tok, batch, args.sft)
                loss.backward()
                opt.step()
                opt.zero_grad()
                reward = sum(sum(g.rewards) for g in batch) / sum(len(g.rewards) for g in batch)
                lv = float(loss.detach())
                v = loop.publish({"reward": round(reward, 4), "loss": round(lv, 4)})
                print(f"version {v}: reward {reward:.3f} loss {lv:.3f}", flush=True)
        # leaving the `with` waited (up to a minute) for every node to hold the last version
        print(f"done: version {loop.version} published{', and every node holds it' if loop.synced() else ''}")
    finally:
        rollout.terminate()
        rollout.wait()
        if topology != args.topology:
            topology.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
