"""Version seals: the trainer's Ed25519 signature over what defines each version.

A `Seal` names a version ``v`` of a run and binds, with cryptographic hashes
(BLAKE3; the codec's xxh3 digests detect corruption, not tampering):

* ``layout`` — the tensors' names, dtypes and shapes (`layout_hash`), so a receiver can
  check what a manifest would make it allocate before it allocates anything;
* ``state`` — every tensor's bits (`state_hash`): the version itself;
* ``delta`` — the bytes of the delta the trainer streamed from ``base`` = v - 1 to v
  (`DeltaHasher`: the manifest and each chunk hashed on its own, so chunks may arrive in
  any order), or None for version 0;
* ``digest`` — the codec's version digest, which the manifest's ``target_digest`` must equal.

How a receiver knows it holds the trainer's version (`docs/security.md`):

* a **streamed** delta, or the trainer's own delta replayed from a relay's history: its
  bytes hash to ``seal.delta`` and it applies onto the version the receiver holds, itself
  authentic — cost O(delta bytes), no hash of the weights;
* a **composed** catch-up or a **snapshot** a relay made: the result's `state_hash` must
  equal ``seal.state`` — cost O(weights), once per catch-up;
* a **restart** from the node's own store: the stored seal is verified and the rebuilt
  weights' `state_hash` compared — O(weights), once per start.

A relay forwards the trainer's seals; it cannot make one (no key), so it cannot make a
receiver commit a version, or a version number, that the trainer did not sign.

Without a signing key the trainer's seals are *unsigned* (zero signature, no state hash):
they keep the stream's shape, and only a receiver that does not authenticate accepts them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import blake3
import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from msgspec import Meta, Struct

from aurora.codec.format import Manifest
from aurora.codec.weights import Weights
from aurora.errors import AuthError
from aurora.protocol.messages import MAX_VERSION, SealWire

SEAL_FORMAT = 1
_DOMAIN = b"aurora-seal/1\0"
NO_SIGNATURE = bytes(64)
NO_HASH = bytes(32)
HASH_THREADS_FROM_BYTES = 64 << 20
"""Tensors at least this big are hashed with BLAKE3's threads (smaller ones are not worth the hand-off)."""

Hash = Annotated[bytes, Meta(min_length=32, max_length=32)]


class Seal(Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    fmt: Annotated[int, Meta(ge=SEAL_FORMAT, le=SEAL_FORMAT)]
    run: Annotated[bytes, Meta(min_length=16, max_length=16)]
    """The trainer's run: random, fixed when its store is made (or at each start without one)."""
    v: Annotated[int, Meta(ge=0, le=MAX_VERSION)]
    base: Annotated[int, Meta(ge=0, le=MAX_VERSION)] | None
    digest: Annotated[bytes, Meta(min_length=16, max_length=16)]
    layout: Hash
    state: Hash
    delta: Hash | None


_decoder = msgspec.msgpack.Decoder(Seal)
_encoder = msgspec.msgpack.Encoder()


def _entry_bytes(name: str, dtype: str, shape: Iterable[int]) -> bytes:
    return b"".join((name.encode(), b"\0", dtype.encode(), b"\0", repr(tuple(shape)).encode(), b"\0"))


def layout_hash(entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """BLAKE3 of the sorted (name, dtype, shape) entries of a weight set."""
    h = blake3.blake3(b"aurora-layout/1\0")
    for name, dtype, shape in sorted(entries):
        h.update(_entry_bytes(name, dtype, shape))
    return h.digest()


def weights_layout(w: Weights) -> bytes:
    return layout_hash((n, tb.dtype.name, tb.shape) for n, tb in w.items())


def manifest_layout(m: Manifest) -> bytes:
    return layout_hash((t.name, t.dtype.name, t.shape) for t in m.tensors)


def tensor_hashes(w: Weights, reuse: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """BLAKE3 of each tensor's bits; ``reuse`` gives hashes already known for unchanged tensors."""
    out = {}
    for name, tb in w.items():
        known = None if reuse is None else reuse.get(name)
        if known is not None:
            out[name] = known
            continue
        data = tb.bits.view("uint8").data
        threads = blake3.blake3.AUTO if tb.bits.nbytes >= HASH_THREADS_FROM_BYTES else 1
        out[name] = blake3.blake3(data, max_threads=threads).digest()
    return out


def state_hash(w: Weights, hashes: Mapping[str, bytes] | None = None) -> bytes:
    """BLAKE3 over every tensor's (name, dtype, shape, BLAKE3 of its bits), in name order."""
    per = tensor_hashes(w) if hashes is None else hashes
    h = blake3.blake3(b"aurora-state/1\0")
    for name, tb in w.items():
        h.update(_entry_bytes(name, tb.dtype.name, tb.shape))
        h.update(per[name])
    return h.digest()


class DeltaHasher:
    """BLAKE3 of a delta's bytes: the manifest, then chunk 0..n-1, each hashed on its own as it comes."""

    def __init__(self, manifest: bytes | memoryview, n_chunks: int) -> None:
        self._manifest = blake3.blake3(manifest).digest()
        self._chunks: list[bytes | None] = [None] * n_chunks

    def add(self, index: int, chunk: bytes | memoryview) -> None:
        self._chunks[index] = blake3.blake3(chunk).digest()

    def digest(self) -> bytes | None:
        """The delta's hash; None while a chunk is missing."""
        if any(c is None for c in self._chunks):
            return None
        h = blake3.blake3(b"aurora-delta/1\0")
        h.update(self._manifest)
        for c in self._chunks:
            assert c is not None
            h.update(c)
        return h.digest()


def delta_hash(manifest: bytes, chunks: Iterable[bytes | memoryview]) -> bytes:
    ch = list(chunks)
    hasher = DeltaHasher(manifest, len(ch))
    for i, c in enumerate(ch):
        hasher.add(i, c)
    d = hasher.digest()
    assert d is not None
    return d


@dataclass(frozen=True, slots=True)
class Sealer:
    """The trainer's side: makes each version's seal (signed when it holds a key)."""

    key: Ed25519PrivateKey | None
    run: bytes

    @property
    def signs(self) -> bool:
        return self.key is not None

    def seal(
        self, *, v: int, base: int | None, digest: bytes, layout: bytes, state: bytes | None, delta: bytes | None
    ) -> SealWire:
        body = _encoder.encode(Seal(SEAL_FORMAT, self.run, v, base, digest, layout, state or NO_HASH, delta))
        sig = NO_SIGNATURE if self.key is None else self.key.sign(_DOMAIN + body)
        return SealWire(body, sig)


@dataclass(frozen=True, slots=True)
class SealVerifier:
    """A receiver's side. With the trainer's public key every seal must carry its signature;
    without one (``key`` None: an insecure topology) seals are only read, never trusted."""

    key: Ed25519PublicKey | None

    @property
    def authenticates(self) -> bool:
        return self.key is not None

    def open(self, wire: SealWire) -> Seal:
        """The seal, signature checked; raises `AuthError`."""
        try:
            seal = _decoder.decode(wire.body)
        except msgspec.DecodeError as e:
            raise AuthError(f"a malformed version seal: {e}") from None
        if self.key is not None:
            try:
                self.key.verify(wire.sig, _DOMAIN + wire.body)
            except InvalidSignature:
                raise AuthError(f"the seal of version {seal.v} is not signed by the trainer's key") from None
        return seal


def check_manifest(seal: Seal, m: Manifest) -> None:
    """What a seal binds that a manifest states: the version, its digest and its layout."""
    if seal.v != m.target_version:
        raise AuthError(f"the seal is for version {seal.v}, the delta makes {m.target_version}")
    if seal.digest != m.target_digest:
        raise AuthError(f"version {seal.v}: the manifest's target digest is not the sealed one")
    if seal.layout != manifest_layout(m):
        raise AuthError(f"version {seal.v}: the manifest's tensors are not the sealed layout")
