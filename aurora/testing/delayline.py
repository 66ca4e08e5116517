"""A userspace delay line between two TUN devices in two network namespaces.

This kernel has no ``netem``, so one-way delay and random loss are made here:
packets the kernel routes into TUN device A are read, held for ``delay_ms``,
and written into TUN device B (and the other way round). Rate limiting is not
done here: the emulator puts a ``tbf`` qdisc on each TUN device, so packets
reach this process already paced at the link rate.

Invariants: each direction is a FIFO with a constant delay, so packets are
never reordered; a packet is dropped with probability ``loss`` independently
of all others (seeded, so runs repeat); nothing else is changed.

Run as ``python -m aurora.testing.delayline NS_A DEV_A NS_B DEV_B --delay-ms D
--loss P`` by `aurora.testing.wan` (root; the TUN devices already exist and are
configured). It prints ``ready`` once both devices are attached and runs until
killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import os
import random
import select
import struct
import sys
import time
from collections import deque

CLONE_NEWNET = 0x40000000  # <sched.h>
TUNSETIFF = 0x400454CA  # <linux/if_tun.h>: _IOW('T', 202, int)
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_BATCH = 64
MTU_BYTES = 65535


def _setns(ns: str) -> None:
    """Move this (single-threaded) process into network namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def attach_tun(ns: str, dev: str) -> int:
    """Open the existing TUN device ``dev`` inside namespace ``ns``; the fd stays bound to it."""
    _setns(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd_a: int, fd_b: int, delay_s: float, loss: float, seed: int) -> None:
    rng = random.Random(seed)
    peer = {fd_a: fd_b, fd_b: fd_a}
    queues: dict[int, deque[tuple[float, bytes]]] = {fd_a: deque(), fd_b: deque()}  # keyed by destination
    while True:
        now = time.monotonic()
        heads = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(heads) - now) if heads else None
        readable, _, _ = select.select([fd_a, fd_b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            out = queues[peer[fd]]
            for _ in range(READ_BATCH):
                try:
                    pkt = os.read(fd, MTU_BYTES)
                except BlockingIOError:
                    break
                if loss <= 0 or rng.random() >= loss:
                    out.append((now + delay_s, pkt))
        for dst, q in queues.items():
            while q and q[0][0] <= now:
                # A full kernel backlog loses the packet, as a wire would.
                with contextlib.suppress(BlockingIOError):
                    os.write(dst, q.popleft()[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aurora.testing.delayline", description=__doc__.split("\n")[0])
    ap.add_argument("ns_a")
    ap.add_argument("dev_a")
    ap.add_argument("ns_b")
    ap.add_argument("dev_b")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay in milliseconds")
    ap.add_argument("--loss", type=float, default=0.0, help="drop probability per packet (0..1)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    fd_a = attach_tun(a.ns_a, a.dev_a)
    fd_b = attach_tun(a.ns_b, a.dev_b)
    print("ready", flush=True)
    sys.stdout.close()
    run(fd_a, fd_b, a.delay_ms / 1000.0, a.loss, a.seed)


if __name__ == "__main__":
    main()
