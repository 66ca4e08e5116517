"""Topology files: every shipped file loads; bad files fail naming the path; the planner's tree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from aurora.cli import main
from aurora.config.plan import estimate, plan, slowest_link_mbit
from aurora.config.strict import convert
from aurora.config.topology import Topology, check, load_topology
from aurora.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))


def test_the_shipped_topologies_exist() -> None:
    assert {p.name for p in SHIPPED} >= {"local.yaml", "tiny.yaml", "wan-4region.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_topology_loads_and_plans(path: Path) -> None:
    topo = load_topology(path)
    tree = plan(topo, str(path))
    assert set(tree.parent) == {n.name for n in topo.nodes}
    assert tree.time_to_all_s > 0


def _base() -> dict[str, Any]:
    return {
        "name": "t",
        "regions": [{"name": "a"}, {"name": "b"}],
        "wan": [{"regions": ["a", "b"], "bandwidth_mbit": 100, "rtt_ms": 50}],
        "nodes": [
            {"name": "trainer", "role": "trainer", "region": "a", "listen": "tcp://127.0.0.1:1"},
            {"name": "relay", "role": "relay", "region": "b", "listen": "tcp://127.0.0.1:2", "parent": "trainer"},
            {"name": "r1", "role": "rollout", "region": "b", "parent": "relay"},
        ],
    }


def _set(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    keys = path.replace("]", "").replace("[", ".").split(".")
    cur: Any = d
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur[k]
    last = keys[-1]
    if value is _DELETE:
        del cur[int(last) if last.isdigit() else last]
    elif last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value
    return d


_DELETE = object()

BAD: list[tuple[str, Any, str, str]] = [
    ("nodes.2.colour", "red", "nodes[2].colour", "unknown key"),
    ("learner", {"kind": "grpo", "learning_rate": 1e-3}, "learner.learning_rate", "unknown key"),
    ("nodes.1.egress_mbit", "fast", "nodes[1].egress_mbit", "expected a number"),
    ("nodes.2.role", "worker", "nodes[2].role", "expected one of"),
    ("nodes.2.parent", "nobody", "nodes[2].parent", "no node named 'nobody'"),
    ("nodes.1.parent", "r1", "nodes[1].parent", "is a rollout node"),
    ("nodes.1.parent", "relay", "nodes[1].parent", "own parent"),
    ("nodes.2.region", "mars", "nodes[2].region", "no region named 'mars'"),
    ("nodes.1.listen", "tcp://127.0.0.1:1", "nodes[1].listen", "also nodes[0].listen"),
    ("nodes.1.listen", _DELETE, "nodes[1].listen", "needs a listen address"),
    ("nodes.2.name", "relay", "nodes[2].name", "also nodes[1].name"),
    (
        "nodes.2",
        {"name": "t2", "role": "trainer", "region": "b", "listen": "tcp://h:9"},
        "nodes",
        "exactly one trainer",
    ),
    ("nodes.2.parent", _DELETE, "nodes[2].parent", "needs a parent"),
    ("wan", [], "nodes[1].parent", "no wan link"),
    ("nodes.2.fallback_parents", ["ghost"], "nodes[2].fallback_parents[0]", "no node named 'ghost'"),
    ("nodes.0.parent", "relay", "nodes[0].parent", "the trainer has no parent"),
    ("heartbeat", {"interval_s": 2.0}, "heartbeat", "interval_s"),
    ("wan.0.regions", ["a", "a"], "wan[0].regions", "two different regions"),
    ("wan.0.bandwidth_mbit", 0, "wan[0].bandwidth_mbit", "must be > 0"),
    ("nodes.2.transport", {"kind": "carrier-pigeon"}, "nodes[2].transport.kind", "expected one of"),
    ("sync", {"coding": "sparce"}, "sync.coding", "expected one of"),
    ("sync", {"coding": "auto", "link_mbit": 0}, "sync.link_mbit", "must be > 0"),
    ("nodes.1.engine", {"kind": "synthetic"}, "nodes[1].engine", "only a rollout runs an engine"),
    ("nodes.2.engine", {"kind": "synthetic"}, "nodes[2].engine", "needs the topology's engine beside it"),
]


@pytest.mark.parametrize(("where", "value", "path", "message"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_a_bad_file_names_the_file_and_the_path(
    tmp_path: Path, where: str, value: Any, path: str, message: str
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(_set(_base(), where, value)))
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_topology(f)
    assert e.value.file == str(f)
    assert e.value.path == path


def test_topology_check_names_a_typo_under_learner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The RL sections are typed when the file loads, not when a node starts: `aurora topology
    check` names a misspelt learner key (with the keys it allows) in one line, and exits 2."""
    from aurora.cli import EXIT_USER_ERROR, main

    f = tmp_path / "typo.yaml"
    f.write_text(yaml.safe_dump({**_base(), "learner": {"kind": "grpo", "learning_rate": 1e-3}}))
    assert main(["topology", "check", str(f)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"aurora: error: {f}:learner.learning_rate: unknown key (allowed: ")
    assert " lr," in err
    assert "\n" not in err


def test_cycles_and_relays_without_a_path_to_the_trainer_are_refused(tmp_path: Path) -> None:
    d = _base()
    d["nodes"].append(
        {"name": "relay2", "role": "relay", "region": "b", "listen": "tcp://127.0.0.1:3", "parent": "relay3"}
    )
    d["nodes"].append(
        {"name": "relay3", "role": "relay", "region": "b", "listen": "tcp://127.0.0.1:4", "parent": "relay2"}
    )
    f = tmp_path / "cycle.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="cycle: relay2 -> relay3 -> relay2") as e:
        load_topology(f)
    assert e.value.path == "nodes[3].parent"


def test_a_fallback_inside_the_nodes_own_subtree_is_refused(tmp_path: Path) -> None:
    d = _base()
    d["nodes"].append(
        {"name": "relay2", "role": "relay", "region": "b", "listen": "tcp://127.0.0.1:3", "parent": "relay"}
    )
    d["nodes"][1]["fallback_parents"] = ["relay2"]
    f = tmp_path / "fb.yaml"
    f.write_text(yaml.safe_dump(d))
    topo = load_topology(f)
    with pytest.raises(ConfigError, match="own subtree") as e:
        plan(topo, str(f))
    assert e.value.path == "nodes[1].fallback_parents[0]"


def test_not_yaml_and_missing_files_are_config_errors(tmp_path: Path) -> None:
    f = tmp_path / "x.yaml"
    f.write_text("nodes: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_topology(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_topology(tmp_path / "absent.yaml")


@st.composite
def wan_topologies(draw: st.DrawFn) -> Topology:
    n_regions = draw(st.integers(1, 4))
    local_mbit = draw(st.sampled_from([1000.0, 10000.0]))
    wan_mbit = draw(st.sampled_from([10.0, 50.0, 100.0]))
    regions = [{"name": f"r{i}", "bandwidth_mbit": local_mbit} for i in range(n_regions)]
    wan = [
        {"regions": ["r0", f"r{i}"], "bandwidth_mbit": wan_mbit, "rtt_ms": draw(st.sampled_from([20, 50, 150]))}
        for i in range(1, n_regions)
    ]
    nodes: list[dict[str, Any]] = [{"name": "trainer", "role": "trainer", "region": "r0", "listen": "tcp://h:1"}]
    port = 2
    for i in range(n_regions):
        for j in range(draw(st.integers(1 if i else 0, 2))):
            nodes.append(
                {
                    "name": f"relay-{i}-{j}",
                    "role": "relay",
                    "region": f"r{i}",
                    "listen": f"tcp://h:{port}",
                    "parent": "auto",
                }
            )
            port += 1
        nodes += [
            {"name": f"roll-{i}-{j}", "role": "rollout", "region": f"r{i}", "parent": "auto"}
            for j in range(draw(st.integers(1, 4)))
        ]
    t = convert(Topology, {"name": "gen", "regions": regions, "wan": wan, "nodes": nodes})
    check(t)
    return t


@given(wan_topologies())
def test_the_planned_tree_reaches_everyone_once_per_region_and_beats_the_star(topo: Topology) -> None:
    tree = plan(topo)
    root = topo.trainer.name
    for n in topo.nodes:  # every chain ends at the trainer, without cycles
        seen, cur = set(), n.name
        while cur != root:
            assert cur not in seen
            seen.add(cur)
            parent = tree.parent[cur]
            assert parent is not None
            cur = parent
    region = {n.name: n.region for n in topo.nodes}
    crossings = [c for c, p in tree.parent.items() if p is not None and region[c] != region[p]]
    remote = {n.region for n in topo.nodes if n.region != "r0"}
    assert len(crossings) == len(remote), f"WAN crossings {crossings} for remote regions {remote}"
    star = {n.name: (None if n.role == "trainer" else root) for n in topo.nodes}
    assert tree.time_to_all_s <= max(estimate(topo, star, tree.payload_bytes).values()) + 1e-9
    for name, fbs in tree.fallbacks.items():
        assert name not in fbs
        assert tree.parent[name] not in fbs


def test_the_slowest_link_of_the_planned_tree_is_the_wan_crossing() -> None:
    topo = load_topology(ROOT / "topologies" / "wan-4region.yaml")
    assert slowest_link_mbit(topo, plan(topo)) == pytest.approx(100.0)  # one relay per region: 100 Mbit/s each


def test_a_rollout_may_run_its_own_engine_judged_as_the_topologys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A machine of another kind: a rollout's own ``engine`` replaces the topology's for it alone; the
    settings the trainer judges results by (``max_new_tokens``, ``temperature``) must be the same."""
    d = _base()
    d["engine"] = {"kind": "synthetic", "max_new_tokens": 8, "token_s": 0.1}
    d["nodes"][2]["engine"] = {"kind": "synthetic", "max_new_tokens": 8, "token_s": 0.05}
    f = tmp_path / "mixed.yaml"
    f.write_text(yaml.safe_dump(d))
    topo = load_topology(f)
    own = topo.node("r1").engine
    assert own is not None
    assert own.token_s == 0.05
    assert topo.engine is not None
    assert topo.engine.token_s == 0.1
    assert main(["topology", "check", str(f)]) == 0
    assert "r1: its own engine synthetic, 0.05 s per token" in capsys.readouterr().out
    d["nodes"][2]["engine"]["max_new_tokens"] = 16
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=re.escape("not the topology's engine.max_new_tokens 8")) as e:
        load_topology(f)
    assert e.value.path == "nodes[2].engine.max_new_tokens"
    d["nodes"][2]["engine"] = {"kind": "synthetic", "max_new_tokens": 8, "model": {"path": "elsewhere"}}
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="serves the trainer's model") as e:
        load_topology(f)
    assert e.value.path == "nodes[2].engine.model"


@pytest.mark.parametrize(
    ("serve", "engine", "why", "path"),
    [
        ({"url": "http://10.1.2.3:8000"}, "vllm", "must listen on 127.0.0.1 or ::1", "engine.serve.url"),
        ({"url": "https://127.0.0.1:8000"}, "vllm", "must be http://HOST:PORT", "engine.serve.url"),
        ({"url": "http://127.0.0.1"}, "vllm", "must be http://HOST:PORT", "engine.serve.url"),
        ({"url": "http://127.0.0.1:0"}, "vllm", "must be http://HOST:PORT", "engine.serve.url"),
        ({"url": "http://127.0.0.1:8000?x=1"}, "vllm", "must be http://HOST:PORT", "engine.serve.url"),
        ({"url": "http://127.0.0.1:8000", "start_timeout_s": 0}, "vllm", "must be > 0", "engine.serve.start_timeout_s"),
        ({"url": "http://127.0.0.1:8000"}, "torch", "only a continuous vllm engine", "engine.serve"),
    ],
)
def test_a_served_engine_is_refused_with_the_setting_named(
    tmp_path: Path, serve: dict[str, object], engine: str, why: str, path: str
) -> None:
    d = _base()
    d["engine"] = {"kind": engine, "serve": serve}
    f = tmp_path / "served.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        load_topology(f)
    assert e.value.path == path
    assert str(f) in str(e.value)


@pytest.mark.parametrize(
    ("engine", "why"),
    [
        ({"kind": "vllm", "tensor_parallel": 0}, "must be >= 1"),
        ({"kind": "vllm", "continuous": False, "tensor_parallel": 2}, "only a continuous vllm engine"),
        ({"kind": "torch", "tensor_parallel": 2}, "only a continuous vllm engine"),
    ],
)
def test_a_tensor_parallel_engine_is_refused_where_it_cannot_run(
    tmp_path: Path, engine: dict[str, object], why: str
) -> None:
    d = _base()
    d["engine"] = engine
    f = tmp_path / "tp.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=why) as e:
        load_topology(f)
    assert e.value.path == "engine.tensor_parallel"


@pytest.mark.parametrize(
    ("learner", "why", "path"),
    [
        ({"kind": "grpo", "ranks": 0}, "must be >= 1", "learner.ranks"),
        ({"kind": "grpo", "ranks": 2, "restarts": -1}, "must be >= 0", "learner.restarts"),
        (
            {"kind": "grpo", "ranks": 2, "kl_coef": 0.1},
            "a KL term (kl_coef > 0) needs a reference model",
            "learner.ranks",
        ),
    ],
)
def test_a_sharded_learner_is_refused_where_it_cannot_run(
    tmp_path: Path, learner: dict[str, object], why: str, path: str
) -> None:
    d = _base()
    d["learner"] = learner
    f = tmp_path / "ranks.yaml"
    f.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        load_topology(f)
    assert e.value.path == path
