"""A WAN emulator for tests and benchmarks: network namespaces joined by shaped links.

``with Wan() as wan:`` creates hosts (one network namespace each) and links
between them. A link is either

* a veth pair (no delay), optionally rate-limited with ``tbf`` on both ends, or
* a pair of TUN devices joined by the userspace delay line
  (`aurora.testing.delayline`) for one-way delay and random loss — this kernel
  has no ``netem`` — with ``tbf`` on both TUN devices for the rate.

Invariants:

* every name it creates (namespaces, devices) starts with this emulator's
  unique prefix, and only private addresses (10.x.y.z) inside those namespaces
  are used, so it never touches the host's own network;
* `Wan.close` (also on an exception inside the ``with``) kills the delay-line
  processes and the processes started with `Host.popen` by their process
  groups, and deletes exactly the namespaces it created (which removes their
  devices);
* where namespaces or TUN are unavailable (not root, no ``ip``, no
  ``/dev/net/tun``) it raises `WanUnavailable` saying which, before creating
  anything.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

from aurora.errors import AuroraError
from aurora.runtime.processes import end_groups, start_group

TUN_MTU_BYTES = 1500
DELAYLINE_START_S = 10.0


class WanUnavailable(AuroraError):
    """This machine cannot run the WAN emulator (the reason says why)."""


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here, or None if it can."""
    if sys.platform != "linux":
        return "the WAN emulator needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN emulator needs the {tool!r} command (iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "the WAN emulator needs /dev/net/tun for its delay line"
    return None


def _sh(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise WanUnavailable(f"{' '.join(argv)} failed: {r.stderr.strip() or r.returncode}")


@dataclass
class Host:
    """One emulated machine: a network namespace."""

    name: str
    ns: str
    _wan: Wan = field(repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start a process inside this host, in its own process group (ended by `Wan.close`)."""
        p = start_group(self.argv(argv), **kw)
        self._wan._procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout_s, check=False)

    def add_address(self, addr: str) -> None:
        """Give this host ``addr`` (a private 10.x address) on its loopback, reachable over routes to it."""
        _sh("ip", "-n", self.ns, "addr", "add", f"{addr}/32", "dev", "lo")

    def route(self, addr: str, dev: str) -> None:
        """Send traffic for ``addr`` out of this host's device ``dev`` (one end of a link)."""
        _sh("ip", "-n", self.ns, "route", "add", f"{addr}/32", "dev", dev)


@dataclass(frozen=True)
class Link:
    a: Host
    b: Host
    addr_a: str
    addr_b: str
    dev_a: str
    dev_b: str
    rate_mbit: float | None
    rtt_ms: float
    loss: float

    def addr_of(self, host: Host) -> str:
        return self.addr_a if host is self.a else self.addr_b

    def dev_of(self, host: Host) -> str:
        return self.dev_a if host is self.a else self.dev_b


class Wan:
    """Hosts and links; a context manager that removes what it made (see the module docstring)."""

    def __init__(self, prefix: str | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise WanUnavailable(reason)
        self.prefix = prefix or "au" + secrets.token_hex(3)
        if len(self.prefix) > 8:
            raise ValueError("prefix must be at most 8 characters (interface names are limited to 15)")
        self.hosts: dict[str, Host] = {}
        self.links: list[Link] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._delaylines: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Wan:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def host(self, name: str) -> Host:
        ns = f"{self.prefix}-{name}"
        _sh("ip", "netns", "add", ns)
        h = Host(name, ns, self)
        self.hosts[name] = h
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return h

    def link(
        self, a: Host, b: Host, *, rate_mbit: float | None = None, rtt_ms: float = 0.0, loss: float = 0.0, seed: int = 0
    ) -> Link:
        """Join two hosts; each end gets a private address on a subnet of its own."""
        i = len(self.links)
        net = f"10.{200 + i // 256}.{i % 256}"
        addr_a, addr_b = f"{net}.1", f"{net}.2"
        dev_a, dev_b = f"{self.prefix}{i}a", f"{self.prefix}{i}b"
        if rtt_ms <= 0 and loss <= 0:
            _sh("ip", "link", "add", dev_a, "netns", a.ns, "type", "veth", "peer", "name", dev_b, "netns", b.ns)
            _sh("ip", "-n", a.ns, "addr", "add", f"{addr_a}/24", "dev", dev_a)
            _sh("ip", "-n", b.ns, "addr", "add", f"{addr_b}/24", "dev", dev_b)
        else:
            for h, dev, mine, theirs in ((a, dev_a, addr_a, addr_b), (b, dev_b, addr_b, addr_a)):
                _sh("ip", "-n", h.ns, "tuntap", "add", "dev", dev, "mode", "tun")
                _sh("ip", "-n", h.ns, "link", "set", dev, "mtu", str(TUN_MTU_BYTES))
                _sh("ip", "-n", h.ns, "addr", "add", f"{mine}/32", "peer", f"{theirs}/32", "dev", dev)
        for h, dev in ((a, dev_a), (b, dev_b)):
            _sh("ip", "-n", h.ns, "link", "set", dev, "up")
            if rate_mbit is not None:
                _sh("tc", "-n", h.ns, "qdisc", "add", "dev", dev, "root", "tbf", *_tbf_args(rate_mbit, rtt_ms))
        if rtt_ms > 0 or loss > 0:
            self._start_delayline(a.ns, dev_a, b.ns, dev_b, rtt_ms / 2, loss, seed)
        link = Link(a, b, addr_a, addr_b, dev_a, dev_b, rate_mbit, rtt_ms, loss)
        self.links.append(link)
        return link

    def _start_delayline(
        self, ns_a: str, dev_a: str, ns_b: str, dev_b: str, delay_ms: float, loss: float, seed: int
    ) -> None:
        p = start_group(
            [
                sys.executable,
                "-m",
                "aurora.testing.delayline",
                ns_a,
                dev_a,
                ns_b,
                dev_b,
                "--delay-ms",
                str(delay_ms),
                "--loss",
                str(loss),
                "--seed",
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._delaylines.append(p)
        assert p.stdout is not None
        try:
            line = _readline(p, DELAYLINE_START_S)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            err = p.stderr.read().decode(errors="replace") if p.poll() is not None and p.stderr else ""
            raise WanUnavailable(f"the delay line for {dev_a}<->{dev_b} did not start: {err.strip() or 'timeout'}")

    def close(self) -> None:
        end_groups([*self._procs, *self._delaylines])
        self._procs.clear()
        self._delaylines.clear()
        for h in self.hosts.values():
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, check=False)
        self.hosts.clear()


def _tbf_args(rate_mbit: float, rtt_ms: float) -> list[str]:
    rate_bytes_s = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes_s / 250))  # >= one GSO segment and one timer tick's worth
    limit = max(128 * 1024, int(rate_bytes_s * max(rtt_ms, 20.0) / 1000))  # about one BDP of queue
    return ["rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


def _readline(p: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    import selectors

    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError
    return p.stdout.readline()


__all__ = ["Host", "Link", "Wan", "WanUnavailable", "unavailable_reason"]
