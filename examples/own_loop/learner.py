"""The same learning as train.py, as a learner `aurora run` drives: `make` is named in learner.yaml
(``learner: {kind: python, factory: learner:make}``), and its object has the `Learner` interface the
built-in GRPO learner has (aurora.rl.learners.base): Aurora calls `step` with each batch of accepted
groups and publishes the weights it returns.

    aurora run examples/own_loop/learner.yaml
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from reinforce import loss
from transformers import AutoModelForCausalLM, AutoTokenizer

from aurora.codec import Weights
from aurora.rl.learners.base import LearnerContext, bf16_weights
from aurora.rl.types import Completion, Prompt


class Reinforce:
    """REINFORCE with a group baseline and a supervised term, on the topology's model."""

    def __init__(self, context: LearnerContext) -> None:
        assert context.model is not None, "the topology names the model"
        directory = context.model.directory()
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.tok = AutoTokenizer.from_pretrained(directory)
        self.task = context.task
        o = context.options
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=float(o.get("lr", 1e-3)))
        self.sft = float(o.get("sft", 0.1))
        self.batch_size = int(o.get("prompts_per_step", 16))
        self.group_size = int(o.get("group_size", 4))
        self.interval_s = 0.0
        self.seed = 0
        self.stats: dict[str, Any] = {}

    def _weights(self) -> Weights:
        return bf16_weights(dict(self.model.named_parameters()), "the model")

    def initial(self) -> Weights:
        return self._weights()

    def step(self, batch: Sequence[tuple[Prompt, Completion]]) -> Weights:
        groups = []
        for prompt, completion in batch:
            samples = [s.tokens for s in completion.samples]
            rewards = [self.task.score(prompt, self.tok.decode(s, skip_special_tokens=True)).reward for s in samples]
            groups.append((list(prompt.tokens), samples, rewards, prompt.answer))
        value = loss(self.model, self.tok, groups, self.sft)
        value.backward()
        self.opt.step()
        self.opt.zero_grad()
        rewards = [r for g in groups for r in g[2]]
        self.stats = {"reward": round(sum(rewards) / len(rewards), 4), "loss": round(float(value.detach()), 4)}
        return self._weights()

    def evaluate(self, version: int) -> dict[str, Any] | None:
        return None

    def restore(self, weights: Weights, version: int) -> None:
        tensors = weights.to_tensors()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(tensors[n].to(p.dtype))

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return tuple(self.tok(prompt.text)["input_ids"])

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)


def make(context: LearnerContext) -> Reinforce:
    return Reinforce(context)
