"""Realistic weight versions for benchmarks and tests.

`trained_versions` trains a small causal transformer (built locally from a
config, random init) with AdamW on fp32 master weights on a real next-token
objective and casts to bf16 after every step, exactly as an RL trainer
publishes versions. `synthetic_pair` makes a bf16 pair at a chosen density
with small ULP steps, for sizes the trained model does not reach.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class TinyCausalLM(nn.Module):
    """A small decoder-only transformer (pre-LN, learned positions, tied-free head)."""

    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.emb(x) + self.pos(torch.arange(n))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))  # type: ignore[no-any-return]


def _batch(gen: torch.Generator, vocab: int, batch: int, ctx: int) -> torch.Tensor:
    # Sequences that follow a fixed affine rule mod vocab: learnable, not trivial.
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(ctx)) % vocab


def trained_versions(
    lr: float, steps: int, *, seed: int = 0, dim: int = 256, layers: int = 4, vocab: int = 512
) -> list[dict[str, torch.Tensor]]:
    """``steps + 1`` bf16 state dicts: the init and one per AdamW step."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyCausalLM(vocab=vocab, dim=dim, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def publish() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}

    out = [publish()]
    for _ in range(steps):
        x = _batch(gen, vocab, 16, 64)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(publish())
    return out


def synthetic_pair(
    numel: int, density: float, *, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 N(0, 0.02) weights; a ``density`` fraction moves by +-1..2 ULP (bit-pattern steps)."""
    rng = np.random.default_rng(seed)
    base = (torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)) * 0.02).to(torch.bfloat16)
    bits = base.view(torch.int16).numpy().view(np.uint16).copy()
    k = round(numel * density)
    pos = rng.choice(numel, size=k, replace=False) if k < numel else np.arange(numel)
    steps = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int32), size=k, p=[0.1, 0.4, 0.4, 0.1])
    bits[pos] = (bits[pos].astype(np.int32) + steps).astype(np.uint16)
    target = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return {"w": base}, {"w": target}
