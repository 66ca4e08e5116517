"""What `aurora deploy` ships: one unit per node of a topology, and the files they share.

A deployment runs every node in a container of `docker/cpu.Dockerfile` or `docker/cuda.Dockerfile`,
with four paths of its own:

* ``/etc/aurora`` — the *bundle*, the same for every node: the topology rewritten for the engine
  (``topology.yaml``), every public key (``keys/``) and the task's files (``task/``);
* ``/run/aurora/secret`` — the node's *own* secret files and nothing else: its CurveZMQ secret key
  (``NODE.key_secret``) and, on the trainer, the signing key (``TRAINER.sign``);
* ``/var/lib/aurora/store`` — the node's version store (a restarted node resumes from it);
* ``/var/lib/aurora/model`` — the model directory (made at the node's first start when the
  topology's ``model.fetch`` or ``model.preset`` says how, else provided by the operator).

Invariants: a unit names its own secret files only, and the bundle holds no secret (every file of
it is a public key, the topology or a task file); the rewritten topology loads and checks as the
original does; each unit's command is `aurora.runtime.processes.node_argv`, the one `aurora run`
and `aurora chaos` use, with the container's paths. Errors name the topology file and the field.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
import zmq.auth

from aurora.auth.keys import LOOPBACK_HOSTS, OPERATOR, key_dir
from aurora.auth.pool import credential_bytes, enroll
from aurora.config.plan import plan
from aurora.config.rl import REWARDS, DatasetSpec, JsonlSpec, LoopSpec, PythonSpec
from aurora.config.strict import convert
from aurora.config.topology import Topology, check
from aurora.errors import ConfigError
from aurora.runtime.processes import node_argv

Target = Literal["compose", "kubernetes", "skypilot"]
TARGETS: tuple[Target, ...] = ("compose", "kubernetes", "skypilot")

CONF = "/etc/aurora"
SECRET = "/run/aurora/secret"
STORE = "/var/lib/aurora/store"
MODEL = "/var/lib/aurora/model"
BIND_ALL = "0.0.0.0"
MEMBER_FILE = "member.json"
"""A pool member's credential in its secrets."""
MEMBER_TTL_S = 7 * 86400.0

_DNS = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class Unit:
    """One node as the engine runs it."""

    name: str
    role: str
    region: str
    dns: str
    """The node's name as a DNS label (Kubernetes objects, Compose services): unique in the deployment."""
    argv: tuple[str, ...]
    """Its command line inside the container."""
    port: int | None
    """The port it listens on for its children (trainer, relays), else None."""
    gpus: int
    image: str
    secrets: Mapping[str, Path | bytes]
    """Its own secret files: the name they have in ``SECRET`` -> where they are on this machine (or their
    bytes: a pool member's credential, made by the deploy)."""
    cloud: str | None
    cloud_region: str | None
    parent: str | None
    """Its planned parent's DNS name (Compose starts it first); None for the trainer."""
    spot: bool = False
    """A pool member: SkyPilot may run it on a spot machine (preempted, it is relaunched and rejoins)."""

    def secret_bytes(self) -> dict[str, bytes]:
        """Its own secret files' contents, by the name they have in ``SECRET``."""
        return {k: v if isinstance(v, bytes) else v.read_bytes() for k, v in self.secrets.items()}


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    """The topology's name as a DNS label (prefix of the engine's objects)."""
    target: Target
    units: tuple[Unit, ...]
    bundle: dict[str, bytes]
    """The files every node mounts at ``CONF``, by path relative to it (``topology.yaml``, ``keys/...``, ``task/...``)."""
    model: bool
    """The topology names a model directory: every node mounts one at ``MODEL``."""
    model_dir: Path | None
    """The model directory on this machine when it exists (Compose and SkyPilot mount it; else each node makes it)."""
    accelerator: str | None
    notes: list[str] = field(default_factory=list)
    """What the operator must know (printed by `aurora deploy`)."""


def dns_label(name: str, what: str, file: str) -> str:
    """``name`` as a DNS-1123 label (lower case, ``_`` and ``.`` as ``-``), or a `ConfigError`."""
    label = re.sub(r"[_.]", "-", name.lower())
    if len(label) > 50:
        raise ConfigError(
            f"{what} {name!r} makes a DNS name of {len(label)} characters (at most 50): shorten it", file=file
        )
    if not _DNS.fullmatch(label):
        raise ConfigError(f"{what} {name!r} makes no DNS name ({label!r}); use letters, digits and '-'", file=file)
    return label


def service(deployment: str, node: str, target: Target) -> str:
    """The name a node's children dial: its Compose service (a project has a network of its own), or its
    Kubernetes Service (named for the deployment too: several may share a namespace)."""
    return f"aurora-{deployment}-{node}" if target == "kubernetes" else node


def _listen_port(listen: str, file: str, i: int) -> int:
    u = urlsplit(listen)
    if u.scheme != "tcp" or u.port is None:
        raise ConfigError(f"{listen!r} is not tcp://HOST:PORT", file=file, path=f"nodes[{i}].listen")
    return u.port


def _read(path: Path, file: str, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(
            f"cannot read {what} {path}: {e.strerror} (aurora keys generate --topology {file})", file=file
        ) from None


def _task_files(topo: Topology, raw: dict[str, Any], file: str) -> dict[str, bytes]:
    """The task's files for the bundle (``task/...``), and ``raw``'s task paths pointed at them."""
    task, out = topo.task, {}
    if isinstance(task, JsonlSpec | DatasetSpec):
        src = Path(task.path)
        out[f"task/{src.name}"] = _read(src, file, "the task's data file")
        raw["task"]["path"] = f"task/{src.name}"
    if isinstance(task, DatasetSpec) and task.reward not in REWARDS:
        out |= _code(Path(task.reward_dir or "."), task.reward, "task/reward", file, "task.reward")
        raw["task"]["reward_dir"] = "task/reward"
    learner = topo.learner
    if isinstance(learner, LoopSpec):
        raise ConfigError(
            "learner kind 'loop': the trainer runs inside your own training loop, which aurora deploy cannot "
            "start; deploy a topology whose learner aurora node runs (kind: grpo, or python with a factory)",
            file=file,
            path="learner.kind",
        )
    if isinstance(learner, PythonSpec):
        out |= _code(Path(learner.module_dir or "."), learner.factory, "learner", file, "learner.factory")
        raw["learner"]["module_dir"] = "learner"
    return out


def _code(where: Path, ref: str, to: str, file: str, field: str) -> dict[str, bytes]:
    """The module ``ref`` (``module:function``) names and what it may import from beside it: ``where``'s
    *.py, and a dotted module's package — for the bundle, under ``to/``."""
    package = where / ref.partition(":")[0].split(".")[0]
    files = sorted(where.glob("*.py")) + (sorted(package.rglob("*.py")) if package.is_dir() else [])
    if not files:
        raise ConfigError(f"no Python file in {where} for {ref!r}", file=file, path=field)
    return {f"{to}/{src.relative_to(where)}": _read(src, file, f"the code of {ref!r}") for src in files}


def _members(
    topo: Topology, file: str, pool_name: str, count: int, ttl_s: float, now: float, dns: Mapping[str, str]
) -> list[Unit]:
    """``count`` members of pool ``pool_name``: units that run `aurora node --pool` with a credential each."""
    try:
        pool = topo.pool(pool_name)
    except KeyError:
        raise ConfigError(f"--members: no pool named {pool_name!r}", file=file) from None
    if not 1 <= count <= pool.max_size:
        raise ConfigError(f"--members: pool {pool_name!r} takes 1..{pool.max_size} members, not {count}", file=file)
    gpus = topo.deploy.gpus.rollout
    region = topo.region(topo.pool_region(pool))
    units = []
    for _ in range(count):
        cred = enroll(topo, file, pool_name, ttl_s, now)
        argv = ["python3", "-m", "aurora", "--log-format", "json", "node", "--topology", f"{CONF}/topology.yaml"]
        argv += ["--pool", pool_name, "--credential", f"{SECRET}/{MEMBER_FILE}", "--store", STORE]
        units.append(
            Unit(
                cred.name,
                "rollout",
                region.name,
                dns_label(cred.name, "pool member", file),
                tuple(argv),
                None,
                gpus,
                _image(topo, gpus),
                {MEMBER_FILE: credential_bytes(cred)},
                region.cloud,
                region.cloud_region,
                dns[pool.parents[0]],
                spot=True,
            )
        )
    return units


def _image(topo: Topology, gpus: int) -> str:
    return topo.deploy.gpu_image if gpus else topo.deploy.image


def build(
    topo: Topology,
    file: str,
    target: Target,
    members: Mapping[str, int] | None = None,
    member_ttl_s: float = MEMBER_TTL_S,
    now: float | None = None,
) -> Deployment:
    """The deployment of ``topo`` (loaded from ``file``) for ``target``, with ``members[POOL]`` members
    of each pool named there (each with a credential of its own, enrolled now with the pool's secret
    key, valid ``member_ttl_s``); raises `ConfigError`."""
    d = key_dir(topo, file)
    if d is None or topo.keys is None or topo.keys.signing_key is not None or topo.keys.signing_key_file is not None:
        raise ConfigError(
            "aurora deploy needs the topology's keys in a key directory (keys: {dir: ...}, made by "
            "aurora keys generate --topology): every node listens beyond loopback",
            file=file,
            path="keys",
        )
    for i, n in enumerate(topo.nodes):
        if n.public_key is not None or n.secret_key_file is not None:
            raise ConfigError(
                "aurora deploy takes keys from keys.dir only; remove public_key/secret_key_file",
                file=file,
                path=f"nodes[{i}]",
            )
    raw = yaml.safe_load(Path(file).read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list):
        raise ConfigError("not a topology", file=file)
    for section in ("learner", "engine"):
        if isinstance(raw.get(section), dict) and isinstance(raw[section].get("model"), dict):
            raise ConfigError(
                f"aurora deploy ships the topology's model section only; move {section}.model there",
                file=file,
                path=f"{section}.model",
            )
    name = dns_label(topo.name, "the topology name", file)
    dns: dict[str, str] = {}
    for n in topo.nodes:
        label = dns_label(n.name, "node", file)
        if label in dns.values():
            raise ConfigError(f"nodes {n.name!r} and another both make the DNS name {label!r}", file=file)
        if len(service(name, label, target)) > 63:
            raise ConfigError(
                f"{service(name, label, target)!r} (the topology's and node {n.name!r}'s names) is longer than "
                "a DNS label's 63 characters: shorten them",
                file=file,
            )
        dns[n.name] = label

    trainer = topo.trainer.name
    bundle: dict[str, bytes] = {}
    for n in [*topo.nodes]:
        bundle[f"keys/{n.name}.key"] = _read(d / f"{n.name}.key", file, f"{n.name}'s public key")
    bundle[f"keys/{trainer}.sign_pub"] = _read(d / f"{trainer}.sign_pub", file, "the trainer's public signing key")
    if (d / f"{OPERATOR}.key").is_file():
        bundle[f"keys/{OPERATOR}.key"] = _read(d / f"{OPERATOR}.key", file, "the operator's public key")
    bundle.update(_task_files(topo, raw, file))

    raw["keys"] = {"dir": "keys", "signing_key_file": f"{SECRET}/{trainer}.sign"}
    for i, pool in enumerate(topo.pools):  # each pool's public key inline (its secret stays with the operator)
        if pool.key is None:
            pub = _read(d / f"{pool.name}.pool_pub", file, f"pool {pool.name!r}'s public key").decode().strip()
            raw["pools"][i]["key"] = pub
    model_dir = None
    if topo.model is not None and topo.model.path is not None:
        model_dir = Path(topo.model.path) if (Path(topo.model.path) / "config.json").is_file() else None
        if topo.model.fetch is None and (model_dir is None or target == "kubernetes"):
            where = "a pod can only fetch it" if model_dir is not None else f"{topo.model.path} is missing here"
            raise ConfigError(
                f"the nodes need the model and {where}: name a known model in model.fetch "
                "(aurora model fetch --list), or build the model into the image",
                file=file,
                path="model.fetch",
            )
        raw["model"]["path"] = MODEL
    for i, n in enumerate(topo.nodes):
        if target == "skypilot" and n.listen is not None and (urlsplit(n.listen).hostname or "") in LOOPBACK_HOSTS:
            raise ConfigError(
                f"{n.listen} is loopback: on SkyPilot each node has a machine of its own; give {n.name} "
                "the DNS name or address its machine will have",
                file=file,
                path=f"nodes[{i}].listen",
            )
        spec = raw["nodes"][i]
        spec["public_key"] = zmq.auth.load_certificate(d / f"{n.name}.key")[0].decode()
        spec["secret_key_file"] = f"{SECRET}/{n.name}.key_secret"
        if n.listen is not None and target != "skypilot":
            spec["listen"] = f"tcp://{service(name, dns[n.name], target)}:{_listen_port(n.listen, file, i)}"
    text = yaml.safe_dump(raw, sort_keys=False)
    rewritten = convert(Topology, yaml.safe_load(text), file="topology.yaml")
    check(rewritten, "topology.yaml")
    tree = plan(rewritten, "topology.yaml")
    bundle["topology.yaml"] = (f"# {Path(file).name} as `aurora deploy --to {target}` ships it\n" + text).encode()

    units = []
    for i, n in enumerate(rewritten.nodes):
        extra = ["--store", STORE]
        port = None
        if n.listen is not None:
            port = _listen_port(n.listen, file, i)
            extra += ["--bind", f"tcp://{BIND_ALL}:{port}"]
        argv = node_argv(f"{CONF}/topology.yaml", n.name, *extra)
        argv[0] = "python3"  # the image's interpreter, not this one
        secrets = {f"{n.name}.key_secret": d / f"{n.name}.key_secret"}
        if n.name == trainer:
            secrets[f"{trainer}.sign"] = d / f"{trainer}.sign"
        for k, path in secrets.items():
            if not path.is_file():
                raise ConfigError(
                    f"{path} is missing: {n.name}'s {k} (aurora keys generate --topology {file})", file=file
                )
        gpus = getattr(topo.deploy.gpus, n.role)
        region = topo.region(n.region)
        units.append(
            Unit(
                n.name,
                n.role,
                n.region,
                dns[n.name],
                tuple(argv),
                port,
                gpus,
                _image(topo, gpus),
                secrets,
                region.cloud,
                region.cloud_region,
                dns[p] if (p := tree.parent[n.name]) is not None else None,
            )
        )
    notes = []
    for pool_name, count in (members or {}).items():
        units += _members(topo, file, pool_name, count, member_ttl_s, time.time() if now is None else now, dns)
        notes.append(
            f"pool {pool_name}: {count} members, each with a credential of its own (valid {member_ttl_s / 86400:g} days)"
        )
    if topo.model is not None and topo.model.fetch is not None and model_dir is None:
        notes.append(f"model: each node fetches {topo.model.fetch} into {MODEL} at its first start")
    has_model = topo.model is not None and topo.model.path is not None
    return Deployment(name, target, tuple(units), bundle, has_model, model_dir, topo.deploy.accelerator, notes)
