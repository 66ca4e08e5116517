"""`aurora bench sync`: time from a version's publication to the last rollout committing it.

On the WAN emulator: four regions (us, eu, asia, sa), one network namespace each;
the trainer's region (us) is joined to each other region by a 100 Mbit/s, 50 ms RTT
link (``tbf`` plus the userspace delay line); inside a region the nodes share the
namespace (loopback, fast). Each region has two rollout nodes; in a relay tree each
remote region also has one relay. Every node is a real ``aurora node`` process.

Four configurations per model size and density: full weights or deltas (the
topology's ``sync.full_weights``), sent as a star (every rollout a child of the
trainer) or down the relay tree (one WAN crossing per region). The time of a version
runs from the start of its publication (encoding included) to the last node's
commit; the median over the timed versions is reported.

Next to each: the lower bound — the bytes that must cross the busiest WAN link (one
copy per rollout behind it for a star, one copy for a tree) at the link rate, plus
the tree depth (1 for a star, 2 for a tree) times the WAN RTT — and the ratio to it;
and the floor, the same bytes plus a single one-way WAN delay, which no
implementation can beat (the bound allows a round trip per tree level).

The time is read from the nodes' logs — the trainer's ``version_published`` minus
its ``publish_s`` (the start of publication, encoding included) to the last
``version_committed`` of the other nodes: all processes share this host's clock.
Only versions whose publication began after every node held its first weights (the
snapshot a node gets on attaching) count, and the first of those is warm-up. (The
trainer's own live figure, ``version_synced``, also counts the commit notices' trip
back up, so it reads about one one-way delay higher.)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aurora.auth.keys import generate_topology_keys
from aurora.codec.decoder import blank_weights, receive
from aurora.codec.encoder import encode
from aurora.codec.warm import warm_up
from aurora.config.rl import SyntheticSpec
from aurora.config.topology import load_topology
from aurora.errors import AuroraError
from aurora.events import LEASE_RENEWED, NODE_STARTED, PARENT_ATTACHED, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.logs import event_time, read_events
from aurora.rl.learners.synthetic import SyntheticLearner
from aurora.runtime.processes import end_groups, group_cpu_s, node_argv, peak_rss_bytes, pss_bytes
from aurora.testing.wan import Host, Wan, unavailable_reason

REGIONS = ["us", "eu", "asia", "sa"]
ROLLOUTS_PER_REGION = 2
LINK_MBIT = 100.0
LINK_RTT_MS = 50.0
LAN_RTT_MS = 0.5
START_TIMEOUT_S = 180.0
RENEW_TTL_S = 4.0
"""The rollouts' lease TTL: a held lease is renewed every 2 s, so each timed version sees renewals."""
WORK_TOKEN_S = 0.5
"""The synthetic engine's seconds per token position: a batch takes 8 s, several renewals long."""


KINDS = ("full-star", "full-tree", "delta-star", "delta-tree")
"""The configurations, by name: what is sent (full weights or deltas) and how (a star or the relay tree)."""


@dataclass
class Config:
    params: int
    density: float
    full: bool
    tree: bool
    coding: str = "conditioned"
    """A delta's ``sync.coding`` (conditioned, sparse or auto); full weights are RAW chunks whatever it says."""
    rollouts: int = ROLLOUTS_PER_REGION
    """Rollout nodes per region."""

    @property
    def name(self) -> str:
        how = f"{'full' if self.full else 'delta'} {'relay tree' if self.tree else 'star'}"
        return how if self.full else f"{how} ({self.coding})"

    @property
    def nodes(self) -> int:
        """Nodes that receive every version (all but the trainer)."""
        return len(REGIONS) * self.rollouts + (len(REGIONS) - 1 if self.tree else 0)


@dataclass
class Result:
    config: Config
    bytes: int
    seconds: float
    versions: int
    lower_bound_s: float
    """Bytes over the busiest WAN link at the link rate, plus tree depth x the WAN RTT."""
    floor_s: float
    """The same bytes plus one one-way WAN delay: what even an instant node could not beat."""
    cpu_s: float
    """CPU seconds all nodes together used per version while it was timed (this host's cores are shared)."""
    encode_s: float
    decode_s: float
    """One version's encode and decode+commit, measured in the bench process, unloaded."""
    peak_node_mb: float = 0.0
    """The most resident memory one node held (its peak, MB)."""
    peak_sum_mb: float = 0.0
    """The most memory all nodes held at once (MB; their Pss added up, sampled every 0.5 s)."""
    renew_ms: list[float] = field(default_factory=list)
    """Every rollout's lease renewals while versions were timed: `Renew` to `Renewed`, ms."""

    @property
    def renew_p50_ms(self) -> float | None:
        return statistics.median(self.renew_ms) if self.renew_ms else None

    @property
    def renew_p99_ms(self) -> float | None:
        if not self.renew_ms:
            return None
        ranked = sorted(self.renew_ms)
        return ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]

    @property
    def ratio(self) -> float:
        return self.seconds / self.lower_bound_s


def _addr(region: int) -> str:
    return f"10.250.{region}.1"


def topology(c: Config, *, interval_s: float, steps: int) -> str:
    nodes = [f'  - {{name: trainer, role: trainer, region: us, listen: "tcp://{_addr(0)}:47000"}}']
    for r, region in enumerate(REGIONS):
        parent = "trainer"
        if r and c.tree:
            nodes.append(
                f"  - {{name: relay-{region}, role: relay, region: {region}, "
                f'listen: "tcp://{_addr(r)}:47001", parent: trainer}}'
            )
            parent = f"relay-{region}"
        nodes += [
            f"  - {{name: rollout-{region}-{i + 1}, role: rollout, region: {region}, parent: {parent}}}"
            for i in range(c.rollouts)
        ]
    wan = [f"  - {{regions: [us, {r}], bandwidth_mbit: {LINK_MBIT:g}, rtt_ms: {LINK_RTT_MS:g}}}" for r in REGIONS[1:]]
    return "\n".join(
        [
            f"name: bench-sync-{'full' if c.full else 'delta'}-{'tree' if c.tree else 'star'}",
            "regions:",
            *[f"  - {{name: {r}, rtt_ms: {LAN_RTT_MS:g}}}" for r in REGIONS],
            "wan:",
            *wan,
            "nodes:",
            *nodes,
            # generous liveness: two cores carry every node, and full-weight decodes are long
            "heartbeat: {interval_s: 0.5, suspect_after_s: 3.0, lost_after_s: 8.0}",
            "keys: {dir: keys}",  # the nodes listen on the emulator's private addresses: authenticated, signed
            f"learner: {{kind: synthetic, params: {c.params}, tensors: 8, density: {c.density}, interval_s: {interval_s}}}",
            f"sync: {{full_weights: {'true' if c.full else 'false'}, coding: {c.coding}}}",
            # leased work on every rollout (a synthetic engine: no model), so lease renewals cross the WAN
            # beside the versions and their latency is measured (RENEW_TTL_S: a renewal every half TTL)
            f"engine: {{kind: synthetic, max_new_tokens: 16, token_s: {WORK_TOKEN_S:g}}}",
            f"leases: {{ttl_s: {RENEW_TTL_S:g}, prompts_per_lease: 2, batch_s: 2.0}}",
            f"run: {{steps: {steps}}}",
            "",
        ]
    )


class _Cluster:
    """The configuration's nodes as processes in their regions' namespaces."""

    def __init__(self, hosts: dict[str, Host], c: Config, work: Path, interval_s: float, steps: int) -> None:
        self.hosts = hosts
        self.work = work
        self.path = work / "topology.yaml"
        self.path.write_text(topology(c, interval_s=interval_s, steps=steps))
        list(generate_topology_keys(load_topology(self.path), str(self.path)))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.peak_total_mb = 0.0
        """The most memory all nodes held at once, their Pss added up, sampled every 0.5 s while waiting (MB)."""
        self._polls = 0

    def start(self, name: str, region: str) -> None:
        argv = node_argv(self.path, name)
        with (self.work / f"{name}.log").open("wb") as err:
            self.procs[name] = self.hosts[region].popen(argv, stdout=subprocess.DEVNULL, stderr=err)

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.work / f"{name}.log") if e.get("event") == event]

    def wait(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            for n, p in self.procs.items():
                if p.poll() is not None:
                    tail = (self.work / f"{n}.log").read_text(errors="replace")[-1500:]
                    raise AuroraError(f"bench sync: node {n!r} exited with {p.returncode} ({what}): {tail}")
            if time.monotonic() > deadline:
                raise AuroraError(f"bench sync: timed out waiting for {what} (logs in {self.work})")
            self._polls += 1
            if self._polls % 5 == 0:  # every 0.5 s: reading a big process's page tables is not free
                self.peak_total_mb = max(
                    self.peak_total_mb, sum(pss_bytes(p.pid) or 0 for p in self.procs.values()) / 1e6
                )
            time.sleep(0.1)

    def stop(self) -> None:
        end_groups(self.procs.values())

    def cpu_s(self) -> float:
        """CPU seconds used so far by every node (each node's process group)."""
        return group_cpu_s({p.pid for p in self.procs.values()})

    def peaks_mb(self) -> list[float]:
        """Each running node's peak resident memory so far (MB)."""
        return [b / 1e6 for p in self.procs.values() if (b := peak_rss_bytes(p.pid)) is not None]


def calibrate(c: Config) -> tuple[float, float]:
    """(encode, decode) seconds of one version of this size and density in this process, unloaded."""
    warm_up()
    learner = SyntheticLearner(SyntheticSpec(params=c.params, tensors=8, density=c.density))
    base = learner.initial().copy()
    new = learner.step()
    t0 = time.perf_counter()
    d = encode(None if c.full else base, new, base_version=None if c.full else 0, target_version=1)
    t1 = time.perf_counter()
    held = base.copy()
    held.digest()
    t2 = time.perf_counter()
    receive(d.manifest, d.chunks).stage(None if c.full else held).commit(
        held if not c.full else blank_weights(d.manifest)
    )
    return t1 - t0, time.perf_counter() - t2


def measure(hosts: dict[str, Host], c: Config, work: Path, *, versions: int, progress: Callable[[str], None]) -> Result:
    size = c.params * 2  # bf16
    copies = c.rollouts if not c.tree else 1
    est = (size if c.full else size * c.density * 4) * copies / (LINK_MBIT * 1e6 / 8)
    enc, dec = calibrate(c)
    cpu = enc + c.nodes * dec / (os.cpu_count() or 1)
    # versions far enough apart that one is done before the next: the time is one version's, not a queue's
    # (full weights: the wire dominates and is known; 1.5x is margin enough for a version of minutes)
    interval = max(2.0, (1.5 if c.full else 3.0) * (cpu + est) + 1.0)
    steps = 1_000_000  # the trainer keeps publishing; the cluster is stopped once enough versions are timed
    cl = _Cluster(hosts, c, work, interval, steps)
    progress(
        f"  {c.name}: {c.params / 1e6:g}M params, density {c.density:g}, a version every {interval:.1f} s "
        f"(calibrated: encode {enc * 1e3:.0f} ms, decode {dec * 1e3:.0f} ms)"
    )
    try:
        cl.start("trainer", "us")
        cl.wait(lambda: bool(cl.events("trainer", NODE_STARTED)), START_TIMEOUT_S, "the trainer to start")
        relays = [(f"relay-{r}", r) for r in REGIONS[1:]] if c.tree else []
        for n, r in relays:
            cl.start(n, r)
        cl.wait(lambda: all(cl.events(n, PARENT_ATTACHED) for n, _ in relays), START_TIMEOUT_S, "the relays")
        rollouts = [(f"rollout-{r}-{i + 1}", r) for r in REGIONS for i in range(c.rollouts)]
        for n, r in rollouts:
            cl.start(n, r)
        cl.wait(lambda: all(cl.events(n, PARENT_ATTACHED) for n, _ in rollouts), START_TIMEOUT_S, "the rollouts")
        others = [n for n, _ in relays + rollouts]
        # ready once every node holds weights (its first commit: the snapshot it got on attaching)
        cl.wait(
            lambda: all(cl.events(n, VERSION_COMMITTED) for n in others),
            START_TIMEOUT_S + 20 * est,
            "every node's first weights",
        )
        ready = max(event_time(cl.events(n, VERSION_COMMITTED)[0]) for n in others)

        def timed() -> dict[int, tuple[int, float]]:
            """version -> (bytes, publication start to the last commit), from the logs (one clock: one host)."""
            commits: dict[int, list[float]] = {}
            for n in others:
                for e in cl.events(n, VERSION_COMMITTED):
                    commits.setdefault(e["version"], []).append(event_time(e))
            out = {}
            for e in cl.events("trainer", VERSION_PUBLISHED):
                began, got = event_time(e) - float(e["publish_s"]), commits.get(e["version"], [])
                if began > ready and len(got) == len(others):
                    out[e["version"]] = (int(e["bytes"]), max(got) - began)
            return dict(sorted(out.items())[1:])  # the first one after attaching is warm-up

        cl.wait(lambda: len(timed()) >= 1, 2 * interval + 2 * est + 60, "the warm-up version")
        cpu0, n0 = cl.cpu_s(), len(cl.events("trainer", VERSION_PUBLISHED))
        cl.wait(lambda: len(timed()) >= versions, (versions + 2) * (interval + 2 * est + 30), f"{versions} versions")
        cpu_per_version = (cl.cpu_s() - cpu0) / max(1, len(cl.events("trainer", VERSION_PUBLISHED)) - n0)
        renew_ms = [
            float(e["rtt_ms"]) for n, _ in rollouts for e in cl.events(n, LEASE_RENEWED) if event_time(e) > ready
        ]
        counted = list(timed().values())[:versions]
        nbytes = int(statistics.median(b for b, _ in counted))
        secs = statistics.median(t for _, t in counted)
        peaks = cl.peaks_mb()
    finally:
        cl.stop()
    depth = 2 if c.tree else 1
    rate = LINK_MBIT * 1e6 / 8
    lower = nbytes * copies / rate + depth * LINK_RTT_MS / 1e3
    floor = nbytes * copies / rate + LINK_RTT_MS / 2e3
    return Result(
        c,
        nbytes,
        secs,
        len(counted),
        lower,
        floor,
        cpu_per_version,
        enc,
        dec,
        max(peaks, default=0.0),
        cl.peak_total_mb,
        renew_ms,
    )


def _emulator() -> tuple[Wan, dict[str, Host]]:
    wan = Wan()
    try:
        hosts = {r: wan.host(r) for r in REGIONS}
        hosts["us"].add_address(_addr(0))
        for i, r in enumerate(REGIONS[1:], start=1):
            link = wan.link(hosts["us"], hosts[r], rate_mbit=LINK_MBIT, rtt_ms=LINK_RTT_MS, seed=i)
            hosts[r].add_address(_addr(i))
            hosts["us"].route(_addr(i), link.dev_of(hosts["us"]))
            hosts[r].route(_addr(0), link.dev_of(hosts[r]))
        return wan, hosts
    except BaseException:
        wan.close()
        raise


def configs(
    params: list[int],
    densities: list[float],
    *,
    kinds: Sequence[str] = KINDS,
    codings: Sequence[str] = ("auto",),
    rollouts: int = ROLLOUTS_PER_REGION,
) -> list[Config]:
    """What to measure, in order: per size, the full-weight kinds once (they do not depend on the
    density or the coding), then each delta kind per density and coding."""
    out = []
    for p in params:
        out += [Config(p, densities[0], True, k == "full-tree", rollouts=rollouts) for k in KINDS[:2] if k in kinds]
        out += [
            Config(p, d, False, k == "delta-tree", coding, rollouts)
            for d in densities
            for coding in codings
            for k in KINDS[2:]
            if k in kinds
        ]
    return out


def run(plan: list[Config], *, versions: int = 3, progress: Callable[[str], None] = print) -> list[Result]:
    reason = unavailable_reason()
    if reason is not None:
        raise AuroraError(f"bench sync needs the WAN emulator: {reason}")
    results: list[Result] = []
    wan, hosts = _emulator()
    progress(
        f"WAN emulator: {' '.join(REGIONS)}; us <-> each other region {LINK_MBIT:g} Mbit/s, {LINK_RTT_MS:g} ms RTT"
    )
    with wan, tempfile.TemporaryDirectory(prefix="aurora-bench-sync-") as tmp:
        for i, c in enumerate(plan):
            work = Path(tmp) / f"{c.params}-{i}"
            work.mkdir()
            results.append(measure(hosts, c, work, versions=versions, progress=progress))
            r = results[-1]
            progress(
                f"    {r.seconds * 1e3:.0f} ms (lower bound {r.lower_bound_s * 1e3:.0f} ms, floor {r.floor_s * 1e3:.0f} ms), "
                f"{r.bytes / 1e6:.2f} MB per version; peak memory {r.peak_node_mb:.0f} MB in one node, "
                f"{r.peak_sum_mb:.0f} MB all nodes at once; lease renewal {_ms(r.renew_p50_ms)} ms median, "
                f"{_ms(r.renew_p99_ms)} ms p99 ({len(r.renew_ms)} renewals)"
            )
    return results


def table(results: list[Result]) -> str:
    cores = os.cpu_count() or 1
    width = max([len(r.config.name) for r in results] + [16])
    head = (
        f"{'params':>7} {'density':>7}  {'config':<{width}} {'nodes':>5} {'MB/version':>10} {'time ms':>8} "
        f"{'bound ms':>8} {'ratio':>5} {'floor ms':>8} {'vs full star':>12}  {'CPU s/version':>13} {'enc ms':>6} "
        f"{'dec ms':>6} {'peak MB':>8} {'all MB':>7} {'renew p50':>9} {'renew p99':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        full_star = next(
            (x for x in results if x.config.params == r.config.params and x.config.full and not x.config.tree), None
        )
        vs = f"{full_star.seconds / r.seconds:>11.1f}x" if full_star is not None else f"{'-':>12}"
        density = "-" if r.config.full else f"{r.config.density:g}"
        lines.append(
            f"{r.config.params / 1e6:>6g}M {density:>7}  {r.config.name:<{width}} {r.config.nodes + 1:>5} "
            f"{r.bytes / 1e6:>10.3f} {r.seconds * 1e3:>8.0f} {r.lower_bound_s * 1e3:>8.0f} {r.ratio:>5.2f} "
            f"{r.floor_s * 1e3:>8.0f} {vs}  {r.cpu_s:>13.2f} {r.encode_s * 1e3:>6.0f} "
            f"{r.decode_s * 1e3:>6.0f} {r.peak_node_mb:>8.0f} {r.peak_sum_mb:>7.0f} "
            f"{_ms(r.renew_p50_ms):>9} {_ms(r.renew_p99_ms):>9}"
        )
    lines.append(
        f"CPU s/version: all nodes' CPU per version while timed, on this host's {cores} cores; enc/dec: one "
        "version's encode and decode+commit on one core, unloaded (conditioned coding);"
    )
    lines.append(
        "peak MB: the most resident memory one node held; all MB: the most all nodes held at once "
        "(their proportional set sizes added up, sampled every 0.5 s);"
    )
    lines.append(
        "renew p50/p99: ms from a rollout's lease renewal to its answer, every rollout, while the versions were "
        "timed (work and control messages travel in a lane of their own: docs/transport.md)."
    )
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
