"""`aurora deploy`: a topology as the files of a container engine — Docker Compose, Kubernetes or
SkyPilot — one service, pod or task per node, each with its own secret keys only.

`build` plans the `Deployment` (`aurora.deploy.plan`), `aurora.deploy.engines` renders it, and
`write` puts it in a new directory: the engine's files, ``bundle/`` (what every node mounts at
``/etc/aurora``: the rewritten topology, the public keys, the task's files, a ``kind: python``
learner's code) and ``secrets/NODE/``
(what node NODE alone mounts at ``/run/aurora/secret``; mode 0700, its files 0600). Members of a
pool (``--members POOL=N``) are units too, each with a credential of its own (``member.json``),
enrolled with the pool's secret key when the deployment is written. An engine file
that holds a secret (a Kubernetes Secret: ``kubernetes/secrets/``) is 0600 too, and the directory
0700. It is written beside its place and renamed into it, so a failed deploy leaves none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from aurora.config.topology import load_topology
from aurora.deploy.engines import RENDER, SECRET_FILES
from aurora.deploy.plan import MEMBER_TTL_S, TARGETS, Deployment, Target, build
from aurora.errors import ConfigError


def deploy(
    topology: Path,
    target: Target,
    out: Path,
    members: Mapping[str, int] | None = None,
    member_ttl_s: float = MEMBER_TTL_S,
) -> tuple[Deployment, list[Path]]:
    """Plan and write the deployment of ``topology`` for ``target`` into the new directory ``out``, with
    ``members[POOL]`` pool members (a credential each); returns it and the engine's files. Raises
    `ConfigError` (nothing written)."""
    if target not in TARGETS:
        raise ConfigError(f"no engine {target!r}: one of {', '.join(TARGETS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; give a new one")
    topo = load_topology(topology)
    d = build(topo, str(topology), target, members, member_ttl_s)
    files = RENDER[target](d)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.deploy-", dir=out.parent))
    try:
        for rel, data in d.bundle.items():
            _put(tmp / "bundle" / rel, data, 0o644)
        for u in d.units:
            (tmp / "secrets" / u.name).mkdir(mode=0o700, parents=True)
            for name, data in u.secret_bytes().items():
                _put(tmp / "secrets" / u.name / name, data, 0o600)
        os.chmod(tmp / "secrets", 0o700)
        for rel, text in files.items():
            _put(tmp / rel, text.encode(), 0o600 if SECRET_FILES in rel else 0o644)
        tmp.chmod(0o700)  # it holds every node's secrets
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d, [out / rel for rel in files]


def _put(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(mode=0o700 if mode == 0o600 else 0o755, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


__all__ = ["TARGETS", "Deployment", "build", "deploy"]
