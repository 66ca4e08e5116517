"""Elastic rollout pools: credentials, the member rules of the tree and the transport, the trainer's roster.

The rules as values (the roster under random joins and silences, certificates, the topology's
checks), a real CurveZMQ server that lets a member's key in only under its own name, and the
refusals a running parent answers at the hello: no certificate, one signed by another key, an
expired one. The whole story with real processes is tests/test_pool_processes.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aurora.transport.zmq import CurveKeys, LinkConfig, ZmqClient, ZmqServer
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.auth.keys import generate_topology_keys
from aurora.auth.pool import (
    Credential,
    Revocations,
    check_cert,
    check_credential,
    enroll,
    member_name,
    pool_verifiers,
    read_credential,
    revoke,
    write_credential,
)
from aurora.config.topology import load_topology
from aurora.errors import ConfigError, TransportClosed
from aurora.protocol.membership import Place, TreeRules
from aurora.protocol.messages import Hello, MemberCert, PathUpdate, Probe, Refused, decode_app, encode_app
from aurora.protocol.roster import PoolRoster, member_pool

NOW = 1_800_000_000.0


def _topology(tmp: Path, pools: str = "  - {name: spot, parents: [relay, trainer], max_size: 2}") -> Path:
    path = tmp / "t.yaml"
    path.write_text(f"""
name: pools
regions: [{{name: local}}, {{name: far}}]
wan: [{{regions: [local, far], bandwidth_mbit: 100, rtt_ms: 50}}]
nodes:
  - {{name: trainer, role: trainer, region: local, listen: "tcp://127.0.0.1:47300"}}
  - {{name: relay, role: relay, region: far, listen: "tcp://127.0.0.1:47301", parent: trainer}}
  - {{name: deep, role: relay, region: far, listen: "tcp://127.0.0.1:47302", parent: relay}}
  - {{name: rollout-1, role: rollout, region: far, parent: relay}}
pools:
{pools}
keys: {{dir: keys}}
""")
    return path


@pytest.fixture
def topo_file(tmp_path: Path) -> Path:
    path = _topology(tmp_path)
    list(generate_topology_keys(load_topology(path), str(path)))
    return path


# ------------------------------------------------------------------ the roster
def test_the_roster_refuses_past_the_maximum_and_frees_a_silent_members_place() -> None:
    r = PoolRoster({"spot": 2}, hold_s=3.0)
    a, b, c = (member_name("spot", CurveKeys.generate().public) for _ in range(3))
    assert r.join(a, 0.0) is None
    assert r.join(b, 0.5) is None
    assert r.join(c, 1.0) == "pool 'spot' is full (2 of 2 members)"
    assert r.join(a, 1.0) is None  # a member that says hello again keeps its one place
    assert r.seen(b, 2.0)
    assert r.prune(3.9) == []
    assert r.prune(4.1) == [a]
    assert r.join(c, 4.2) is None
    assert r.members() == {"spot": sorted([b, c])}
    assert r.join("rollout-1", 4.3) == "'rollout-1' is no pool's member"
    assert not r.seen("other.0123456789abcdef", 4.3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "seen", "wait"]), st.integers(0, 5)), max_size=60))
def test_a_pool_never_holds_more_than_its_maximum(ops: list[tuple[str, int]]) -> None:
    """Invariant: whatever the order of joins, reports and silences, no pool exceeds its size, and a
    member holds at most one place."""
    names = [f"spot.{i:016x}" for i in range(6)]
    r = PoolRoster({"spot": 3}, hold_s=2.0)
    now = 0.0
    for op, i in ops:
        if op == "wait":
            now += i * 0.7
            r.prune(now)
        elif op == "join":
            before, size = r.holds(names[i]), len(r.heard["spot"])
            why = r.join(names[i], now)
            assert (why is None) == (before or size < 3)
        else:
            r.seen(names[i], now)
        assert len(r.heard["spot"]) <= 3
        assert len(set(r.members()["spot"])) == len(r.members()["spot"])


def test_member_names_are_the_pools_with_sixteen_hex_digits() -> None:
    key = CurveKeys.generate().public
    name = member_name("spot", key)
    assert member_pool(name, {"spot": 1}) == "spot"
    assert member_name("spot", key) == name
    assert member_name("spot", CurveKeys.generate().public) != name
    for bad in ("spot", "spot.", "spot.0123", "spot.0123456789ABCDEF", "other.0123456789abcdef", "rollout-1"):
        assert member_pool(bad, {"spot": 1}) is None, bad


# ------------------------------------------------------------------ certificates and credentials
def test_a_certificate_holds_only_for_its_key_pool_parents_signer_and_lifetime(topo_file: Path) -> None:
    topo = load_topology(topo_file)
    cred = enroll(topo, str(topo_file), "spot", 3600, NOW)
    pools, keys = {"spot": topo.pool("spot")}, pool_verifiers(topo, str(topo_file))
    assert check_cert(cred.cert, cred.name, "relay", pools, keys, NOW + 10) is None
    assert check_cert(cred.cert, cred.name, "trainer", pools, keys, NOW + 10) is None
    other = member_name("spot", CurveKeys.generate().public)
    assert "another key" in (check_cert(cred.cert, other, "relay", pools, keys, NOW) or "")
    assert "do not attach to 'deep'" in (check_cert(cred.cert, cred.name, "deep", pools, keys, NOW) or "")
    assert "expired" in (check_cert(cred.cert, cred.name, "relay", pools, keys, NOW + 3600) or "")
    forged = MemberCert(pool="spot", key=cred.cert.key, expires=cred.cert.expires + 10**6, sig=cred.cert.sig)
    assert "not signed" in (check_cert(forged, cred.name, "relay", pools, keys, NOW) or "")
    # a pool key of another topology signs nothing here
    other_topo = tmp = topo_file.parent / "other"
    tmp.mkdir()
    path = _topology(other_topo)
    list(generate_topology_keys(load_topology(path), str(path)))
    stranger = enroll(load_topology(path), str(path), "spot", 3600, NOW)
    assert "not signed" in (check_cert(stranger.cert, stranger.name, "relay", pools, keys, NOW) or "")


def test_a_revoked_member_is_refused(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    topo = load_topology(path)
    list(generate_topology_keys(topo, str(path)))
    cred = enroll(topo, str(path), "spot", 3600, NOW)
    path.write_text(path.read_text().replace("max_size: 2}", f"max_size: 2, revoked: [{cred.name}]}}"))
    topo = load_topology(path)
    why = check_cert(cred.cert, cred.name, "relay", {"spot": topo.pool("spot")}, pool_verifiers(topo, str(path)), NOW)
    assert why is not None
    assert "revoked" in why


def test_revocations_are_read_again_when_the_file_changes(topo_file: Path) -> None:
    topo = load_topology(topo_file)
    cred = enroll(topo, str(topo_file), "spot", 3600, NOW)
    revs = Revocations(topo, str(topo_file))
    pools, keys = {"spot": topo.pool("spot")}, pool_verifiers(topo, str(topo_file))
    assert revs.of("spot", 0.0) == frozenset()
    path, new = revoke(topo, str(topo_file), "spot", [cred.name, cred.name])
    assert new == [cred.name]
    assert revs.of("spot", 0.5) == frozenset()  # looked at most once a second
    assert revs.of("spot", 1.0) == {cred.name}
    why = check_cert(cred.cert, cred.name, "relay", pools, keys, NOW, revs.of("spot", 1.0))
    assert why is not None
    assert "revoked" in why
    assert revoke(topo, str(topo_file), "spot", [cred.name])[1] == []
    other = member_name("spot", CurveKeys.generate().public)
    path.write_bytes(path.read_bytes() + b"# no newline at the end")  # an editor's
    assert revoke(topo, str(topo_file), "spot", [other])[1] == [other]
    assert revs.of("spot", 2.0) == {cred.name, other}  # the two names did not run together
    path.write_text("# nobody\n")
    os.utime(path, ns=(1, 1))  # a new mtime, whatever the clock's resolution
    assert revs.of("spot", 3.0) == frozenset()
    path.chmod(0o000)  # unreadable (as root it still reads: either way, nothing is lost)
    assert revs.of("spot", 4.0) == frozenset()
    path.unlink()
    assert revs.of("spot", 5.0) == frozenset()
    with pytest.raises(ConfigError, match="not a member name"):
        revoke(topo, str(topo_file), "spot", ["rollout-1"])


def test_a_credential_file_is_private_whole_and_never_overwritten(topo_file: Path, tmp_path: Path) -> None:
    topo = load_topology(topo_file)
    cred = enroll(topo, str(topo_file), "spot", 60, NOW)
    f = tmp_path / "m.json"
    write_credential(f, cred)
    assert os.stat(f).st_mode & 0o777 == 0o600
    back = read_credential(f)
    assert back == cred
    assert back.name == cred.name == json.loads(f.read_text())["member"]
    with pytest.raises(FileExistsError):
        write_credential(f, cred)
    with pytest.raises(ConfigError, match="expired"):
        check_credential(topo, str(topo_file), cred, NOW + 61)
    os.chmod(f, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_credential(f)
    os.chmod(f, 0o600)
    f.write_text('{"format": "aurora-pool-credential/1", "pool": "spot"}')
    with pytest.raises(ConfigError, match=r"m\.json.*not a pool credential"):
        read_credential(f)
    with pytest.raises(ConfigError, match="no pool named 'gpu'"):
        enroll(topo, str(topo_file), "gpu", 60, NOW)


def test_the_certificate_travels_in_the_hello_and_is_validated() -> None:
    cert = MemberCert(pool="spot", key=b"k" * 40, expires=5, sig=b"s" * 64)
    assert decode_app(encode_app(Hello(v=3, cert=cert))) == Hello(v=3, cert=cert)
    with pytest.raises(ValueError, match="malformed"):
        decode_app(encode_app(Hello(v=3, cert=MemberCert(pool="spot", key=b"k" * 39, expires=5, sig=b"s" * 64))))
    with pytest.raises(ValueError, match="malformed"):
        decode_app(encode_app(Hello(v=3, cert=MemberCert(pool="a.b", key=b"k" * 40, expires=5, sig=b"s" * 64))))


# ------------------------------------------------------------------ the topology
@pytest.mark.parametrize(
    ("pools", "error"),
    [
        ("  - {name: spot, parents: [rollout-1], max_size: 2}", "rollout-1' is a rollout"),
        ("  - {name: spot, parents: [nobody], max_size: 2}", r"pools\[0\]\.parents\[0\]: no node named 'nobody'"),
        ("  - {name: relay, parents: [trainer], max_size: 2}", r"also the name of nodes\[1\]"),
        ("  - {name: spot, parents: [trainer], max_size: 0}", r"pools\[0\]\.max_size: must be 1\.\.4096"),
        ("  - {name: a.b, parents: [trainer], max_size: 1}", "pool name 'a.b'"),
        ("  - {name: spot, parents: [trainer], max_size: 1, revoked: [rollout-1]}", r"revoked\[0\]"),
        ("  - {name: spot, parents: [trainer], max_size: 1, region: mars}", "no region named 'mars'"),
        ("  - {name: spot, parents: [trainer, trainer], max_size: 1}", "named twice"),
    ],
)
def test_a_bad_pool_is_refused_naming_its_field(tmp_path: Path, pools: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_topology(_topology(tmp_path, pools))


def test_a_pool_needs_keys(tmp_path: Path) -> None:
    path = _topology(tmp_path)
    path.write_text(path.read_text().replace("keys: {dir: keys}", ""))
    with pytest.raises(ConfigError, match=r"pools\[0\]: a pool needs keys"):
        load_topology(path)


# ------------------------------------------------------------------ the tree's rules
def test_members_attach_under_their_pools_parents_and_relays_speak_for_the_pools_below_them() -> None:
    rules = TreeRules(
        {"trainer": None, "relay": "trainer", "deep": "relay", "r1": "relay"},
        {},
        {"trainer": "trainer", "relay": "relay", "deep": "relay", "r1": "rollout"},
        {"spot": ("deep",), "near": ("trainer",)},
    )
    m, n = "spot.0123456789abcdef", "near.0123456789abcdef"
    assert rules.may_attach(m, "deep")
    assert not rules.may_attach(m, "relay")
    assert not rules.may_attach(m, "trainer")
    assert rules.role(m) == "rollout"
    assert rules.role("spot.xyz") is None
    trainer, relay = Place("trainer", rules), Place("relay", rules)
    assert trainer.speaks_for_worker("relay", m)  # spot's parent is below relay
    assert not trainer.speaks_for_worker("relay", n)  # near's members attach to the trainer itself
    assert relay.speaks_for_worker("deep", m)
    assert not relay.speaks_for_worker("r1", m)
    assert trainer.speaks_for_worker(n, n)
    assert not trainer.speaks_for(n, m)
    relay.moved(["trainer"])
    assert isinstance(relay.hello(m), Refused)  # not a parent of spot
    deep = Place("deep", rules)
    deep.moved(["trainer", "relay"])
    assert deep.hello(m) == PathUpdate(path=["trainer", "relay", "deep"])


# ------------------------------------------------------------------ the transport
CFG = LinkConfig(heartbeat_s=0.1, suspect_after_s=0.4, lost_after_s=0.8, max_frame_bytes=4096)


async def test_a_member_key_gets_in_only_under_the_name_it_hashes_to() -> None:
    server_keys, named, member, liar = (CurveKeys.generate() for _ in range(4))
    mname = member_name("spot", member.public)

    def rule(claimed: str, key: bytes) -> bool:
        return claimed.startswith("spot.") and member_name("spot", key) == claimed

    server = ZmqServer("relay", cfg=CFG, curve=server_keys, clients={named.public: "rollout-1"}, members=rule)
    async with asyncio.TaskGroup() as tg:
        addr = await server.start_in(tg)
        ok = ZmqClient(mname, addr, "relay", cfg=CFG, curve=member, server_key=server_keys.public)
        # a key that is no node's claims a named node, and another claims the member's name
        as_node = ZmqClient("rollout-1", addr, "relay", cfg=CFG, curve=liar, server_key=server_keys.public)
        as_member = ZmqClient(mname, addr, "relay", cfg=CFG, curve=liar, server_key=server_keys.public)
        ch = await ok.start_in(tg)
        bad = [await c.start_in(tg) for c in (as_node, as_member)]
        peer = await asyncio.wait_for(server.accept(), 5)
        assert peer.peer == mname
        await ch.send(Probe(note="hi"))
        assert (await asyncio.wait_for(peer.recv(), 5)).msg == Probe(note="hi")
        for b in bad:
            with pytest.raises(TransportClosed, match="lost"):
                await asyncio.wait_for(b.recv(), 5)
        assert set(server.channels) == {mname}
        for c in (ok, as_node, as_member):
            await c.close()
        await server.close()


def test_a_member_credential_of_another_topology_is_refused_at_start(topo_file: Path, tmp_path: Path) -> None:
    topo = load_topology(topo_file)
    cred = enroll(topo, str(topo_file), "spot", 60, NOW)
    other = Credential("someone-else", cred.curve, cred.cert)
    with pytest.raises(ConfigError, match="for topology 'someone-else'"):
        check_credential(topo, str(topo_file), other, NOW)
