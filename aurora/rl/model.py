"""Causal LMs: loaded from a Hugging Face model directory, or built locally from a preset.

A model directory is what `transformers` and vLLM both read: ``config.json``,
``model.safetensors`` (or shards) and a tokenizer. Nothing is downloaded:
`aurora.config.rl.ModelSpec.path` names a directory a user provides (a real Qwen3 checkpoint,
say) or one that `init_model_dir` wrote (``aurora model init``). Without a
path, `build_model` makes the preset's model in memory (tests, load generators).

`init_model_dir` writes a Qwen3-architecture model (seeded random init, bf16,
untied embeddings so every parameter is its own tensor in a `Weights`) and a
character tokenizer: a `tokenizers` BPE with no merges over printable ASCII
plus three specials (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2), saved as a
``tokenizer.json`` that `AutoTokenizer` (and so vLLM) loads.

`Tokenizer` is the small interface the engines and learners use: ``encode``
adds the bos token, ``decode`` drops special tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aurora.config.rl import PRESETS, ModelSpec
from aurora.errors import ConfigError

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 128
SPECIALS = ("<pad>", "<s>", "</s>")

_IMPORT = threading.Lock()


def _transformers() -> Any:
    """`transformers`, imported under a lock: its lazy module is not safe to import from several
    threads at once (engines are built in worker threads; several nodes can share a process)."""
    with _IMPORT:
        import transformers

        for name in (
            "AutoModelForCausalLM",
            "AutoTokenizer",
            "PreTrainedTokenizerFast",
            "Qwen3Config",
            "Qwen3ForCausalLM",
        ):
            getattr(transformers, name)  # resolve the lazy attributes while holding the lock
        return transformers


def _config(preset: str, max_positions: int) -> Any:
    Qwen3Config = _transformers().Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **PRESETS[preset],
    )


def build_model(spec: ModelSpec) -> Any:
    """A `Qwen3ForCausalLM` in bf16: read from ``spec.path``, else the preset initialised from ``spec.seed``."""
    import torch

    tf = _transformers()
    if spec.path is not None:
        model: Any = tf.AutoModelForCausalLM.from_pretrained(spec.directory(), dtype=torch.bfloat16)
        return model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        cls: Any = tf.Qwen3ForCausalLM
        model = cls(_config(spec.preset, spec.max_positions))
    return model.to(torch.bfloat16).eval()


def parameters(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters by name (no buffers: those are derived from the config)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def char_tokenizer() -> Any:
    """The character tokenizer as a `transformers` fast tokenizer (what `init_model_dir` saves)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, processors

    tf = _transformers()

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab |= {chr(c): len(SPECIALS) + c - 32 for c in range(32, 127)}
    unused = {f"<unused{i}>": i for i in range(len(vocab), VOCAB_SIZE)}
    vocab |= unused
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    raw.decoder = decoders.Fuse()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast: Any = tf.PreTrainedTokenizerFast
    return fast(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=list(unused),
    )


class Tokenizer:
    """Text ↔ token ids for engines and learners (a `transformers` tokenizer underneath)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.eos_id = int(hf.eos_token_id)
        self.pad_id = int(hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
        self.bos_id: int | None = None if hf.bos_token_id is None else int(hf.bos_token_id)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @classmethod
    def for_model(cls, spec: ModelSpec) -> Tokenizer:
        if spec.path is None:
            return cls(char_tokenizer())
        return cls(_transformers().AutoTokenizer.from_pretrained(spec.directory()))

    def encode(self, text: str) -> list[int]:
        ids = list(self.hf(text)["input_ids"])
        if self.hf.bos_token_id is not None and (not ids or ids[0] != self.hf.bos_token_id):
            ids.insert(0, int(self.hf.bos_token_id))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def chat(self, text: str, system: str | None = None) -> list[int]:
        """``text`` as one user turn (after a ``system`` turn, if given) through the model's chat template,
        ready for the assistant's reply."""
        if not self.has_chat_template:
            raise ConfigError("this model's tokenizer has no chat template (set task.chat: false)", path="task.chat")
        turns = [{"role": "system", "content": system}] if system is not None else []
        ids = self.hf.apply_chat_template(
            [*turns, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def init_model_dir(path: Path, preset: str = "tiny", seed: int = 0, max_positions: int = 256) -> Path:
    """Write a freshly initialised model and the character tokenizer to ``path`` (refuses a non-empty one)."""
    if path.exists() and any(path.iterdir()):
        raise ConfigError(f"{path} exists and is not empty; give a new directory")
    from aurora.store.atomic import publish_dir  # (the store package loads the codec: only when writing)

    model = build_model(ModelSpec(preset=preset, seed=seed, max_positions=max_positions))
    path.parent.mkdir(parents=True, exist_ok=True)
    with publish_dir(path) as tmp:  # a half-written directory never looks like a model
        model.save_pretrained(tmp)
        char_tokenizer().save_pretrained(tmp)
    return path
