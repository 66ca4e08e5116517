"""Raw-bit views of tensors and the per-dtype facts the codec needs.

The codec never looks at values: every tensor is viewed as a flat array of
unsigned integers of the same width (a *bit view*). For floating-point dtypes
it also needs where the exponent field sits, because the base's exponent is
the context that positions are coded in (docs/delta-format.md §4).

Invariant: ``tensor_from_bits(bits_of(t), ...)`` is bit-identical to ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aurora.errors import DeltaFormatError


@dataclass(frozen=True, slots=True)
class DType:
    """What the codec knows about one element type."""

    name: str
    """Canonical name, as in torch without the prefix (``bfloat16``)."""
    code: int
    """Wire code (one byte, stable across format versions)."""
    width: int
    """Bits per element."""
    exp_shift: int
    """Right shift that brings the exponent field down (0 for integers)."""
    exp_mask: int
    """Mask of the exponent field after the shift; 0 means one bucket."""
    torch_dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.width // 8

    @property
    def uint(self) -> type[np.unsignedinteger]:  # type: ignore[type-arg]
        return _UINTS[self.width]

    @property
    def n_buckets(self) -> int:
        return self.exp_mask + 1


_UINTS: dict[int, type[np.unsignedinteger]] = {  # type: ignore[type-arg]
    8: np.uint8,
    16: np.uint16,
    32: np.uint32,
    64: np.uint64,
}

# Exponent fields from IEEE 754 and the OCP FP8 spec: (mantissa bits, exponent bits).
_TABLE: list[tuple[str, int, int, int, int, torch.dtype]] = [
    ("bfloat16", 1, 16, 7, 0xFF, torch.bfloat16),
    ("float16", 2, 16, 10, 0x1F, torch.float16),
    ("float32", 3, 32, 23, 0xFF, torch.float32),
    ("float64", 4, 64, 52, 0x7FF, torch.float64),
    ("float8_e4m3fn", 5, 8, 3, 0xF, torch.float8_e4m3fn),
    ("float8_e5m2", 6, 8, 2, 0x1F, torch.float8_e5m2),
    ("bool", 10, 8, 0, 0, torch.bool),
    ("uint8", 11, 8, 0, 0, torch.uint8),
    ("int8", 12, 8, 0, 0, torch.int8),
    ("int16", 13, 16, 0, 0, torch.int16),
    ("int32", 14, 32, 0, 0, torch.int32),
    ("int64", 15, 64, 0, 0, torch.int64),
    ("uint16", 16, 16, 0, 0, torch.uint16),
    ("uint32", 17, 32, 0, 0, torch.uint32),
    ("uint64", 18, 64, 0, 0, torch.uint64),
]

BY_NAME: dict[str, DType] = {r[0]: DType(r[0], r[1], r[2], r[3], r[4], r[5]) for r in _TABLE}
BY_CODE: dict[int, DType] = {d.code: d for d in BY_NAME.values()}
_BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in BY_NAME.values()}


def dtype_named(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise DeltaFormatError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}") from None


def dtype_of(t: torch.Tensor) -> DType:
    try:
        return _BY_TORCH[t.dtype]
    except KeyError:
        raise DeltaFormatError(f"dtype {t.dtype} is not supported by the delta codec") from None


def bits_of(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer view of a CPU tensor's bits (zero-copy when contiguous)."""
    d = dtype_of(t)
    if t.numel() == 0:
        return np.empty(0, d.uint)
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().view(d.uint)


def tensor_from_bits(bits: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor that shares memory with ``bits``."""
    if bits.size == 0:
        return torch.empty(shape, dtype=dtype.torch_dtype)
    arr = np.ascontiguousarray(bits).view(np.uint8)
    return torch.from_numpy(arr).view(dtype.torch_dtype).reshape(shape)
