"""A Llama-architecture GGUF file (llama.cpp's format) turned into a Hugging Face model directory.

`convert_gguf(path, out)` writes into the existing, empty directory ``out`` what `transformers` and vLLM
read: ``model.safetensors`` (bf16), ``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (the chat template inside it) and ``special_tokens_map.json``. transformers
reads the config and the tokenizer out of the file's metadata; the tensors are mapped here, with gguf's
own reader and dequantiser (transformers 5 will not ``save_pretrained`` a model it loaded from GGUF).

Invariants:

- Only ``general.architecture == "llama"`` is accepted; another is a `FetchError` before anything is
  written.
- Every tensor in the file becomes exactly one parameter of the model transformers builds from the
  file's config, with that parameter's shape, and every parameter is filled; a missing, extra or
  misshapen tensor is an error (nothing is guessed or left at its initial value). With no
  ``output.weight`` in the file the embeddings are tied: the checkpoint holds ``model.embed_tokens.weight``
  and no ``lm_head.weight``, and the config says ``tie_word_embeddings: true``.
- q and k projections are un-permuted: llama.cpp's converter interleaves their rows for its rotary
  layout (``LlamaModel.permute`` in convert_hf_to_gguf.py); `_unpermute` is its inverse, as in
  transformers' ``LlamaTensorProcessor``.
- Quantised blocks are dequantised to float32 by gguf's reference code, then rounded once to bf16: the
  weights are the quantised model's, not the original checkpoint's.
- ``config.json`` states ``rope_theta`` at the top level as well as in ``rope_parameters``: readers
  written for transformers 4 look only at the former and silently fall back to 10,000. It names its
  ``architectures`` (``LlamaForCausalLM``), which a config made from GGUF metadata lacks and by which
  vLLM and other readers of Hugging Face directories choose the model class.

This module only writes files; fsync and making the directory appear at once are the caller's job
(`aurora.rl.fetch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aurora.errors import FetchError

# GGUF tensor names (ggml docs/gguf.md, "Standardized tensor names") → transformers' Llama names.
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tokenizer_config.json keys that transformers copies in from its loading arguments, not the tokenizer's.
LOADING_KEYS = ("is_local", "local_files_only", "gguf_file")


@dataclass(frozen=True, slots=True, kw_only=True)
class Converted:
    """What `convert_gguf` wrote."""

    parameters: int
    """Parameters in the checkpoint (tied embeddings counted once)."""
    tensors: int
    """Tensors in ``model.safetensors``."""
    tensor_types: tuple[str, ...]
    """The GGUF tensor types that were dequantised (e.g. ``Q4_1``, ``Q8_0``, ``F32``)."""


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise FetchError(f"GGUF tensor {gguf_name!r} has no counterpart in a transformers Llama model")


def _unpermute(w: Any, heads: int) -> Any:
    """The inverse of llama.cpp's q/k row interleaving (rows grouped per head as [pairs, 2] → [2, pairs])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader: Any, config: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    import numpy as np
    import torch
    from gguf import dequantize

    out: dict[str, Any] = {}
    kinds: set[str] = set()
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name in out:
            raise FetchError(f"GGUF tensor {t.name!r} appears twice")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(torch.bfloat16)  # a writable copy
        kinds.add(t.tensor_type.name)
    return out, tuple(sorted(kinds))


def _check_against_model(tensors: dict[str, Any], config: Any) -> None:
    """Every parameter of the model transformers builds from this config is filled, with its shape."""
    import torch
    from transformers import LlamaForCausalLM

    cls: Any = LlamaForCausalLM
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = cls(config)
    want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise FetchError(f"GGUF tensors do not match the Llama model: missing {missing[:3]}, unexpected {extra[:3]}")
    for n, shape in want.items():
        if tuple(tensors[n].shape) != shape:
            raise FetchError(f"GGUF tensor for {n} has shape {tuple(tensors[n].shape)}, the model needs {shape}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_config(config: Any, out: Path) -> None:
    import numpy as np
    import torch
    from transformers import GenerationConfig

    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    path = out / "config.json"
    data = json.loads(path.read_text())
    data.pop("_model_name_or_path", None)  # transformers fills it with the GGUF's general.name
    # what tools that read Hugging Face directories (vLLM among them) pick the model class by;
    # a config made from GGUF metadata has none
    data["architectures"] = ["LlamaForCausalLM"]
    data["rope_theta"] = float(data["rope_parameters"]["rope_theta"])
    data["dtype"] = data["torch_dtype"] = "bfloat16"  # torch_dtype: the key transformers 4 reads
    # GGUF holds float32: 1e-5 is stored as 9.999999747e-06; write the shortest decimal that rounds to it
    data["rms_norm_eps"] = float(str(np.float32(data["rms_norm_eps"])))
    _write_json(path, data)


def _write_tokenizer(gguf_file: Path, reader: Any, config: Any, out: Path) -> None:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=str(gguf_file), local_files_only=True)
    if not tok.chat_template:
        raise FetchError(f"{gguf_file.name} carries no chat template (tokenizer.chat_template)")
    tok.model_max_length = config.max_position_embeddings
    pre = reader.fields.get("tokenizer.ggml.pre")
    if pre is not None and pre.contents() == "smollm":
        # llama.cpp splits SmolLM text into single digits before the GPT-2 regex (LLAMA_VOCAB_PRE_TYPE_SMOLLM
        # in llama-vocab.cpp), as SmolLM2's own tokenizer.json does; transformers 5.19 keeps only the regex.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    tok.save_pretrained(out, save_jinja_files=False)  # the chat template inside tokenizer_config.json
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for k in LOADING_KEYS:
        data.pop(k, None)
    # transformers 5 writes its own class name, TokenizersBackend, which transformers 4 cannot resolve; the
    # old name is an alias of it in 5 (tokenization_utils_tokenizers.py) and what 4 reads tokenizer.json with
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(path, data)
    specials = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    _write_json(out / "special_tokens_map.json", specials)


def convert_gguf(path: Path, out: Path) -> Converted:
    """Write the Hugging Face directory for the Llama GGUF at ``path`` into the empty directory ``out``.

    Raises `FetchError` for a file that is not a Llama GGUF or does not fit the model its config describes.
    """
    import gguf
    from safetensors.torch import save
    from transformers import AutoConfig

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError) as e:  # gguf's parse errors: a bad magic, a short file
        raise FetchError(f"{path}: not a readable GGUF file ({e})") from None
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise FetchError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    config: Any = AutoConfig.from_pretrained(path.parent, gguf_file=str(path), local_files_only=True)
    tensors, kinds = _tensors(reader, config)
    _check_against_model(tensors, config)
    # bytes, then a plain write: a full disk is an OSError, as for every other file here
    (out / "model.safetensors").write_bytes(save(dict(sorted(tensors.items())), metadata={"format": "pt"}))
    _write_config(config, out)
    _write_tokenizer(path, reader, config, out)
    return Converted(parameters=sum(t.numel() for t in tensors.values()), tensors=len(tensors), tensor_types=kinds)
