"""Topology files: regions, WAN links, nodes and the relay tree, loaded strictly.

`load_topology(path)` parses YAML (``safe_load``), converts it with
`aurora.config.strict` (unknown keys and wrong types name their path) and then
checks what spans objects, each error naming the path of the offending field:

* names are unique (regions, nodes); every region a node or link names exists;
* exactly one trainer; it has no parent; every relay and rollout has a parent
  (a node name or ``auto``) that is the trainer or a relay, never itself;
* explicit parents form no cycle and every chain ends at the trainer;
* fallback parents exist, are trainers or relays, and are not the node itself;
* a node that is (or may become) a parent has a ``listen`` address, and no two
  nodes listen on the same address;
* CurveZMQ keys are given for every node or for none; a WebRTC rendezvous exists;
* a pool's name is no node's, its parents are the trainer or relays, it has keys (and a pool key),
  and no node's name looks like one of its members'.

`aurora.config.plan` then turns ``parent: auto`` into a tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from aurora.config.rl import (
    ArithmeticSpec,
    DatasetSpec,
    EngineSpec,
    GrpoSpec,
    JsonlSpec,
    LearnerSpec,
    ModelSpec,
    SyntheticSpec,
    TaskSpec,
    resolve_paths,
)
from aurora.config.strict import convert
from aurora.errors import ConfigError
from aurora.protocol.liveness import timing_problem
from aurora.protocol.messages import MAX_NODES, MAX_STATS, NAME_PATTERN, POOL_NAME_PATTERN

Role = Literal["trainer", "relay", "rollout"]
AUTO = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    name: str
    bandwidth_mbit: float = 10_000.0
    """Bandwidth between two nodes inside the region."""
    rtt_ms: float = 0.5
    """Round trip between two nodes inside the region."""
    cloud: str | None = None
    """Where `aurora deploy --to skypilot` launches the region's nodes: a SkyPilot cloud (``aws``, ``gcp``,
    ``azure``, ``kubernetes``, ...); None: SkyPilot chooses."""
    cloud_region: str | None = None
    """The cloud's own name of the region (``us-east-1``): SkyPilot's ``region``, and the Kubernetes node
    label ``topology.kubernetes.io/region`` the region's pods are scheduled by (default: ``name``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WanLink:
    regions: tuple[str, ...]
    """The two regions this link joins."""
    bandwidth_mbit: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if len(self.regions) != 2 or self.regions[0] == self.regions[1]:
            raise ConfigError(f"a WAN link joins two different regions, got {list(self.regions)}", path="regions")
        if self.bandwidth_mbit <= 0:
            raise ConfigError("must be > 0", path="bandwidth_mbit")
        if self.rtt_ms < 0:
            raise ConfigError("must be >= 0", path="rtt_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class IceServerSpec:
    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqSpec:
    kind: Literal["zmq"] = "zmq"


@dataclass(frozen=True, slots=True, kw_only=True)
class WebRtcSpec:
    kind: Literal["webrtc"] = "webrtc"
    ice_servers: tuple[IceServerSpec, ...] = ()
    """STUN/TURN servers; none means host candidates only."""
    rendezvous: str | None = None
    """The node that relays signalling (default: the parent)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    name: str
    role: Role
    region: str
    listen: str | None = None
    """``tcp://host:port`` the node binds for its children (trainer and relays)."""
    parent: str | None = None
    """A node name, or ``auto`` to have the planner choose; none for the trainer."""
    fallback_parents: tuple[str, ...] | None = None
    """Ordered parents to re-attach to when the parent is lost (planned when omitted)."""
    transport: ZmqSpec | WebRtcSpec = field(default_factory=ZmqSpec)
    """How this node reaches its parent."""
    public_key: str | None = None
    """CurveZMQ public key (Z85, 40 characters)."""
    secret_key_file: str | None = None
    """The node's CurveZMQ secret key file (from ``aurora keys generate``)."""
    egress_mbit: float | None = None
    """The node's own sending limit (default: its region's bandwidth)."""
    engine: EngineSpec | None = None
    """A rollout's own engine, for a machine of another kind (default: the topology's ``engine``); its
    ``max_new_tokens`` and ``temperature`` must be the topology's (the trainer judges results by them)."""

    def __post_init__(self) -> None:
        if self.engine is not None and self.role != "rollout":
            raise ConfigError(f"only a rollout runs an engine, not a {self.role}", path="engine")
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ConfigError(
                f"node name {self.name!r} must be letters, digits, '-', '_' or '.' (at most 64, "
                "starting with a letter or digit)",
                path="name",
            )
        if self.name == "operator":
            raise ConfigError("'operator' is the name of the status key, not a node", path="name")
        if self.role == "trainer" and self.parent is not None:
            raise ConfigError("the trainer has no parent", path="parent")
        if self.role != "trainer" and self.parent is None:
            raise ConfigError(f"a {self.role} needs a parent (a node name, or auto)", path="parent")
        if (self.public_key is None) != (self.secret_key_file is None):
            raise ConfigError("public_key and secret_key_file come together", path="secret_key_file")
        if self.public_key is not None and len(self.public_key) != 40:
            raise ConfigError("expected a 40-character Z85 CurveZMQ key", path="public_key")


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSpec:
    interval_s: float = 0.5
    suspect_after_s: float = 1.5
    lost_after_s: float = 3.0

    def __post_init__(self) -> None:
        problem = timing_problem(self.interval_s, self.suspect_after_s, self.lost_after_s)
        if problem is not None:
            raise ConfigError(problem)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseSpec:
    ttl_s: float = 30.0
    prompts_per_lease: int = 8
    """The most prompts one grant gives a worker."""
    batch_s: float = 2.0
    """Seconds of work a grant aims at, by the worker's measured rate (a worker not yet measured gets 1)."""
    ahead_steps: int = 2
    """Prompts leased or waiting for the learner stay within this many learner steps' worth, so workers
    generate what the learner will use before it goes stale instead of racing ahead (0: no bound)."""
    max_life_s: float | None = None
    """Seconds a lease may be renewed for at most, while its worker's speed is not yet measured (default: 8
    TTLs); a measured worker's leases live 4x what its rate says they take, within [2 TTL, this]. Renewing
    past it does nothing: a worker cannot hold prompts without answering them (docs/security.md)."""

    def __post_init__(self) -> None:
        if self.max_life_s is not None and not self.max_life_s >= 2 * self.ttl_s:
            raise ConfigError(f"must be at least 2 TTLs ({2 * self.ttl_s} s)", path="max_life_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class StalenessSpec:
    max_versions: int = 1
    """Samples may come from versions v-k .. v (k = max_versions)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    payload_mib: float = 32.0
    """Delta size the planner optimises the tree for."""


SyncCoding = Literal["conditioned", "sparse", "auto"]
SYNC_CODINGS: tuple[str, ...] = get_args(SyncCoding)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncSpec:
    full_weights: bool = False
    """Send every version as full weights instead of a delta: the baseline `aurora bench sync` measures."""
    deliver: bool = True
    """False: the trainer keeps its versions to itself (rollouts stay on the version they first got).
    Only for the sync-free ideal that `aurora bench rl` compares against; not a way to train."""
    coding: SyncCoding = "conditioned"
    """How the trainer codes changed positions: ``conditioned`` (ranks in base-exponent buckets, the fewest
    bytes), ``sparse`` (gaps and values: ~4x the bytes, O(changes) to apply), ``auto`` (per tensor, by the
    link and this machine's measured codec speed; `aurora.actors.coding`)."""
    link_mbit: float | None = None
    """With ``coding: auto``: the bandwidth the rule assumes (default: the slowest link of the planned tree)."""

    def __post_init__(self) -> None:
        if self.link_mbit is not None and not self.link_mbit > 0:
            raise ConfigError("must be > 0", path="link_mbit")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeysSpec:
    """Where the topology's keys are (`aurora.auth.keys`): CurveZMQ pairs for every node, the
    trainer's Ed25519 signing pair."""

    dir: str | None = None
    """A key directory, relative to the topology file: ``NODE.key``/``NODE.key_secret`` for every node,
    ``TRAINER.sign_pub``/``TRAINER.sign`` for the trainer (``aurora keys generate --topology`` writes them)."""
    signing_key: str | None = None
    """The trainer's Ed25519 public key (64 hex digits), instead of ``TRAINER.sign_pub`` in ``dir``."""
    signing_key_file: str | None = None
    """On the trainer: its Ed25519 secret key (PEM), instead of ``TRAINER.sign`` in ``dir``."""

    def __post_init__(self) -> None:
        if self.dir is None and self.signing_key is None:
            raise ConfigError("name a key directory (dir) or the trainer's signing_key", path="dir")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """An elastic pool of rollout workers (`aurora.auth.pool`): machines that hold a credential certified
    by the pool's key join and leave at any time, under names their keys decide."""

    name: str
    parents: tuple[str, ...]
    """Where members attach, in order (the first is each member's planned parent, the rest its fallbacks):
    the trainer or relays, each with a ``listen`` address."""
    max_size: int
    """Members at most at once, across all of its parents (the trainer admits each one)."""
    region: str | None = None
    """The members' region (default: the first parent's)."""
    key: str | None = None
    """The pool's Ed25519 public key (64 hex digits), instead of ``POOL.pool_pub`` in ``keys.dir``."""
    revoked: tuple[str, ...] = ()
    """Member names (``POOL.xxxxxxxxxxxxxxxx``) refused however valid their credential (the parents read
    this at start)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(POOL_NAME_PATTERN, self.name):
            raise ConfigError(
                f"pool name {self.name!r} must be letters, digits, '-' or '_' (at most 40, starting with a "
                "letter or digit)",
                path="name",
            )
        if not self.parents:
            raise ConfigError("a pool needs at least one parent", path="parents")
        if len(set(self.parents)) != len(self.parents):
            raise ConfigError("a parent is named twice", path="parents")
        if not 1 <= self.max_size <= 4096:
            raise ConfigError("must be 1..4096", path="max_size")
        for i, m in enumerate(self.revoked):
            if not re.fullmatch(re.escape(self.name) + r"\.[0-9a-f]{16}", m):
                raise ConfigError(f"{m!r} is not a member name of pool {self.name!r}", path=f"revoked[{i}]")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleCounts:
    """A count for each role."""

    trainer: int = 0
    relay: int = 0
    rollout: int = 0

    def __post_init__(self) -> None:
        for role in ("trainer", "relay", "rollout"):
            if getattr(self, role) < 0:
                raise ConfigError("must be >= 0", path=role)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeploySpec:
    """How `aurora deploy` runs the nodes on real machines (`aurora.deploy`)."""

    image: str = "aurora:cpu"
    """The container image of nodes without GPUs (`docker/cpu.Dockerfile`)."""
    gpu_image: str = "aurora:cuda"
    """The container image of nodes with GPUs (`docker/cuda.Dockerfile`)."""
    gpus: RoleCounts = field(default_factory=RoleCounts)
    """GPUs each node of a role asks for (e.g. ``{trainer: 1, rollout: 1}``); relays need none."""
    accelerator: str | None = None
    """The GPU type SkyPilot asks for (``L4``, ``A100``, ``H100``); needed with GPUs for ``--to skypilot``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    steps: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    name: str
    regions: tuple[Region, ...]
    nodes: tuple[NodeSpec, ...]
    wan: tuple[WanLink, ...] = ()
    heartbeat: HeartbeatSpec = field(default_factory=HeartbeatSpec)
    leases: LeaseSpec = field(default_factory=LeaseSpec)
    staleness: StalenessSpec = field(default_factory=StalenessSpec)
    plan: PlanSpec = field(default_factory=PlanSpec)
    run: RunSpec = field(default_factory=RunSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    model: ModelSpec | None = None
    """The model every node runs; None: the engines' and learner's own."""
    task: TaskSpec = field(default_factory=ArithmeticSpec)
    """The RL task (default arithmetic)."""
    learner: LearnerSpec = field(default_factory=SyntheticSpec)
    """The learner: grpo, or synthetic (the default, a load generator)."""
    engine: EngineSpec | None = None
    """The rollout nodes' engine; None: rollout nodes only relay (no worker)."""
    keys: KeysSpec | None = None
    """CurveZMQ and signing keys (see also each node's ``public_key``/``secret_key_file``); None: no keys."""
    deploy: DeploySpec = field(default_factory=DeploySpec)
    """Images and GPUs for `aurora deploy`."""
    pools: tuple[PoolSpec, ...] = ()
    """Elastic pools of rollout workers besides the named nodes (they need keys)."""

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def trainer(self) -> NodeSpec:
        return next(n for n in self.nodes if n.role == "trainer")

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def pool_region(self, pool: PoolSpec) -> str:
        return pool.region or self.node(pool.parents[0]).region

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(bandwidth_mbit, rtt_ms) between regions ``a`` and ``b``."""
        if a == b:
            r = self.region(a)
            return r.bandwidth_mbit, r.rtt_ms
        for w in self.wan:
            if set(w.regions) == {a, b}:
                return w.bandwidth_mbit, w.rtt_ms
        raise KeyError((a, b))


def load_topology(path: str | Path) -> Topology:
    """Load and check a topology file; raises `ConfigError` naming the file and the path."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", file=file) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", file=file) from None
    topo = convert(Topology, data, file=file)
    task, model, learner, engine = resolve_paths(topo.task, topo.model, topo.learner, topo.engine, file)
    nodes = tuple(
        n if n.engine is None else replace(n, engine=resolve_paths(task, model, learner, n.engine, file)[3])
        for n in topo.nodes
    )
    topo = replace(topo, task=task, model=model, learner=learner, engine=engine, nodes=nodes)
    check(topo, file)
    return topo


def check(t: Topology, file: str | None = None) -> None:
    """The cross-object rules of the module docstring."""

    def fail(path: str, msg: str) -> ConfigError:
        return ConfigError(msg, file=file, path=path)

    if isinstance(t.learner, GrpoSpec) and t.learner.eval.every:
        if isinstance(t.task, JsonlSpec):
            raise fail(
                "learner.eval.every", "a jsonl task holds no prompts out to evaluate on (use task kind: dataset)"
            )
        if isinstance(t.task, DatasetSpec | ArithmeticSpec) and t.task.heldout == 0:
            raise fail("learner.eval.every", "task.heldout is 0: no prompts are held out to evaluate on")
    regions = [r.name for r in t.regions]
    _unique(regions, "regions", "name", fail)
    names = [n.name for n in t.nodes]
    _unique(names, "nodes", "name", fail)
    index = {n.name: i for i, n in enumerate(t.nodes)}
    for i, w in enumerate(t.wan):
        for r in w.regions:
            if r not in regions:
                raise fail(f"wan[{i}].regions", f"no region named {r!r}")
    for i, n in enumerate(t.nodes):
        if n.region not in regions:
            raise fail(f"nodes[{i}].region", f"no region named {n.region!r}")
        if n.engine is not None:
            if t.engine is None:
                raise fail(f"nodes[{i}].engine", "a rollout's own engine needs the topology's engine beside it")
            if n.engine.model != t.engine.model:
                raise fail(f"nodes[{i}].engine.model", "a rollout serves the trainer's model: the topology's")
            for key in ("max_new_tokens", "temperature"):
                if getattr(n.engine, key) != getattr(t.engine, key):
                    raise fail(
                        f"nodes[{i}].engine.{key}",
                        f"{getattr(n.engine, key)} is not the topology's engine.{key} "
                        f"{getattr(t.engine, key)} (the trainer judges every result by it)",
                    )
    trainers = [i for i, n in enumerate(t.nodes) if n.role == "trainer"]
    if len(trainers) != 1:
        raise fail("nodes", f"need exactly one trainer, found {len(trainers)}")
    for i, n in enumerate(t.nodes):
        for j, p in [(None, n.parent), *enumerate(n.fallback_parents or ())]:
            if p is None or (p == AUTO and j is None):
                continue
            where = f"nodes[{i}].parent" if j is None else f"nodes[{i}].fallback_parents[{j}]"
            if p not in index:
                raise fail(where, f"no node named {p!r}")
            if p == n.name:
                raise fail(where, f"{n.name!r} cannot be its own parent")
            if t.nodes[index[p]].role == "rollout":
                raise fail(where, f"{p!r} is a rollout node; parents are the trainer or relays")
        rdv = n.transport.rendezvous if isinstance(n.transport, WebRtcSpec) else None
        if rdv is not None and rdv not in index:
            raise fail(f"nodes[{i}].transport.rendezvous", f"no node named {rdv!r}")
        # a parent in another region needs a declared WAN link (checked on the planned tree too)
        if n.parent not in (None, AUTO) and t.nodes[index[n.parent]].region != n.region:
            try:
                t.link(n.region, t.nodes[index[n.parent]].region)
            except KeyError:
                raise fail(
                    f"nodes[{i}].parent",
                    f"no wan link between regions {n.region!r} and {t.nodes[index[n.parent]].region!r}",
                ) from None
    for i, n in enumerate(t.nodes):  # explicit chains reach the trainer
        seen = [n.name]
        cur = n
        while cur.parent not in (None, AUTO):
            cur = t.nodes[index[cur.parent]]
            if cur.name in seen:
                raise fail(f"nodes[{i}].parent", f"cycle: {' -> '.join([*seen, cur.name])}")
            seen.append(cur.name)
    listen: dict[str, int] = {}
    for i, n in enumerate(t.nodes):
        if n.role != "rollout" and n.listen is None:
            raise fail(f"nodes[{i}].listen", f"the {n.role} {n.name!r} needs a listen address for its children")
        if n.listen is not None:
            if n.listen in listen:
                raise fail(f"nodes[{i}].listen", f"{n.listen} is also nodes[{listen[n.listen]}].listen")
            listen[n.listen] = i
    keyed = [i for i, n in enumerate(t.nodes) if n.public_key is not None]
    if (keyed or t.keys is not None) and len(keyed) != len(t.nodes) and (t.keys is None or t.keys.dir is None):
        missing = next(i for i, n in enumerate(t.nodes) if n.public_key is None)
        raise fail(
            f"nodes[{missing}].public_key",
            "CurveZMQ keys are set for some nodes: set them for every node (or name a keys.dir that holds them)",
        )
    _check_pools(t, index, fail)
    if keyed and t.keys is None:
        raise fail(
            "keys",
            "CurveZMQ keys need the trainer's signing key too: set keys.dir or keys.signing_key "
            "(`aurora keys generate --topology` writes a key directory)",
        )


def _check_pools(t: Topology, index: dict[str, int], fail: Any) -> None:
    _unique([p.name for p in t.pools], "pools", "name", fail)
    if len(t.pools) > MAX_STATS:
        raise fail("pools", f"{len(t.pools)} pools (at most {MAX_STATS})")
    if len(t.nodes) + sum(p.max_size for p in t.pools) > MAX_NODES:
        raise fail("pools", f"the named nodes and the pools' max_size add up to more than {MAX_NODES} nodes")
    regions = {r.name for r in t.regions}
    for i, pool in enumerate(t.pools):
        if pool.name in index:
            raise fail(f"pools[{i}].name", f"{pool.name!r} is also the name of nodes[{index[pool.name]}]")
        for j, p in enumerate(pool.parents):
            if p not in index:
                raise fail(f"pools[{i}].parents[{j}]", f"no node named {p!r}")
            if t.nodes[index[p]].role == "rollout":
                raise fail(f"pools[{i}].parents[{j}]", f"{p!r} is a rollout; members attach to the trainer or a relay")
        if pool.region is not None and pool.region not in regions:
            raise fail(f"pools[{i}].region", f"no region named {pool.region!r}")
        if t.keys is None:
            raise fail(
                f"pools[{i}]",
                "a pool needs keys: its members are known by their certified CurveZMQ keys "
                "(set keys.dir; `aurora keys generate --topology` makes them)",
            )
        if pool.key is None and t.keys.dir is None:
            raise fail(f"pools[{i}].key", "no pool key: set pools[].key or keys.dir (which holds POOL.pool_pub)")
        for n in t.nodes:
            if n.name.startswith(pool.name + "."):
                raise fail(f"nodes[{index[n.name]}].name", f"{n.name!r} looks like a member of pool {pool.name!r}")


def _unique(values: list[str], section: str, key: str, fail: Any) -> None:
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        if v in seen:
            raise fail(f"{section}[{i}].{key}", f"{v!r} is also {section}[{seen[v]}].{key}")
        seen[v] = i
