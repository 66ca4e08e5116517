"""Small causal LMs built locally: a Qwen3-architecture model from a preset, and a character tokenizer.

Nothing is downloaded: `build_model(spec)` makes a `Qwen3ForCausalLM` from a
config and a seeded random initialisation, so every node that builds the same
`ModelSpec` gets the same architecture (the weights themselves come over the
tree). Parameters are bf16 (what the trainer publishes); embeddings are not
tied, so every parameter is its own tensor in a `Weights`.

`CharTokenizer` maps printable ASCII one character per token, after three
specials (pad, bos, eos); it is enough for the synthetic tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aurora.errors import ConfigError

if TYPE_CHECKING:
    import torch

PRESETS: dict[str, dict[str, Any]] = {
    # ~115k parameters: fast enough for many processes on a 2-core machine
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
    # ~4.8M parameters
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 32},
}  # fmt: skip


class CharTokenizer:
    PAD, BOS, EOS = 0, 1, 2
    FIRST = 3

    vocab_size = 128

    def encode(self, text: str) -> list[int]:
        out = [self.BOS]
        for ch in text:
            o = ord(ch)
            if not 32 <= o < 127:
                raise ValueError(f"character {ch!r} is outside printable ASCII")
            out.append(self.FIRST + o - 32)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + i - self.FIRST) for i in ids if self.FIRST <= i < self.FIRST + 95)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    preset: str = "tiny"
    seed: int = 0
    max_positions: int = 256

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r} (presets: {', '.join(PRESETS)})", path="preset")


def build_model(spec: ModelSpec) -> Any:
    """A `Qwen3ForCausalLM` in bf16, initialised from ``spec.seed`` (deterministic)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=CharTokenizer.vocab_size, max_position_embeddings=spec.max_positions,
                      tie_word_embeddings=False, **PRESETS[spec.preset])  # fmt: skip
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(spec.seed)
        model: Any = Qwen3ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def parameters(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters by name (no buffers: those are derived from the config)."""
    return {n: p.detach() for n, p in model.named_parameters()}
