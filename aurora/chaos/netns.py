"""`NetnsNetwork`: `aurora chaos` with every node on a machine of its own — a network namespace — so that
a partition is a real cut link, not a silence the node plays on itself.

Each node gets a namespace (`aurora.testing.wan`) and an address of its own (``10.77.0.N`` on its
loopback); each pair of nodes that may be parent and child (the planned tree and every fallback) gets
a veth link and a route to each other's address over it, and nothing else: there is no other path,
so taking a link down cuts exactly that pair. The topology is rewritten for it (``STATE/topology.yaml``:
each ``listen`` on its node's address, relative paths made absolute) and every node is started inside
its namespace. A partition black-holes the link between a node and its planned parent (both ends drop
what they send, silently; the devices stay up) and a heal lets it carry again; each side finds out as
across a real network, by its heartbeats and TCP's timeouts.

Invariants: as `aurora.testing.wan.Wan`'s — only names with its unique prefix, only private addresses
inside its own namespaces, all removed by `close` (also on an exception); where namespaces are not
available it raises `WanUnavailable` before making anything.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from aurora.config.plan import Tree
from aurora.config.topology import Topology
from aurora.testing.wan import Host, Link, Wan, WanUnavailable, unavailable_reason

NET = "10.77.0"
BLACK_HOLE = ("tbf", "rate", "8bit", "burst", "1600", "limit", "1")
"""A qdisc that passes (almost) nothing: what a cut link's two ends send through."""


class NetnsNetwork:
    def __init__(self, topo: Topology, tree: Tree) -> None:
        self.wan = Wan()
        try:
            self.hosts: dict[str, Host] = {}
            self.addr: dict[str, str] = {}
            for i, n in enumerate(topo.nodes, start=1):
                h = self.wan.host(f"n{i}")
                h.add_address(f"{NET}.{i}")
                self.hosts[n.name], self.addr[n.name] = h, f"{NET}.{i}"
            self.links: dict[frozenset[str], Link] = {}
            for child, parent in tree.parent.items():
                for p in ([parent] if parent is not None else []) + list(tree.fallbacks.get(child, ())):
                    pair = frozenset((child, p))
                    if p != child and pair not in self.links:
                        self.links[pair] = self.wan.link(self.hosts[child], self.hosts[p])
                        self._routes(child, p)
        except BaseException:
            self.wan.close()
            raise

    @staticmethod
    def available() -> str | None:
        """Why this machine cannot run the cluster in namespaces (None: it can)."""
        return unavailable_reason()

    def _routes(self, a: str, b: str) -> None:
        link = self.links[frozenset((a, b))]
        for x, y in ((a, b), (b, a)):
            self.hosts[x].route(self.addr[y], link.dev_of(self.hosts[x]))

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``name``'s namespace."""
        return self.hosts[name].argv(argv)

    def cut(self, a: str, b: str, *, up: bool) -> None:
        """Black-hole the link between ``a`` and ``b`` (``up`` False) or let it carry again. A cut link
        drops what either end sends, silently — its devices stay up, so nobody is told (this kernel has
        no netem: a token bucket of 8 bit/s with a one-byte queue drops every packet but a stray few);
        each side's heartbeats and TCP find it out."""
        link = self.links.get(frozenset((a, b)))
        if link is None:
            raise WanUnavailable(f"no link between {a!r} and {b!r}")
        for h in (link.a, link.b):
            dev = link.dev_of(h)
            tc = ["tc", "-n", h.ns, "qdisc"]
            argv = [*tc, "del", "dev", dev, "root"] if up else [*tc, "replace", "dev", dev, "root", *BLACK_HOLE]
            r = subprocess.run(argv, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise WanUnavailable(f"{' '.join(argv)} failed: {r.stderr.strip()}")

    def topology(self, path: Path, out: Path) -> Path:
        """The topology at ``path`` for this network, written to ``out``: each node listens on its own
        address (same port), and every relative ``path`` or ``dir`` is made absolute."""
        data = yaml.safe_load(path.read_text())
        base = path.resolve().parent

        def fix(x: Any) -> Any:
            if isinstance(x, dict):
                return {
                    k: str(base / v)
                    if k in ("path", "dir") and isinstance(v, str) and not Path(v).is_absolute()
                    else fix(v)
                    for k, v in x.items()
                }
            if isinstance(x, list):
                return [fix(v) for v in x]
            return x

        data = fix(data)
        for n in data.get("nodes", []):
            if isinstance(n, dict) and isinstance(n.get("listen"), str):
                n["listen"] = re.sub(r"//[^:/]+:", f"//{self.addr[n['name']]}:", n["listen"])
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return out

    def close(self) -> None:
        self.wan.close()
