"""Reading and writing Hugging Face-style safetensors checkpoints.

A checkpoint is a ``.safetensors`` file, a sharded ``*.safetensors.index.json``
(``weight_map`` name -> shard file), or a directory holding either. Every
problem a user can cause (missing file, not safetensors, a shard missing, a
tensor in two shards) raises `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from aurora.errors import CheckpointError
from aurora.store.atomic import atomic_path


def _resolve(path: Path) -> tuple[Path, list[Path]]:
    """(what was named, shard files to read)."""
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            return _resolve(index[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: directory holds no *.safetensors file")
        return path, files
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.name.endswith(".index.json"):
        try:
            index_doc = json.loads(path.read_text())
            weight_map = index_doc["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a safetensors index (need a 'weight_map' object): {e}") from None
        return path, [path.parent / s for s in shards]
    return path, [path]


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, on the CPU."""
    named, files = _resolve(Path(path))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{named}: shard {f.name} is missing")
        try:
            part = load_file(str(f), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        for k, v in part.items():
            if k in out:
                raise CheckpointError(f"{named}: tensor {k!r} appears in more than one shard")
            out[k] = v
    if not out:
        raise CheckpointError(f"{named}: checkpoint holds no tensors")
    return out


def save_checkpoint(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str] | None = None
) -> None:
    """Write one safetensors file atomically (`aurora.store.atomic`: whole or not at all)."""
    p = Path(path)
    try:
        with atomic_path(p) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot write checkpoint: {e.strerror}") from None
