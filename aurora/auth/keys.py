"""Key files: every node's CurveZMQ pair, and the trainer's Ed25519 signing pair.

A topology that uses keys names them in two ways, which may be mixed:

* ``keys.dir`` (relative to the topology file): ``NODE.key`` (CurveZMQ public,
  ZeroMQ certificate format) and ``NODE.key_secret`` for every node, and the trainer's
  ``TRAINER.sign_pub`` (Ed25519 public, hex) and ``TRAINER.sign`` (secret, PEM) —
  what ``aurora keys generate --topology T.yaml`` writes. On a real deployment each
  machine holds every public file and only its own node's secret files.
* per node, ``public_key`` (Z85) and ``secret_key_file``; and ``keys.signing_key`` (hex)
  for the trainer's public signing key.

Each pool's key pair is ``POOL.pool``/``POOL.pool_pub`` in ``keys.dir`` (or ``pools[].key`` inline);
its members' credentials are `aurora.auth.pool`'s.

Invariants: a secret key file is created with mode 0600 before its first byte is written
(`write_secret`), appears whole or not at all, and is never overwritten (`aurora.store.atomic.
create_new`); every error names the file or the topology field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from aurora.config.topology import Topology
from aurora.errors import ConfigError
from aurora.store.atomic import create_new

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
OPERATOR = "operator"
"""The key `aurora status` authenticates with (``keys.dir/operator.key``); it may only ask for status,
and no node may have this name."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CurveZMQ key pair, Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        pub, sec = zmq.curve_keypair()
        return cls(pub, sec)


@dataclass(frozen=True, slots=True)
class NodeKeys:
    """What one node holds: its own pair, everyone's public keys, and the trainer's signing keys."""

    curve: CurveKeys | None = None
    public: dict[str, bytes] = field(default_factory=dict)
    """Every node's CurveZMQ public key (Z85) by name: who a connecting key is."""
    signer: Ed25519PrivateKey | None = None
    """The trainer's signing key (on the trainer only)."""
    verifier: Ed25519PublicKey | None = None
    """The trainer's public signing key: every node checks version seals with it."""

    @property
    def secure(self) -> bool:
        return self.curve is not None

    def name_of(self, z85_public: bytes) -> str | None:
        """The node a CurveZMQ public key belongs to."""
        for name, key in self.public.items():
            if key == z85_public:
                return name
        return None


def uses_keys(topo: Topology) -> bool:
    return topo.keys is not None or any(n.public_key is not None for n in topo.nodes)


def exposed_nodes(topo: Topology) -> list[str]:
    """Nodes that listen on an address other than loopback (they need keys, or ``--insecure``)."""
    return [
        n.name for n in topo.nodes if n.listen is not None and (urlsplit(n.listen).hostname or "") not in LOOPBACK_HOSTS
    ]


def _where(file: str | None) -> Path:
    return Path(file).parent if file else Path()


def key_dir(topo: Topology, file: str | None) -> Path | None:
    if topo.keys is None or topo.keys.dir is None:
        return None
    return _where(file) / topo.keys.dir


def _index(topo: Topology, name: str) -> int:
    return next(i for i, n in enumerate(topo.nodes) if n.name == name)


def load_node_keys(topo: Topology, name: str, file: str | None) -> NodeKeys:
    """The keys node ``name`` runs with (none for a topology without keys); raises `ConfigError`."""
    if not uses_keys(topo):
        return NodeKeys()
    d = key_dir(topo, file)
    public = {n.name: _public_of(topo, n.name, d, file) for n in topo.nodes}
    if d is not None and (d / f"{OPERATOR}.key").exists():
        public[OPERATOR] = _read_cert(d / f"{OPERATOR}.key", file, "keys.dir")[0]
    spec = topo.node(name)
    i = _index(topo, name)
    secret_path = (
        (_where(file) / spec.secret_key_file) if spec.secret_key_file else (d / f"{name}.key_secret" if d else None)
    )
    if secret_path is None:
        raise ConfigError(
            f"no CurveZMQ secret key for {name!r}: set keys.dir or nodes[{i}].secret_key_file",
            file=file,
            path=f"nodes[{i}]",
        )
    pub, sec = _read_secret_cert(secret_path, file, f"nodes[{i}].secret_key_file")
    if sec is None:
        raise ConfigError(
            f"{secret_path} holds no secret key (give the .key_secret file)",
            file=file,
            path=f"nodes[{i}].secret_key_file",
        )
    if pub != public[name]:
        raise ConfigError(
            f"the key pair in {secret_path} does not match node {name!r}'s public key",
            file=file,
            path=f"nodes[{i}].public_key",
        )
    trainer = topo.trainer.name
    verifier = _signing_public(topo, d, file)
    signer = None
    if name == trainer:
        assert topo.keys is not None
        if topo.keys.signing_key_file is not None:
            sign_path = _where(file) / topo.keys.signing_key_file
        elif d is not None:
            sign_path = d / f"{trainer}.sign"
        else:
            raise ConfigError(
                "the trainer needs its signing key: set keys.dir or keys.signing_key_file",
                file=file,
                path="keys.signing_key_file",
            )
        signer = read_signing_secret(sign_path, file)
        if signer.public_key().public_bytes_raw() != verifier.public_bytes_raw():
            raise ConfigError(f"{sign_path} does not match the trainer's public signing key", file=file, path="keys")
    return NodeKeys(CurveKeys(pub, sec), public, signer, verifier)


def load_member_keys(topo: Topology, file: str | None, name: str, curve: CurveKeys) -> NodeKeys:
    """The keys pool member ``name`` runs with: its own pair (from its credential), every named node's
    public key, and the trainer's public signing key."""
    d = key_dir(topo, file)
    public = {n.name: _public_of(topo, n.name, d, file) for n in topo.nodes if n.name != name}
    public[name] = curve.public
    return NodeKeys(curve, public, None, _signing_public(topo, d, file))


def load_client_keys(topo: Topology, file: str | None, as_node: str | None) -> tuple[NodeKeys, str | None]:
    """The keys a client of the trainer (`aurora status`) connects with, and the name they are
    of: ``as_node``'s pair, else the key directory's ``operator`` pair, else the trainer's.
    No keys (and no name) for a topology without them."""
    if not uses_keys(topo):
        return NodeKeys(), None
    d = key_dir(topo, file)
    trainer = topo.trainer.name
    name = as_node or (OPERATOR if d is not None and (d / f"{OPERATOR}.key_secret").exists() else trainer)
    if name == OPERATOR:
        assert d is not None
        pub, sec = _read_secret_cert(d / f"{OPERATOR}.key_secret", file, "keys.dir")
        if sec is None:
            raise ConfigError(f"{d / (OPERATOR + '.key_secret')} holds no secret key", file=file, path="keys.dir")
        curve = CurveKeys(pub, sec)
    else:
        if name not in {n.name for n in topo.nodes}:
            raise ConfigError(f"no node named {name!r} to authenticate as", file=file)
        mine = load_node_keys(topo, name, file)
        assert mine.curve is not None
        curve = mine.curve
    return NodeKeys(curve, {trainer: _public_of(topo, trainer, d, file)}), name


def _public_of(topo: Topology, name: str, d: Path | None, file: str | None) -> bytes:
    spec = topo.node(name)
    i = _index(topo, name)
    if spec.public_key is not None:
        return spec.public_key.encode()
    if d is None:
        raise ConfigError(
            f"no CurveZMQ public key for {name!r}: set keys.dir or nodes[{i}].public_key",
            file=file,
            path=f"nodes[{i}].public_key",
        )
    pub, _ = _read_cert(d / f"{name}.key", file, "keys.dir")
    return pub


def private_mode_problem(path: Path) -> str | None:
    """Why the secret key file ``path`` may not be used (group or others may read or write it), or None."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None  # reading it reports the problem
    if mode & 0o077:
        return (
            f"{path} is a secret key readable or writable by others (mode {mode:04o}); "
            f"make it private with `chmod 600 {path}`"
        )
    return None


def _check_private(path: Path, file: str | None, field_path: str) -> None:
    problem = private_mode_problem(path)
    if problem is not None:
        raise ConfigError(problem, file=file, path=field_path)


def _read_secret_cert(path: Path, file: str | None, field_path: str) -> tuple[bytes, bytes | None]:
    """A CurveZMQ secret key file, refused when group or others have access to it."""
    _check_private(path, file, field_path)
    return _read_cert(path, file, field_path)


def _read_cert(path: Path, file: str | None, field_path: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        why = "missing (make it with `aurora keys generate --topology`)" if isinstance(e, FileNotFoundError) else e
        raise ConfigError(f"cannot read the CurveZMQ key {path}: {why}", file=file, path=field_path) from None


def _signing_public(topo: Topology, d: Path | None, file: str | None) -> Ed25519PublicKey:
    if topo.keys is not None and topo.keys.signing_key is not None:
        return _public_from_hex(topo.keys.signing_key, file, "keys.signing_key")
    if d is None:
        raise ConfigError("no trainer signing key: set keys.dir or keys.signing_key", file=file, path="keys")
    path = d / f"{topo.trainer.name}.sign_pub"
    try:
        text = path.read_text().strip()
    except OSError as e:
        raise ConfigError(
            f"cannot read the trainer's public signing key {path}: {e.strerror}", file=file, path="keys.dir"
        ) from None
    return _public_from_hex(text, str(path), "")


def _public_from_hex(text: str, file: str | None, field_path: str) -> Ed25519PublicKey:
    try:
        raw = bytes.fromhex(text.removeprefix("ed25519:"))
        if len(raw) != 32:
            raise ValueError(f"{len(raw)} bytes")
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as e:
        raise ConfigError(f"not an Ed25519 public key (64 hex digits): {e}", file=file, path=field_path) from None


def read_signing_secret(path: Path, file: str | None = None) -> Ed25519PrivateKey:
    _check_private(path, file, "keys.dir")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as e:
        raise ConfigError(
            f"cannot read the trainer's signing key {path}: {e.strerror}", file=file, path="keys.dir"
        ) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a PEM Ed25519 private key: {e}", file=file, path="keys.dir") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} is not an Ed25519 key", file=file, path="keys.dir")
    return key


def signing_public_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes_raw().hex()


# ------------------------------------------------------------------ writing keys
def write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 (exactly, whatever the umask) and write ``data``; refuses an
    existing file (`FileExistsError`)."""
    create_new(path, data, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    create_new(path, data, 0o644)


def _cert(public: bytes, secret: bytes | None) -> bytes:
    kind = "Secret" if secret is not None else "Public"
    lines = [
        f"#   ZeroMQ CURVE **{kind}** Certificate (written by aurora keys generate)",
        *(["#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."] if secret else []),
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
        *([f'    secret-key = "{secret.decode()}"'] if secret is not None else []),
    ]
    return ("\n".join(lines) + "\n").encode()


def generate_curve_pair(d: Path, name: str) -> tuple[Path, Path, bytes]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (0600) in ``d``; refuses existing files."""
    pub_path, sec_path = d / f"{name}.key", d / f"{name}.key_secret"
    for f in (pub_path, sec_path):
        if f.exists():
            raise FileExistsError(f"{f} exists; refusing to overwrite a key")
    keys = CurveKeys.generate()
    write_secret(sec_path, _cert(keys.public, keys.secret))
    _write_public(pub_path, _cert(keys.public, None))
    return pub_path, sec_path, keys.public


def generate_signing_pair(d: Path, name: str, kind: str = "sign") -> tuple[Path, Path, str]:
    """Write ``NAME.KIND`` (PEM, 0600) and ``NAME.KIND_pub`` (hex) in ``d`` (``sign``: the trainer's;
    ``pool``: a pool's); refuses existing files."""
    sec_path, pub_path = d / f"{name}.{kind}", d / f"{name}.{kind}_pub"
    for f in (pub_path, sec_path):
        if f.exists():
            raise FileExistsError(f"{f} exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_secret(sec_path, pem)
    hexkey = signing_public_hex(key.public_key())
    _write_public(pub_path, (hexkey + "\n").encode())
    return sec_path, pub_path, hexkey


def generate_topology_keys(topo: Topology, file: str | None) -> Iterator[tuple[Path, bool]]:
    """Every key file the topology's ``keys.dir`` needs: (path, True if written now, False if kept)."""
    d = key_dir(topo, file)
    if d is None:
        raise ConfigError("the topology names no key directory (keys: {dir: ...})", file=file, path="keys.dir")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in topo.nodes:
        pub, sec = d / f"{n.name}.key", d / f"{n.name}.key_secret"
        if pub.exists() or sec.exists():
            yield from ((p, False) for p in (pub, sec) if p.exists())
        else:
            pub, sec, _ = generate_curve_pair(d, n.name)
            yield from ((pub, True), (sec, True))
    pub, sec = d / f"{OPERATOR}.key", d / f"{OPERATOR}.key_secret"
    if pub.exists() or sec.exists():
        yield from ((p, False) for p in (pub, sec) if p.exists())
    else:
        pub, sec, _ = generate_curve_pair(d, OPERATOR)
        yield from ((pub, True), (sec, True))
    t = topo.trainer.name
    sign, sign_pub = d / f"{t}.sign", d / f"{t}.sign_pub"
    if sign.exists() or sign_pub.exists():
        yield from ((p, False) for p in (sign, sign_pub) if p.exists())
    else:
        sign, sign_pub, _ = generate_signing_pair(d, t)
        yield from ((sign, True), (sign_pub, True))
    for pool in topo.pools:  # each pool's key, which certifies its members (`aurora.auth.pool`)
        if pool.key is not None:
            continue
        sec, pub = d / f"{pool.name}.pool", d / f"{pool.name}.pool_pub"
        if sec.exists() or pub.exists():
            yield from ((p, False) for p in (sec, pub) if p.exists())
        else:
            generate_signing_pair(d, pool.name, "pool")
            yield from ((sec, True), (pub, True))
