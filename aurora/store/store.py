"""`DeltaStore`: versions on disk as anchor snapshots plus the deltas between, at most K deltas a chain.

Layout under the root::

    store.json                          {"format": 1, "anchor_every": K, "run": "<hex>"}
    anchors/v00000012.safetensors       full snapshot of version 12
    deltas/v00000012-v00000013.audelta  delta file (docs/delta-format.md)
    versions/v00000013.json             metadata; written last, so it is the commit point

Invariants: a version is present iff its metadata file is; every present
version can be rebuilt from an anchor at or below it plus present deltas;
every write is atomic (`aurora.store.atomic`), so a crash leaves the old or
the new state. Reading a version checks its digest. Metadata is read as
untrusted: a ``file`` must be the one path its version and kind allow (inside
the store), so nothing a metadata file says can make the store read or delete
elsewhere. A version's seal (`aurora.auth.seal`), when it has one, is kept in
its metadata; every error names the file it is about. Which versions are anchors
is `aurora.store.anchors.AnchorPolicy`'s rule, applied by `keep` (K =
``anchor_every``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from aurora.codec import Manifest, Weights, apply
from aurora.codec.container import load_delta_file, write_delta
from aurora.errors import CheckpointError, DeltaFormatError, StoreError
from aurora.protocol.messages import SealWire
from aurora.store.anchors import AnchorPolicy, Keep, KeepDecision
from aurora.store.atomic import atomic_writer, write_bytes
from aurora.store.checkpoint import load_checkpoint

STORE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class AnchorImage:
    """A version's anchor file as bytes, made while its weights cannot change (`anchor_image`)."""

    version: int
    digest: str
    data: bytes


def anchor_image(version: int, weights: Weights) -> AnchorImage:
    """The safetensors bytes of ``weights`` as version ``version``'s anchor, with their digest."""
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in weights.to_tensors().items()}, metadata={"version": str(version)})
    return AnchorImage(version, weights.digest().hex(), data)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    version: int
    digest: str
    """Hex version digest."""
    kind: str
    """'anchor' or 'delta'."""
    parent: int | None
    """Base version of the delta (None for an anchor)."""
    file: str
    """Path relative to the store root."""
    nbytes: int
    seal: str | None = None
    """The version's seal, hex: its body, a colon, its signature (None: stored without one)."""

    def check(self, where: Path) -> None:
        """The metadata is what this store writes (it is read from disk, so it is not trusted)."""
        if self.kind == "anchor" and self.parent is None:
            want = f"anchors/v{self.version:08d}.safetensors"
        elif self.kind == "delta" and isinstance(self.parent, int) and 0 <= self.parent < self.version:
            want = f"deltas/v{self.parent:08d}-v{self.version:08d}.audelta"
        else:
            raise StoreError(f"{where}: version metadata of an unknown kind {self.kind!r} (parent {self.parent!r})")
        if self.file != want:
            raise StoreError(f"{where}: names the file {self.file!r}, which is not its version's ({want})")
        if not re.fullmatch(r"[0-9a-f]{32}", self.digest):
            raise StoreError(f"{where}: the digest is not 32 hex digits")

    def seal_wire(self) -> SealWire | None:
        if self.seal is None:
            return None
        body, _, sig = self.seal.partition(":")
        try:
            return SealWire(bytes.fromhex(body), bytes.fromhex(sig))
        except ValueError:
            raise StoreError(f"version {self.version}'s stored seal is not hex") from None


class DeltaStore:
    def __init__(self, root: str | Path, *, anchor_every: int = 8) -> None:
        if anchor_every < 1:
            raise StoreError(f"anchor_every must be >= 1, got {anchor_every}")
        self.root = Path(root)
        self._infos: dict[int, VersionInfo] = {}
        """Metadata read or written by this process: a version's metadata never changes while
        it is present (pruning drops it from here too)."""
        for sub in ("anchors", "deltas", "versions"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        cfg = self.root / "store.json"
        if cfg.exists():
            try:
                doc = json.loads(cfg.read_text())
                if doc["format"] != STORE_FORMAT:
                    raise StoreError(f"{cfg}: store format {doc['format']} is not supported")
                self.anchor_every = int(doc["anchor_every"])
                self.run = bytes.fromhex(doc.get("run") or secrets.token_hex(16))
                if self.anchor_every < 1 or len(self.run) != 16:
                    raise ValueError("anchor_every < 1 or a run id that is not 16 bytes")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise StoreError(f"{cfg}: unreadable store config: {e}") from None
        else:
            self.anchor_every = anchor_every
            self.run = secrets.token_bytes(16)
            """The run these versions belong to (the trainer's seals name it)."""
            write_bytes(
                cfg, json.dumps({"format": STORE_FORMAT, "anchor_every": anchor_every, "run": self.run.hex()}).encode()
            )
        self.policy = AnchorPolicy(self.anchor_every)
        """Which versions `keep` stores as anchors."""

    # ------------------------------------------------------------------ listing
    def _meta_path(self, v: int) -> Path:
        return self.root / "versions" / f"v{v:08d}.json"

    def versions(self) -> list[int]:
        out = []
        for p in (self.root / "versions").glob("v*.json"):
            try:
                out.append(int(p.stem[1:]))
            except ValueError:
                continue
        return sorted(out)

    def latest(self) -> int | None:
        vs = self.versions()
        return vs[-1] if vs else None

    def __contains__(self, v: object) -> bool:
        return isinstance(v, int) and self._meta_path(v).exists()

    def info(self, v: int) -> VersionInfo:
        if (known := self._infos.get(v)) is not None:
            return known
        p = self._meta_path(v)
        try:
            doc = json.loads(p.read_text())
            if not isinstance(doc, dict):
                raise TypeError("not a JSON object")
            info = VersionInfo(**doc)
        except FileNotFoundError:
            raise StoreError(f"version {v} is not in the store at {self.root}") from None
        except (ValueError, TypeError, OSError) as e:
            raise StoreError(f"{p}: unreadable version metadata: {e}") from None
        if info.version != v:
            raise StoreError(f"{p}: holds the metadata of version {info.version}")
        info.check(p)
        self._infos[v] = info
        return info

    def seal(self, v: int) -> SealWire | None:
        """Version ``v``'s stored seal (None: stored without one)."""
        return self.info(v).seal_wire()

    # ------------------------------------------------------------------ writing
    def _commit(self, info: VersionInfo) -> VersionInfo:
        write_bytes(self._meta_path(info.version), json.dumps(asdict(info)).encode())
        self._infos[info.version] = info
        return info

    def put_anchor(self, version: int, weights: Weights, *, seal: SealWire | None = None) -> VersionInfo:
        return self.write_anchor(anchor_image(version, weights), seal=seal)

    def write_anchor(self, image: AnchorImage, *, seal: SealWire | None = None) -> VersionInfo:
        """Store a version as an anchor from its image (`anchor_image`). A version already stored as a
        delta becomes an anchor (its metadata, written last, switches; the delta file stays)."""
        rel = f"anchors/v{image.version:08d}.safetensors"
        write_bytes(self.root / rel, image.data)
        return self._commit(VersionInfo(image.version, image.digest, "anchor", None, rel, len(image.data), _hex(seal)))

    def put_delta(self, manifest: Manifest, chunks: Iterable[bytes], *, seal: SealWire | None = None) -> VersionInfo:
        """Store a delta whose base version is present (as produced, or as received and verified)."""
        if manifest.base_version is None or manifest.base_version not in self:
            raise StoreError(
                f"cannot store delta to v{manifest.target_version}: base v{manifest.base_version} is not stored"
            )
        base_info = self.info(manifest.base_version)
        assert manifest.base_digest is not None
        if base_info.digest != manifest.base_digest.hex():
            raise StoreError(f"delta to v{manifest.target_version} was made from a different v{manifest.base_version}")
        rel = f"deltas/v{manifest.base_version:08d}-v{manifest.target_version:08d}.audelta"
        with atomic_writer(self.root / rel) as f:
            n = write_delta(f, manifest, chunks)
        info = VersionInfo(
            manifest.target_version, manifest.target_digest.hex(), "delta", manifest.base_version, rel, n, _hex(seal)
        )
        return self._commit(info)

    def keep(
        self,
        manifest: Manifest,
        chunks: Sequence[bytes | None] | None,
        weights: Weights,
        *,
        seal: SealWire | None = None,
    ) -> KeepDecision:
        """Store version ``manifest.target_version`` (``weights``) as `AnchorPolicy` says: its delta
        (``manifest`` and ``chunks``, when every chunk is at hand) or its full weights, or nothing
        when it is stored already. `Keep.DELTA_THEN_ANCHOR` asks the caller to make the version an
        anchor afterwards (`write_anchor`, off the version's path)."""
        v, latest = manifest.target_version, self.latest()
        whole = chunks is not None and not manifest.is_snapshot and all(c is not None for c in chunks)
        base = manifest.base_version if whole else None
        chain = None
        if latest is not None and base == latest:
            try:
                chain = self.deltas_since_anchor(latest)
            except StoreError:
                chain = None  # a delta onto a chain that cannot be read could not be rebuilt
        decision = self.policy.decide(v, latest=latest, base=base, chain=chain)
        if decision.keep is Keep.ANCHOR:
            self.put_anchor(v, weights, seal=seal)
        elif decision.keep is not Keep.SKIP:
            assert chunks is not None
            self.put_delta(manifest, [c for c in chunks if c is not None], seal=seal)
        return decision

    # ------------------------------------------------------------------ reading
    def _chain(self, v: int) -> list[VersionInfo]:
        chain = [self.info(v)]
        while chain[-1].kind != "anchor":
            parent = chain[-1].parent
            assert parent is not None  # `VersionInfo.check`: a delta has a parent below it
            chain.append(self.info(parent))
        return chain[::-1]

    def deltas_since_anchor(self, v: int) -> int:
        """How many deltas rebuilding version ``v`` applies to its anchor (metadata only)."""
        return len(self._chain(v)) - 1

    def get(self, v: int) -> Weights:
        """Version ``v`` rebuilt from its anchor plus deltas; its digest is checked. A `StoreError`
        names the file that is missing, unreadable or wrong."""
        chain = self._chain(v)
        first = self.root / chain[0].file
        try:
            w = Weights.from_tensors(load_checkpoint(first))
        except CheckpointError as e:
            raise StoreError(f"anchor of v{chain[0].version} is unreadable: {e}") from None
        if w.digest().hex() != chain[0].digest:
            raise StoreError(f"{first}: does not match the digest recorded for version {chain[0].version}")
        for info in chain[1:]:
            path = self.root / info.file
            try:
                m, chunks = load_delta_file(path)
                w = apply(w, m, chunks)
            except DeltaFormatError as e:
                raise StoreError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
        if w.digest().hex() != chain[-1].digest:
            raise StoreError(
                f"{self.root / chain[-1].file}: version {v} rebuilt from the store does not match its recorded digest"
            )
        return w

    # ------------------------------------------------------------------ pruning
    def prune(self, keep_last: int) -> list[int]:
        """Drop versions older than the last ``keep_last`` that no kept version needs. Returns dropped."""
        vs = self.versions()
        if keep_last < 1 or len(vs) <= keep_last:
            return []
        kept = set(vs[-keep_last:])
        needed: set[int] = set()
        for v in kept:
            try:
                needed |= {i.version for i in self._chain(v)}
            except StoreError:
                needed.add(v)  # unreadable: left as it is (`latest_usable` skips it)
        dropped = []
        for v in vs:
            if v in needed:
                continue
            try:
                file: Path | None = self.root / self.info(v).file
            except StoreError:
                file = None  # metadata that names no file of this store: only the metadata goes
            self._infos.pop(v, None)
            self._meta_path(v).unlink()  # the commit point goes first
            if file is not None:
                file.unlink(missing_ok=True)
            dropped.append(v)
        return dropped


def _hex(seal: SealWire | None) -> str | None:
    return None if seal is None else f"{seal.body.hex()}:{seal.sig.hex()}"
