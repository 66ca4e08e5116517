"""Elastic pools' keys and credentials: who may join a pool, and the name its key decides.

A pool (`aurora.config.topology.PoolSpec`) admits rollout workers that the topology does not name.
Its Ed25519 key pair — ``keys.dir/POOL.pool`` (secret, PEM, 0600) and ``POOL.pool_pub`` (hex), or
``pools[].key`` inline — certifies members: `enroll` (``aurora keys enroll --pool P``) makes a member's
own CurveZMQ key pair and a `MemberCert` (the pool, the member's public key, an expiry in Unix
seconds) signed by the pool's key, and `write_credential` puts both in one credential file (JSON,
mode 0600, written whole or not at all, never over an existing file).

Who a member is: `member_name` — ``POOL.`` and 16 hex digits of BLAKE2b of its CurveZMQ public key.
A parent's transport lets an unknown key in only under the member name that key hashes to (the
``members`` rule of `aurora.transport.zmq.ZmqServer`), so a member is known by its key and speaks for
no one else. The parent takes its `Hello` only with a certificate that `check_cert` passes: of that
key, for this pool, signed by the pool's key, not expired and not revoked, at a parent the pool
names; then the trainer gives it a place (`aurora.protocol.roster.PoolRoster`). Every error names
the file or the topology field.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from aurora.auth.keys import (
    CurveKeys,
    _public_from_hex,
    key_dir,
    private_mode_problem,
    read_signing_secret,
    write_secret,
)
from aurora.config.topology import PoolSpec, Topology
from aurora.errors import ConfigError
from aurora.protocol.messages import MemberCert
from aurora.protocol.roster import MEMBER_HASH_HEX, member_pool

CREDENTIAL_FORMAT = "aurora-pool-credential/1"
_SIGNED = b"aurora pool member v1\x00"
"""Domain separation: a pool key's signature over a member certificate means nothing else."""
MAX_CREDENTIAL_BYTES = 4096
MAX_REVOKED_BYTES = 1 << 20
"""A revocation file is read up to this size (some 30,000 member names)."""
RECHECK_S = 1.0
"""A revocation file is looked at (stat) at most this often by a node."""


def member_name(pool: str, key: bytes) -> str:
    """The name of the member of ``pool`` whose CurveZMQ public key (Z85) is ``key``."""
    return f"{pool}.{hashlib.blake2b(key, digest_size=MEMBER_HASH_HEX // 2).hexdigest()}"


def _signed_bytes(pool: str, key: bytes, expires: int) -> bytes:
    return _SIGNED + pool.encode() + b"\x00" + key + b"\x00" + expires.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class Credential:
    """What a member holds: its CurveZMQ pair and its certificate."""

    topology: str
    curve: CurveKeys
    cert: MemberCert

    @property
    def name(self) -> str:
        return member_name(self.cert.pool, self.curve.public)


# ------------------------------------------------------------------ the pool's key
def pool_key_paths(topo: Topology, file: str | None, pool: str) -> tuple[Path, Path]:
    """``POOL.pool`` (secret) and ``POOL.pool_pub`` in the key directory."""
    d = key_dir(topo, file)
    if d is None:
        raise ConfigError("the topology names no key directory (keys: {dir: ...})", file=file, path="keys.dir")
    return d / f"{pool}.pool", d / f"{pool}.pool_pub"


def pool_verifiers(topo: Topology, file: str | None) -> dict[str, Ed25519PublicKey]:
    """Every pool's public key (inline ``pools[].key``, else ``keys.dir/POOL.pool_pub``)."""
    out = {}
    for i, p in enumerate(topo.pools):
        if p.key is not None:
            out[p.name] = _public_from_hex(p.key, file, f"pools[{i}].key")
            continue
        _, pub = pool_key_paths(topo, file, p.name)
        try:
            text = pub.read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read pool {p.name!r}'s public key {pub}: {e.strerror} "
                "(make it with `aurora keys generate --topology`)",
                file=file,
                path=f"pools[{i}]",
            ) from None
        out[p.name] = _public_from_hex(text, str(pub), "")
    return out


# ------------------------------------------------------------------ credentials
def enroll(topo: Topology, file: str | None, pool: str, ttl_s: float, now: float) -> Credential:
    """A new member of ``pool``: a fresh CurveZMQ pair certified by the pool's secret key until ``now + ttl_s``."""
    spec = _pool(topo, pool, file)
    if not 0 < ttl_s <= 10 * 365 * 86400:
        raise ConfigError(f"a credential's lifetime must be positive and at most ten years, not {ttl_s} s")
    sec, _ = pool_key_paths(topo, file, spec.name)
    signer = read_signing_secret(sec, file)
    verifier = pool_verifiers(topo, file)[spec.name]
    if signer.public_key().public_bytes_raw() != verifier.public_bytes_raw():
        raise ConfigError(f"{sec} does not match pool {pool!r}'s public key", file=file, path="pools")
    curve = CurveKeys.generate()
    expires = int(now + ttl_s)
    sig = signer.sign(_signed_bytes(spec.name, curve.public, expires))
    return Credential(topo.name, curve, MemberCert(pool=spec.name, key=curve.public, expires=expires, sig=sig))


def write_credential(path: Path, cred: Credential) -> None:
    """The credential file (0600; refuses an existing file)."""
    write_secret(path, credential_bytes(cred))


def credential_bytes(cred: Credential) -> bytes:
    """A credential file's contents (JSON)."""
    doc = {
        "format": CREDENTIAL_FORMAT,
        "topology": cred.topology,
        "pool": cred.cert.pool,
        "member": cred.name,
        "public_key": cred.curve.public.decode(),
        "secret_key": cred.curve.secret.decode(),
        "expires_at": cred.cert.expires,
        "signature": cred.cert.sig.hex(),
    }
    return (json.dumps(doc, indent=2) + "\n").encode()


def read_credential(path: Path) -> Credential:
    """A credential file; raises `ConfigError` naming the file and what is wrong with it."""
    problem = private_mode_problem(path)
    if problem is not None:
        raise ConfigError(problem, file=str(path))
    try:
        raw = path.read_bytes()[: MAX_CREDENTIAL_BYTES + 1]
    except OSError as e:
        raise ConfigError(f"cannot read the credential: {e.strerror}", file=str(path)) from None
    try:
        if len(raw) > MAX_CREDENTIAL_BYTES:
            raise ValueError(f"more than {MAX_CREDENTIAL_BYTES} bytes")
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != CREDENTIAL_FORMAT:
            raise ValueError(f"not a {CREDENTIAL_FORMAT} file")
        curve = CurveKeys(_z85(doc["public_key"]), _z85(doc["secret_key"]))
        cert = MemberCert(
            pool=str(doc["pool"]),
            key=curve.public,
            expires=int(doc["expires_at"]),
            sig=bytes.fromhex(str(doc["signature"])),
        )
        topology = str(doc["topology"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"not a pool credential: {e}", file=str(path)) from None
    return Credential(topology, curve, cert)


def _z85(v: object) -> bytes:
    if not isinstance(v, str) or len(v) != 40:
        raise ValueError("a key is 40 Z85 characters")
    return v.encode()


def _pool(topo: Topology, pool: str, file: str | None) -> PoolSpec:
    try:
        return topo.pool(pool)
    except KeyError:
        names = ", ".join(p.name for p in topo.pools) or "none"
        raise ConfigError(f"no pool named {pool!r} (pools: {names})", file=file, path="pools") from None


def check_credential(topo: Topology, file: str | None, cred: Credential, now: float) -> PoolSpec:
    """What a member checks of its own credential before it starts (the parents check it again)."""
    spec = _pool(topo, cred.cert.pool, file)
    if cred.topology != topo.name:
        raise ConfigError(f"the credential is for topology {cred.topology!r}, not {topo.name!r}", file=file)
    why = check_cert(cred.cert, cred.name, spec.parents[0], {spec.name: spec}, pool_verifiers(topo, file), now)
    if why is not None:
        raise ConfigError(f"the credential {why}", file=file, path=f"pools[{topo.pools.index(spec)}]")
    return spec


class Revocations:
    """Each pool's revocation file, ``keys.dir/POOL.revoked`` (one member name a line; ``#`` comments),
    read again when it changes: an operator revokes a member while the cluster runs (``aurora keys
    revoke``), besides the topology's ``pools[].revoked``. A file that is missing revokes no one; one
    that cannot be read (or stat-ed) keeps what was last read from it. The file is looked at most once
    every `RECHECK_S` (``now`` comes from the caller's clock), and read again when its inode, size or
    mtime changed, or when it was written within `RECHECK_S` of the last look (a coarse clock cannot
    hide a write)."""

    def __init__(self, topo: Topology, file: str | None) -> None:
        d = key_dir(topo, file)
        self.paths = {} if d is None else {p.name: d / f"{p.name}.revoked" for p in topo.pools}
        self.static = {p.name: frozenset(p.revoked) for p in topo.pools}
        self._read: dict[str, tuple[tuple[int, int, int], frozenset[str]]] = {}
        self._looked: dict[str, float] = {}

    def of(self, pool: str, now: float) -> frozenset[str]:
        """The members of ``pool`` revoked at ``now``."""
        path = self.paths.get(pool)
        if path is not None and now - self._looked.get(pool, -math.inf) >= RECHECK_S:
            self._looked[pool] = now
            self._look(pool, path)
        cached = self._read.get(pool)
        return self.static.get(pool, frozenset()) | (cached[1] if cached else frozenset())

    def _look(self, pool: str, path: Path) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            self._read.pop(pool, None)
            return
        except OSError:
            return  # keep what was last read
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._read.get(pool)
        fresh = time.time() - st.st_mtime < 2 * RECHECK_S  # written just now: read it again whatever the key
        if cached is None or cached[0] != key or fresh:
            names = read_revoked(path)
            if names is not None:
                self._read[pool] = (key, names)


def read_revoked(path: Path) -> frozenset[str] | None:
    """The member names in a revocation file (None: it cannot be read)."""
    try:
        text = path.read_bytes()[:MAX_REVOKED_BYTES].decode(errors="replace")
    except OSError:
        return None
    return frozenset(line.split("#", 1)[0].strip() for line in text.splitlines()) - {""}


def revoke(topo: Topology, file: str | None, pool: str, members: list[str]) -> tuple[Path, list[str]]:
    """Add ``members`` to ``pool``'s revocation file (appended under an exclusive lock, so two at once
    lose nothing; never past `MAX_REVOKED_BYTES`, which is all a node reads); returns the file and the
    names that were not in it yet. Raises `ConfigError` for a name that is no member of the pool, or a
    file that would grow too big."""
    spec = _pool(topo, pool, file)
    for m in members:
        if member_pool(m, {spec.name: spec}) != spec.name:
            raise ConfigError(f"{m!r} is not a member name of pool {pool!r} (POOL. and 16 hex digits)", file=file)
    d = key_dir(topo, file)
    if d is None:
        raise ConfigError("the topology names no key directory (keys: {dir: ...})", file=file, path="keys.dir")
    path = d / f"{spec.name}.revoked"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    with os.fdopen(fd, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        have = frozenset(line.split("#", 1)[0].strip() for line in text.decode(errors="replace").splitlines())
        new = [m for m in dict.fromkeys(members) if m not in have]
        head = b"" if text else f"# members of pool {spec.name} refused (aurora keys revoke)\n".encode()
        add = head + (b"\n" if text and not text.endswith(b"\n") else b"") + "".join(m + "\n" for m in new).encode()
        if len(text) + len(add) > MAX_REVOKED_BYTES:
            raise ConfigError(
                f"{path} would hold more than {MAX_REVOKED_BYTES} bytes, all a node reads: start a new pool "
                "with a new key instead",
                file=file,
            )
        f.write(add)
        f.flush()
        os.fsync(f.fileno())
    return path, new


def check_cert(
    cert: MemberCert,
    member: str,
    parent: str,
    pools: Mapping[str, PoolSpec],
    verifiers: Mapping[str, Ed25519PublicKey],
    now: float,
    revoked: frozenset[str] = frozenset(),
) -> str | None:
    """Why ``member``'s certificate does not let it attach under ``parent`` at ``now`` (None: it does).
    ``revoked``: members revoked besides the topology's ``pools[].revoked`` (`Revocations`)."""
    spec = pools.get(cert.pool)
    if spec is None or member_pool(member, pools) != cert.pool:
        return f"is for pool {cert.pool!r}, which {member!r} is no member of here"
    if member_name(cert.pool, cert.key) != member:
        return f"is of another key than {member!r}'s"
    if parent not in spec.parents:
        return f"is for pool {cert.pool!r}, whose members do not attach to {parent!r}"
    try:
        verifiers[cert.pool].verify(cert.sig, _signed_bytes(cert.pool, cert.key, cert.expires))
    except (InvalidSignature, KeyError):
        return f"is not signed by pool {cert.pool!r}'s key"
    if cert.expires <= now:
        return f"expired {now - cert.expires:.0f} s ago"
    if member in spec.revoked or member in revoked:
        return f"of {member!r} is revoked"
    return None


__all__ = [
    "Credential",
    "Revocations",
    "check_cert",
    "check_credential",
    "credential_bytes",
    "enroll",
    "member_name",
    "pool_verifiers",
    "read_credential",
    "revoke",
    "write_credential",
]
