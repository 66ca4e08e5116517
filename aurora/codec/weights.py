"""A weight set as the codec sees it: named flat bit views with dtype and shape.

`Weights` is the one conversion point between torch tensors and the codec's
bit views; everything else in `aurora.codec` works on it. Building one from a
``state_dict`` is zero-copy for contiguous CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from aurora.codec.digest import tensor_digest, version_digest
from aurora.codec.dtypes import DType, bits_of, dtype_of, tensor_from_bits
from aurora.errors import DeltaFormatError


@dataclass(slots=True)
class TensorBits:
    dtype: DType
    shape: tuple[int, ...]
    bits: np.ndarray
    """Flat unsigned view, ``bits.size == prod(shape)``."""

    def digest(self) -> bytes:
        return tensor_digest(self.bits)


class Weights(Mapping[str, TensorBits]):
    """An immutable-by-convention mapping name -> `TensorBits`, iterated in name order."""

    __slots__ = ("_digests", "_items")

    def __init__(self, items: Mapping[str, TensorBits]) -> None:
        self._items = dict(sorted(items.items()))
        self._digests: dict[str, bytes] | None = None

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> Weights:
        out: dict[str, TensorBits] = {}
        for name, t in tensors.items():
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(np.ascontiguousarray(t))
            if not isinstance(t, torch.Tensor):
                raise DeltaFormatError(f"tensor {name!r} is a {type(t).__name__}, not a tensor")
            out[name] = TensorBits(dtype_of(t), tuple(t.shape), bits_of(t))
        return cls(out)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Torch tensors sharing memory with these bits."""
        return {n: tensor_from_bits(tb.bits, tb.dtype, tb.shape) for n, tb in self._items.items()}

    def copy(self) -> Weights:
        return Weights({n: TensorBits(tb.dtype, tb.shape, tb.bits.copy()) for n, tb in self._items.items()})

    def __getitem__(self, name: str) -> TensorBits:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(tb.bits.nbytes for tb in self._items.values())

    def tensor_digests(self) -> dict[str, bytes]:
        """Per-tensor digests; computed once and cached (treat the bits as frozen)."""
        if self._digests is None:
            self._digests = {}
        if len(self._digests) < len(self._items):
            for n, tb in self._items.items():
                if n not in self._digests:
                    self._digests[n] = tb.digest()
        return self._digests

    def forget_digests(self, names: Iterable[str] | None = None) -> None:
        """Call after changing bits in place (``names``: of these tensors only)."""
        if names is None or self._digests is None:
            self._digests = None
            return
        for n in names:
            self._digests.pop(n, None)

    def share_digests(self, other: Weights) -> None:
        """Take ``other``'s digests for every tensor that is the very same array here (a tensor a step
        left alone): proved unchanged without reading a byte of it."""
        theirs = other._digests or {}
        mine = self._digests if self._digests is not None else {}
        for n, tb in self._items.items():
            o = other._items.get(n)
            if n not in mine and n in theirs and o is not None and o.bits is tb.bits:
                mine[n] = theirs[n]
        self._digests = mine

    def digest(self) -> bytes:
        d = self.tensor_digests()
        return version_digest((n, tb.dtype.name, tb.shape, d[n]) for n, tb in self._items.items())
