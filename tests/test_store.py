"""The versioned store: anchors + deltas, atomic commits, pruning, state_dict import/export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aurora.codec import Weights
from aurora.errors import StoreError
from aurora.store import DeltaStore
from tests.helpers import perturb


def _versions(n: int) -> list[Weights]:
    torch.manual_seed(0)
    w = Weights.from_tensors({"a": (torch.randn(5000) * 0.02).to(torch.bfloat16), "b": torch.randn(7, 3)})
    out = [w]
    for i in range(1, n):
        out.append(perturb(out[-1], 0.02, i))
    return out


def test_put_get_anchors_and_deltas(tmp_path: Path) -> None:
    vs = _versions(7)
    s = DeltaStore(tmp_path, anchor_every=3)
    for i, w in enumerate(vs):
        s.put(i, w)
    kinds = [s.info(i).kind for i in range(7)]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta", "anchor"]
    assert s.versions() == list(range(7))
    assert s.latest() == 6
    for i, w in enumerate(vs):
        assert s.get(i).digest() == w.digest()
    # A reopened store reads the same.
    s2 = DeltaStore(tmp_path, anchor_every=99)
    assert s2.anchor_every == 3
    assert s2.get(5).digest() == vs[5].digest()


def test_read_delta_stored_or_composed(tmp_path: Path) -> None:
    from aurora.codec import apply

    vs = _versions(4)
    s = DeltaStore(tmp_path, anchor_every=10)
    for i, w in enumerate(vs):
        s.put(i, w)
    d = s.read_delta(2, 3)
    assert apply(vs[2], d.manifest, d.chunks).digest() == vs[3].digest()
    d = s.read_delta(0, 3)
    assert apply(vs[0], d.manifest, d.chunks).digest() == vs[3].digest()


def test_prune_keeps_what_kept_versions_need(tmp_path: Path) -> None:
    vs = _versions(8)
    s = DeltaStore(tmp_path, anchor_every=4)
    for i, w in enumerate(vs):
        s.put(i, w)
    dropped = s.prune(keep_last=2)  # keeps 6, 7; they need anchor 4 and delta 5
    assert dropped == [0, 1, 2, 3]
    assert s.versions() == [4, 5, 6, 7]
    assert s.get(7).digest() == vs[7].digest()
    assert not list((tmp_path / "anchors").glob("v00000000*"))


def test_bad_puts_change_nothing(tmp_path: Path) -> None:
    vs = _versions(3)
    s = DeltaStore(tmp_path)
    s.put(1, vs[0])
    with pytest.raises(StoreError, match="already stored"):
        s.put(1, vs[1])
    with pytest.raises(StoreError, match="not newer"):
        s.put(0, vs[1])
    with pytest.raises(StoreError, match="not in the store"):
        s.get(5)
    assert s.versions() == [1]


def test_torn_write_leaves_no_version(tmp_path: Path) -> None:
    # A crash between writing a delta file and its metadata (the commit point) leaves
    # an orphan file and no version; the store still reads and writes normally.
    vs = _versions(3)
    s = DeltaStore(tmp_path)
    s.put(0, vs[0])
    (tmp_path / "deltas" / "v00000000-v00000001.audelta").write_bytes(b"partial")
    (tmp_path / "versions" / ".v00000001.json.tmp-123").write_bytes(b"{")
    assert s.versions() == [0]
    s.put(1, vs[1])
    assert s.get(1).digest() == vs[1].digest()


def test_corrupt_anchor_is_reported(tmp_path: Path) -> None:
    s = DeltaStore(tmp_path)
    s.put(0, _versions(1)[0])
    (tmp_path / s.info(0).file).write_bytes(b"not safetensors")
    with pytest.raises(StoreError, match="unreadable"):
        s.get(0)


def test_state_dict_round_trip(tmp_path: Path) -> None:
    sd = {"w": torch.randn(4, 4).to(torch.bfloat16), "n": torch.tensor(3)}
    s = DeltaStore(tmp_path)
    s.put_state_dict(0, sd)
    back = s.get_state_dict(0)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8)) if sd[k].dim() else back[k] == sd[k]
