"""The WAN emulator: delay and loss are applied, and everything it made is removed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aurora.testing.wan import Wan, unavailable_reason

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


UDP_ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 7000)); s.settimeout(3)
print("up", flush=True)
n = 0
try:
    while True:
        s.recvfrom(2048); n += 1
except socket.timeout:
    print(n, flush=True)
"""


def test_delay_and_loss_are_applied_and_everything_is_removed() -> None:
    before = _namespaces()
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, rate_mbit=50, rtt_ms=40, loss=0.2, seed=1)
        assert _namespaces() - before == {a.ns, b.ns}
        sink = b.popen([sys.executable, "-c", UDP_ECHO, link.addr_b], stdout=subprocess.PIPE)
        assert sink.stdout is not None
        assert sink.stdout.readline().strip() == b"up"
        send = (
            "import socket, sys, time\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for _ in range(1000):\n"
            "    s.sendto(b'x' * 100, (sys.argv[1], 7000)); time.sleep(0.0005)\n"
            # a TCP connect takes one round trip: the SYN is refused after the full RTT
            "t = time.monotonic()\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], 9), timeout=5)\n"
            "except ConnectionRefusedError:\n"
            "    pass\n"
            "print(time.monotonic() - t)\n"
        )
        r = a.run([sys.executable, "-c", send, link.addr_b])
        assert r.returncode == 0, r.stderr
        rtt_s = float(r.stdout.strip())
        assert rtt_s >= 0.038, f"round trip {rtt_s * 1000:.1f} ms on a 40 ms link"
        received = int(sink.stdout.readline())
        assert 700 <= received <= 880, f"{received} of 1000 datagrams arrived at 20 % loss"
    assert not {a.ns, b.ns} & _namespaces()  # its own are gone (another test's may come and go meanwhile)


def test_cleanup_also_happens_when_the_body_fails() -> None:

    made: list[str] = []

    def fail_inside() -> None:
        with Wan() as wan:
            a, b = wan.host("a"), wan.host("b")
            made.extend((a.ns, b.ns))
            wan.link(a, b, rtt_ms=10)
            a.popen(["sleep", "60"])
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert made
    assert not set(made) & _namespaces()
