"""The relay tree: explicit parents kept, ``parent: auto`` planned by estimated time-to-all.

Cost model (documented so the plan can be checked by hand). A payload of ``S``
bytes flows down the tree cut-through. A parent ``p`` sends to its ``k``
children at once, so a child ``c`` receives at

    rate(p→c) = min(egress(p) / k,  link(p, c) / k_wan,  rate(into p))

where ``egress(p)`` is the node's own limit (default its region's bandwidth),
``link`` the region's bandwidth or the declared WAN link between the two
regions, and ``k_wan`` the number of tree edges that cross that same WAN link
(whatever their parents: they share it; 1 inside a region). A child starts half a round
trip after its parent and finishes ``S / rate`` later; the tree's time-to-all is
the latest finish. This is why one relay per remote region wins: children in
that region then share fast local links instead of the WAN link.

The planner attaches ``auto`` nodes one at a time (relays first, then rollouts,
each in name order) to the parent that minimises the time-to-all of the nodes
placed so far; it then compares the result with the all-to-the-trainer star
and keeps the faster. Fallback parents not given are the next-best parents
that are not in the node's own subtree. Pure and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora.config.topology import AUTO, NodeSpec, Topology
from aurora.errors import ConfigError

MAX_FALLBACKS = 2


@dataclass(frozen=True, slots=True)
class Tree:
    parent: dict[str, str | None]
    fallbacks: dict[str, tuple[str, ...]]
    finish_s: dict[str, float]
    """Estimated time from publication until each node holds the payload."""
    payload_bytes: int

    @property
    def time_to_all_s(self) -> float:
        return max(self.finish_s.values())

    def children(self, name: str) -> list[str]:
        return sorted(c for c, p in self.parent.items() if p == name)

    def depth(self) -> int:
        def d(n: str) -> int:
            p = self.parent[n]
            return 0 if p is None else 1 + d(p)

        return max(d(n) for n in self.parent)

    def render(self, topo: Topology) -> str:
        root = topo.trainer.name
        lines = [self._label(topo, root)]

        def walk(n: str, prefix: str) -> None:
            kids = self.children(n)
            for i, c in enumerate(kids):
                last = i == len(kids) - 1
                lines.append(f"{prefix}{'└── ' if last else '├── '}{self._label(topo, c)}")
                walk(c, prefix + ("    " if last else "│   "))

        walk(root, "")
        return "\n".join(lines)

    def _label(self, topo: Topology, name: str) -> str:
        n = topo.node(name)
        fb = f", fallback {', '.join(self.fallbacks[name])}" if self.fallbacks.get(name) else ""
        return f"{name} ({n.role}, {n.region}) ~{self.finish_s[name]:.2f} s{fb}"


def estimate(topo: Topology, parent: dict[str, str | None], payload_bytes: int) -> dict[str, float]:
    """Finish times of every node whose chain to the trainer is resolved (see the module docstring)."""
    return {
        n: start + (payload_bytes / rate if rate != float("inf") else 0.0)
        for n, (start, rate) in _inbound(topo, parent).items()
    }


def slowest_link_mbit(topo: Topology, tree: Tree) -> float:
    """The lowest rate at which any node of ``tree`` receives (Mbit/s, the cost model's): the link
    that sets how long a version's bytes take to reach every node."""
    rates = [r for r in _inbound(topo, tree.parent).values() if r[1] != float("inf")]
    return min((rate * 8 / 1e6 for _, rate in rates), default=topo.region(topo.trainer.region).bandwidth_mbit)


def _inbound(topo: Topology, parent: dict[str, str | None]) -> dict[str, tuple[float, float]]:
    """(start s, receive rate B/s) of every node whose chain to the trainer is resolved (the trainer: 0, inf)."""
    nodes = {n.name: n for n in topo.nodes}
    children: dict[str, list[str]] = {}
    for c, p in parent.items():
        if p is not None and p != AUTO:
            children.setdefault(p, []).append(c)
    crossings: dict[frozenset[str], int] = {}  # tree edges sharing each WAN link
    for c, p in parent.items():
        if p is not None and p != AUTO and nodes[c].region != nodes[p].region:
            key = frozenset((nodes[c].region, nodes[p].region))
            crossings[key] = crossings.get(key, 0) + 1
    root = topo.trainer.name
    stack: list[tuple[str, float, float]] = [(root, 0.0, float("inf"))]  # node, start, inbound rate
    out: dict[str, tuple[float, float]] = {root: (0.0, float("inf"))}
    while stack:
        p, start, inrate = stack.pop()
        kids = children.get(p, [])
        np_ = nodes[p]
        egress = _bytes_s(np_.egress_mbit or topo.region(np_.region).bandwidth_mbit)
        for c in kids:
            nc = nodes[c]
            bw_mbit, rtt_ms = topo.link(np_.region, nc.region)
            share = crossings[frozenset((np_.region, nc.region))] if nc.region != np_.region else 1
            rate = min(egress / len(kids), _bytes_s(bw_mbit) / share, inrate)
            c_start = start + rtt_ms / 2000
            out[c] = (c_start, rate)
            stack.append((c, c_start, rate))
    return out


def _bytes_s(mbit: float) -> float:
    return mbit * 1e6 / 8


def _reachable(topo: Topology, a: NodeSpec, b: NodeSpec) -> bool:
    try:
        topo.link(a.region, b.region)
    except KeyError:
        return False
    return True


def _subtree(parent: dict[str, str | None], root: str) -> set[str]:
    out = {root}
    changed = True
    while changed:
        changed = False
        for c, p in parent.items():
            if p in out and c not in out:
                out.add(c)
                changed = True
    return out


def _cost(topo: Topology, parent: dict[str, str | None], payload: int) -> float:
    f = estimate(topo, parent, payload)
    return max(f.values())


def plan(topo: Topology, file: str | None = None) -> Tree:
    """Resolve ``auto`` parents and fallbacks; raises `ConfigError` where a node has no usable parent."""
    payload = int(topo.plan.payload_mib * (1 << 20))
    index = {n.name: i for i, n in enumerate(topo.nodes)}
    parents = [n for n in topo.nodes if n.role != "rollout"]
    auto = sorted((n for n in topo.nodes if n.parent == AUTO), key=lambda n: (n.role != "relay", n.name))

    def candidates(n: NodeSpec, parent: dict[str, str | None]) -> list[str]:
        mine = _subtree(parent, n.name)
        return [m.name for m in parents if m.name not in mine and parent.get(m.name) != AUTO and _reachable(topo, m, n)]

    greedy: dict[str, str | None] = {n.name: n.parent for n in topo.nodes}
    for n in auto:
        options = candidates(n, greedy)
        if not options:
            raise ConfigError(
                f"no trainer or relay that {n.name!r} can reach (declare a wan link)",
                file=file,
                path=f"nodes[{index[n.name]}].parent",
            )
        greedy[n.name] = min(options, key=lambda m: (_cost(topo, {**greedy, n.name: m}, payload), m))
    best = greedy
    root = topo.trainer.name
    if all(_reachable(topo, topo.trainer, n) for n in auto):
        star = {n.name: (root if n.parent == AUTO else n.parent) for n in topo.nodes}
        if _cost(topo, star, payload) < _cost(topo, greedy, payload):
            best = star
    fallbacks: dict[str, tuple[str, ...]] = {}
    for n in topo.nodes:
        if n.role == "trainer":
            continue
        mine = _subtree(best, n.name)
        if n.fallback_parents is not None:
            for j, f in enumerate(n.fallback_parents):
                if f in mine:
                    raise ConfigError(
                        f"{f!r} is in {n.name!r}'s own subtree, so it cannot take {n.name!r} over",
                        file=file,
                        path=f"nodes[{index[n.name]}].fallback_parents[{j}]",
                    )
            fallbacks[n.name] = n.fallback_parents
            continue
        others = [m for m in candidates(n, best) if m != best[n.name]]
        ranked = sorted(others, key=lambda m: (_cost(topo, {**best, n.name: m}, payload), m))
        fallbacks[n.name] = tuple(ranked[:MAX_FALLBACKS])
    return Tree(best, fallbacks, estimate(topo, best, payload), payload)
