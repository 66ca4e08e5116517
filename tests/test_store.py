"""The versioned store: anchors + deltas as the anchor policy says, atomic commits, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aurora.codec import Weights, encode
from aurora.errors import StoreError
from aurora.store import DeltaStore
from aurora.store.anchors import Keep
from tests.helpers import perturb


def _versions(n: int) -> list[Weights]:
    torch.manual_seed(0)
    w = Weights.from_tensors({"a": (torch.randn(5000) * 0.02).to(torch.bfloat16), "b": torch.randn(7, 3)})
    out = [w]
    for i in range(1, n):
        out.append(perturb(out[-1], 0.02, i))
    return out


def _store(s: DeltaStore, vs: list[Weights]) -> list[Keep]:
    """Store ``vs`` as a node does: version 0 as an anchor, each next one with its delta
    (`DeltaStore.keep`), and an anchor due written at once."""
    s.put_anchor(0, vs[0])
    out = [Keep.ANCHOR]
    for v in range(1, len(vs)):
        d = encode(vs[v - 1], vs[v], base_version=v - 1, target_version=v)
        out.append(s.keep(d.manifest, d.chunks, vs[v]).keep)
        if out[-1] is Keep.DELTA_THEN_ANCHOR:
            s.put_anchor(v, vs[v])
    return out


def test_keep_stores_deltas_and_an_anchor_every_k(tmp_path: Path) -> None:
    vs = _versions(7)
    s = DeltaStore(tmp_path, anchor_every=3)
    kept = _store(s, vs)
    assert kept[1:4] == [Keep.DELTA, Keep.DELTA, Keep.DELTA_THEN_ANCHOR]
    kinds = [s.info(i).kind for i in range(7)]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta", "anchor"]
    assert s.versions() == list(range(7))
    assert s.latest() == 6
    for i, w in enumerate(vs):
        assert s.get(i).digest() == w.digest()
    # A reopened store reads the same.
    s2 = DeltaStore(tmp_path, anchor_every=99)
    assert s2.anchor_every == s2.policy.anchor_every == 3
    assert s2.get(5).digest() == vs[5].digest()


def test_a_version_that_cannot_be_a_delta_is_kept_as_an_anchor(tmp_path: Path) -> None:
    """A snapshot, a delta with chunks missing, a delta from another version than the latest, or
    onto a chain that cannot be read: each is stored whole; one stored already is left alone."""
    vs = _versions(6)
    s = DeltaStore(tmp_path, anchor_every=10)
    s.put_anchor(0, vs[0])
    snap = encode(None, vs[1], base_version=None, target_version=1)
    assert s.keep(snap.manifest, snap.chunks, vs[1]).keep is Keep.ANCHOR
    d = encode(vs[1], vs[2], base_version=1, target_version=2)
    assert s.keep(d.manifest, [None, *d.chunks[1:]], vs[2]).keep is Keep.ANCHOR
    assert s.keep(d.manifest, None, vs[2]).keep is Keep.SKIP
    far = encode(vs[1], vs[3], base_version=1, target_version=3)
    assert s.keep(far.manifest, far.chunks, vs[3]).keep is Keep.ANCHOR
    d = encode(vs[3], vs[4], base_version=3, target_version=4)
    assert s.keep(d.manifest, d.chunks, vs[4]).keep is Keep.DELTA
    (tmp_path / "versions" / "v00000003.json").write_text("{")  # v4's anchor: its chain cannot be read
    s = DeltaStore(tmp_path)
    d = encode(vs[4], vs[5], base_version=4, target_version=5)
    decision = s.keep(d.manifest, d.chunks, vs[5])
    assert decision.keep is Keep.ANCHOR
    assert "cannot be read" in decision.reason
    assert s.get(5).digest() == vs[5].digest()
    assert [s.info(v).kind for v in (1, 2, 5)] == ["anchor"] * 3


def test_prune_keeps_what_kept_versions_need(tmp_path: Path) -> None:
    vs = _versions(8)
    s = DeltaStore(tmp_path, anchor_every=4)
    _store(s, vs)
    dropped = s.prune(keep_last=2)  # keeps 6, 7; they need anchor 4 and delta 5
    assert dropped == [0, 1, 2, 3]
    assert s.versions() == [4, 5, 6, 7]
    assert s.get(7).digest() == vs[7].digest()
    assert not list((tmp_path / "anchors").glob("v00000000*"))


def test_bad_writes_change_nothing(tmp_path: Path) -> None:
    vs = _versions(3)
    s = DeltaStore(tmp_path)
    s.put_anchor(1, vs[0])
    d = encode(vs[1], vs[2], base_version=0, target_version=2)
    with pytest.raises(StoreError, match="base v0 is not stored"):
        s.put_delta(d.manifest, d.chunks)
    d = encode(vs[1], vs[2], base_version=1, target_version=2)
    with pytest.raises(StoreError, match="made from a different v1"):
        s.put_delta(d.manifest, d.chunks)
    with pytest.raises(StoreError, match="not in the store"):
        s.get(5)
    assert s.versions() == [1]


def test_torn_write_leaves_no_version(tmp_path: Path) -> None:
    # A crash between writing a delta file and its metadata (the commit point) leaves
    # an orphan file and no version; the store still reads and writes normally.
    vs = _versions(3)
    s = DeltaStore(tmp_path)
    s.put_anchor(0, vs[0])
    (tmp_path / "deltas" / "v00000000-v00000001.audelta").write_bytes(b"partial")
    (tmp_path / "versions" / ".v00000001.json.tmp-123").write_bytes(b"{")
    assert s.versions() == [0]
    d = encode(vs[0], vs[1], base_version=0, target_version=1)
    assert s.keep(d.manifest, d.chunks, vs[1]).keep is Keep.DELTA
    assert s.get(1).digest() == vs[1].digest()


def test_corrupt_anchor_is_reported(tmp_path: Path) -> None:
    s = DeltaStore(tmp_path)
    s.put_anchor(0, _versions(1)[0])
    (tmp_path / s.info(0).file).write_bytes(b"not safetensors")
    with pytest.raises(StoreError, match="unreadable"):
        s.get(0)


def test_an_anchor_round_trips_every_dtype_bit_exact(tmp_path: Path) -> None:
    sd = {"w": torch.randn(4, 4).to(torch.bfloat16), "n": torch.tensor(3)}
    s = DeltaStore(tmp_path)
    s.put_anchor(0, Weights.from_tensors(sd))
    back = s.get(0).to_tensors()
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8)) if sd[k].dim() else back[k] == sd[k]
