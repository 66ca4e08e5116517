"""WebRTC between two network namespaces: real host candidates, real processes, kill -9."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from aurora.testing.wan import Wan, unavailable_reason

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]
PEER = [sys.executable, "-m", "aurora.bench.transport_peer"]


def test_webrtc_connects_across_namespaces_and_delivers_a_striped_payload() -> None:
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b)  # a plain veth pair: the addresses exist only inside these namespaces
        sink = b.popen(
            [*PEER, "sink", "--kind", "webrtc", "--streams", "2", "--bind", link.addr_b],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert sink.stdout is not None
        addr = json.loads(sink.stdout.readline())["address"]
        assert link.addr_b in addr
        r = a.run(
            [*PEER, "source", "--kind", "webrtc", "--streams", "2", "--bytes", str(3 << 20), "--connect", addr],
            timeout_s=120,
        )
        if r.returncode != 0:
            sink.kill()
            assert sink.stderr is not None
            raise AssertionError(f"source: {r.stderr}\nsink: {sink.stderr.read().decode()[-3000:]}")
        assert json.loads(r.stdout.splitlines()[-1])["bytes"] == 3 << 20
        assert json.loads(sink.stdout.readline()) == {"ok": True, "bytes": 3 << 20}


def test_a_sender_notices_when_its_webrtc_peer_is_killed() -> None:
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        link = wan.link(a, b, rate_mbit=8)  # slow enough that the transfer is still running
        args = ["--kind", "webrtc", "--lost-after-s", "2"]
        sink = b.popen([*PEER, "sink", *args, "--bind", link.addr_b], stdout=subprocess.PIPE)
        assert sink.stdout is not None
        addr = json.loads(sink.stdout.readline())["address"]
        src = a.popen(
            [*PEER, "source", *args, "--bytes", str(64 << 20), "--connect", addr],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert src.stdout is not None
        assert json.loads(src.stdout.readline())["started"]  # connected: the transfer runs (a slow machine
        time.sleep(1)  # takes seconds to get here; killing the sink before would test the connect instead)
        assert src.poll() is None, "the transfer ended before the kill"
        subprocess.run(["kill", "-9", str(sink.pid)], check=True)
        t0 = time.monotonic()
        _, err = src.communicate(timeout=30)
        assert src.returncode == 2, err
        assert b"every stream closed" in err
        assert time.monotonic() - t0 < 20
