"""`aurora deploy`: each engine's files are valid by the engine's own schema or loader, no node is
given another node's secret, and what a node is given is all it needs: the units run as the
containers would (their mounts as directories) and the cluster converges over loopback."""

from __future__ import annotations

import base64
import copy
import importlib.resources
import json
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from aurora.auth.keys import load_node_keys
from aurora.auth.pool import check_credential, enroll, read_credential
from aurora.cli import main
from aurora.config.rl import PythonSpec
from aurora.config.topology import load_topology
from aurora.deploy import deploy
from aurora.deploy.plan import CONF, SECRET, STORE
from aurora.errors import ConfigError
from aurora.events import NODE_STARTED, VERSION_COMMITTED, VERSION_PUBLISHED
from aurora.rl.learners import load_factory
from tests.helpers import free_ports, log_events, wait_until

STEPS = 12
HOST = "aurora-node.invalid"
"""The listening nodes' host name in the test topology: what their machines would be called (the units
run here have it mean loopback)."""


def _topology(tmp: Path, ports: list[int] | None = None, extra: str = "") -> Path:
    p = ports or [47000, 47001]
    path = tmp / "t.yaml"
    path.write_text(f"""
name: deploy-test
regions:
  - {{name: us, cloud: aws, cloud_region: us-east-1}}
  - {{name: eu, cloud: gcp, cloud_region: europe-west4}}
wan: [{{regions: [us, eu], bandwidth_mbit: 100, rtt_ms: 50}}]
nodes:
  - {{name: trainer, role: trainer, region: us, listen: "tcp://{HOST}:{p[0]}"}}
  - {{name: relay_eu, role: relay, region: eu, listen: "tcp://{HOST}:{p[1]}", parent: trainer}}
  - {{name: rollout-1, role: rollout, region: eu, parent: relay_eu}}
  - {{name: rollout-2, role: rollout, region: us, parent: trainer}}
heartbeat: {{interval_s: 0.2, suspect_after_s: 0.6, lost_after_s: 1.2}}
learner: {{kind: synthetic, params: 100000, density: 0.02, interval_s: 0.3}}
run: {{steps: {STEPS}}}
keys: {{dir: keys}}
{extra}
""")
    assert main(["keys", "generate", "--topology", str(path)]) == 0
    return path


def _secrets(keys: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in keys.iterdir() if p.name.endswith(("key_secret", ".sign", ".pool"))}


def _every_file(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("deploy")
    gpus = "deploy: {gpus: {trainer: 1, rollout: 1}, accelerator: L4, image: reg.example/aurora:cpu}"
    topo = _topology(tmp, extra=gpus + "\npools: [{name: spot, parents: [relay_eu], max_size: 4}]")
    for target in ("compose", "kubernetes", "skypilot"):
        deploy(topo, target, tmp / target, members={"spot": 2})
    return {t: tmp / t for t in ("compose", "kubernetes", "skypilot")}


def test_the_compose_file_is_valid_by_the_compose_specification(outputs: dict[str, Path]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(vendored.read_text())
    doc = yaml.safe_load((outputs["compose"] / "compose.yaml").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    svc = doc["services"]
    members = {n for n in svc if n.startswith("spot-")}
    assert len(members) == 2
    assert set(svc) - members == {"trainer", "relay-eu", "rollout-1", "rollout-2"}
    assert all(svc[m]["depends_on"] == ["relay-eu"] for m in members)  # the pool's first parent
    assert all("--pool spot --credential" in " ".join(svc[m]["command"]) for m in members)
    assert svc["rollout-1"]["depends_on"] == ["relay-eu"]
    assert "depends_on" not in svc["trainer"]
    assert all(s["restart"] == "unless-stopped" for s in svc.values())
    assert svc["trainer"]["expose"] == ["47000"]
    assert "expose" not in svc["rollout-1"]
    gpu = svc["rollout-1"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["count"] == 1
    assert gpu["capabilities"] == ["gpu"]
    assert "deploy" not in svc["relay-eu"]
    assert svc["trainer"]["image"] == "aurora:cuda"
    assert svc["relay-eu"]["image"] == "reg.example/aurora:cpu"
    # a service mounts its own secrets only
    for name, s in svc.items():
        own = "relay_eu" if name == "relay-eu" else name.replace("spot-", "spot.")
        assert [v for v in s["volumes"] if SECRET in v] == [f"./secrets/{own}:{SECRET}:ro"]


def test_the_kubernetes_manifests_are_valid_by_the_kubernetes_schemas(outputs: dict[str, Path]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    files = sorted((outputs["kubernetes"] / "kubernetes").rglob("*.yaml"))
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text())]
    for d in docs:
        kv.validate(d, kv.latest_version(), strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Deployment") == 6  # four nodes, two pool members
    assert kinds.count("Secret") == 6
    assert kinds.count("ConfigMap") == 1
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    # the listening nodes: their children dial tcp://SERVICE:PORT
    assert set(services) == {"aurora-deploy-test-trainer", "aurora-deploy-test-relay-eu"}
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    pod = deps["aurora-deploy-test-relay-eu"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"topology.kubernetes.io/region": "europe-west4"}
    assert pod["restartPolicy"] == "Always"
    trainer = deps["aurora-deploy-test-trainer"]["spec"]["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert any("persistentVolumeClaim" in v for v in trainer["volumes"])  # a rescheduled trainer resumes
    topo = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["topology.yaml"])
    assert topo["nodes"][1]["listen"] == "tcp://aurora-deploy-test-relay-eu:47001"
    # the Secrets are files of their own, 0600, in a 0700 directory (the rest is 0644)
    secret_files = {f for f in files if any(d["kind"] == "Secret" for d in yaml.safe_load_all(f.read_text()))}
    assert {f.parent.name for f in secret_files} == {"secrets"}
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in secret_files)
    assert stat.S_IMODE(outputs["kubernetes"].stat().st_mode) == 0o700


def test_the_skypilot_tasks_load_with_skypilots_own_loader(outputs: dict[str, Path]) -> None:
    sky = pytest.importorskip("sky")
    tasks = {f.stem: yaml.safe_load(f.read_text()) for f in (outputs["skypilot"] / "skypilot").iterdir()}
    members = {n for n in tasks if n.startswith("spot-")}
    assert set(tasks) - members == {"trainer", "relay-eu", "rollout-1", "rollout-2"}
    assert len(members) == 2
    for t in tasks.values():
        sky.Task.from_yaml_config(copy.deepcopy(t))  # (it takes the dict apart)
    assert all(tasks[m]["resources"]["use_spot"] is True for m in members)  # members may run on spot machines
    assert not any("use_spot" in tasks[n]["resources"] for n in set(tasks) - members)
    relay = tasks["relay-eu"]["resources"]
    assert (relay["cloud"], relay["region"], relay["ports"]) == ("gcp", "europe-west4", [47001])
    assert "accelerators" not in relay
    assert tasks["rollout-1"]["resources"]["accelerators"] == "L4:1"
    assert tasks["trainer"]["file_mounts"][SECRET] == "./secrets/trainer"
    assert tasks["trainer"]["run"].startswith(f"chmod -R go-rwx {SECRET} && exec python3 -m aurora")
    assert "--bind tcp://0.0.0.0:47000" in tasks["trainer"]["run"]


def test_the_dockerfiles_pass_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(
        [hadolint, *sorted(map(str, (root / "docker").glob("*.Dockerfile")))], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_node_is_given_another_nodes_secret(outputs: dict[str, Path], tmp_path: Path) -> None:
    for target, out in outputs.items():
        secrets = _secrets(out.parent / "keys")
        bundle = b"".join(_every_file(out / "bundle").values())
        assert not any(s in bundle for s in secrets.values()), f"{target}: a secret in the bundle"
        configmaps = b"".join(f.read_bytes() for f in out.rglob("bundle.yaml"))
        assert not any(base64.b64encode(s) in configmaps or s in configmaps for s in secrets.values())
        members = set()
        for node_dir in (out / "secrets").iterdir():
            files = _every_file(node_dir)
            if node_dir.name.startswith("spot."):  # a pool member: its own credential, of its own name
                assert set(files) == {"member.json"}, (target, node_dir.name, set(files))
                assert read_credential(node_dir / "member.json").name == node_dir.name
                members.add(files["member.json"])
            else:
                own = {f"{node_dir.name}.key_secret"} | ({"trainer.sign"} if node_dir.name == "trainer" else set())
                assert set(files) == own, (target, node_dir.name, set(files))
                assert all(files[k] == secrets[k] for k in files)
            assert stat.S_IMODE(node_dir.stat().st_mode) == 0o700
            assert all(stat.S_IMODE((node_dir / k).stat().st_mode) == 0o600 for k in files)
        assert len(members) == 2  # two members, two credentials
        assert not any(m in bundle or base64.b64encode(m) in configmaps for m in members)
    # Kubernetes: each node's Secret holds its own keys, and its pod mounts that Secret only
    for f in (outputs["kubernetes"] / "kubernetes").rglob("*.yaml"):
        docs = list(yaml.safe_load_all(f.read_text()))
        for d in docs:
            if d["kind"] == "Secret" and f.stem.startswith("spot-"):  # a member's: its credential alone
                member = f.stem.replace("spot-", "spot.")
                assert set(d["data"]) == {"member.json"}
                got = base64.b64decode(d["data"]["member.json"])
                assert got == (outputs["kubernetes"] / "secrets" / member / "member.json").read_bytes()
            elif d["kind"] == "Secret":
                node = f.stem.replace("relay-eu", "relay_eu")
                assert set(d["data"]) == {f"{node}.key_secret"} | ({"trainer.sign"} if node == "trainer" else set())
                secrets = _secrets(outputs["kubernetes"].parent / "keys")
                assert all(base64.b64decode(v) == secrets[k] for k, v in d["data"].items())
            if d["kind"] == "Deployment":
                vols = d["spec"]["template"]["spec"]["volumes"]
                names = [v["secret"]["secretName"] for v in vols if "secret" in v]
                assert names == [f"aurora-deploy-test-{f.stem}-keys"]


def test_a_pool_ships_its_public_key_inline_and_its_members_credentials_hold_against_the_bundle(
    outputs: dict[str, Path],
) -> None:
    """The pool's secret key stays with the operator (above: in no output); its public key is in the
    shipped topology, and a credential enrolled where the secret is checks against that topology."""
    out = outputs["compose"]
    original = out.parent / "t.yaml"
    shipped = out / "bundle" / "topology.yaml"
    pub = (out.parent / "keys" / "spot.pool_pub").read_text().strip()
    assert load_topology(shipped).pool("spot").key == pub
    cred = enroll(load_topology(original), str(original), "spot", 3600, time.time())
    assert check_credential(load_topology(shipped), str(shipped), cred, time.time()).name == "spot"


def test_a_node_loads_its_keys_from_the_bundle_and_its_own_secrets_alone(outputs: dict[str, Path]) -> None:
    out = outputs["kubernetes"]
    for node in ("trainer", "relay_eu", "rollout-1"):
        text = (out / "bundle" / "topology.yaml").read_text().replace(SECRET, str(out / "secrets" / node))
        path = out / "bundle" / f"as-{node}.yaml"  # the bundle's keys/ is relative to the topology file
        path.write_text(text)
        keys = load_node_keys(load_topology(path), node, str(path))
        assert keys.secure
        assert (keys.signer is not None) == (node == "trainer")
        assert keys.verifier is not None
        path.unlink()


def test_a_learner_of_ones_own_ships_its_code_and_a_training_loop_is_refused(tmp_path: Path) -> None:
    topo = _topology(tmp_path)
    (tmp_path / "mine.py").write_text("from helper import make\n")
    (tmp_path / "helper.py").write_text("def make(context):\n    return None\n")
    own = tmp_path / "own.yaml"
    learner = 'learner: {kind: python, factory: "mine:make", options: {lr: 0.1}}'
    own.write_text(re.sub(r"learner: \{kind: synthetic[^}]*\}", learner, topo.read_text()))
    deploy(own, "compose", tmp_path / "out")
    shipped = load_topology(tmp_path / "out" / "bundle" / "topology.yaml")
    assert isinstance(shipped.learner, PythonSpec)
    assert Path(shipped.learner.module_dir or "") == tmp_path / "out" / "bundle" / "learner"
    assert (tmp_path / "out" / "bundle" / "learner" / "helper.py").is_file()
    assert load_factory(shipped.learner).__module__ == "helper"  # its module and what it imports, from the bundle
    loop = tmp_path / "loop.yaml"
    loop.write_text(re.sub(r"learner: \{kind: synthetic[^}]*\}", "learner: {kind: loop}", topo.read_text()))
    with pytest.raises(ConfigError, match="your own training loop, which aurora deploy cannot start"):
        deploy(loop, "compose", tmp_path / "out2")


def test_members_of_a_pool_it_has_not_or_too_many_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = _topology(tmp_path, extra="pools: [{name: spot, parents: [relay_eu], max_size: 2}]")
    with pytest.raises(ConfigError, match="no pool named 'gpu'"):
        deploy(topo, "compose", tmp_path / "out", members={"gpu": 1})
    with pytest.raises(ConfigError, match=r"takes 1\.\.2 members, not 3"):
        deploy(topo, "compose", tmp_path / "out", members={"spot": 3})
    assert not (tmp_path / "out").exists()
    assert main(["deploy", str(topo), "--to", "compose", "-o", str(tmp_path / "out"), "--members", "spot"]) != 0
    assert "expected POOL=N" in capsys.readouterr().err
    assert main(["deploy", str(topo), "--to", "compose", "-o", str(tmp_path / "out"), "--members", "spot=2"]) == 0
    assert "pool spot: 2 members" in capsys.readouterr().out


def test_deploy_refuses_what_it_cannot_ship(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = _topology(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["deploy", str(topo), "--to", "compose", "-o", str(tmp_path / "busy")]) != 0
    assert "is not an empty directory" in capsys.readouterr().err
    secret = tmp_path / "keys" / "rollout-2.key_secret"
    kept = secret.read_bytes()
    secret.unlink()
    with pytest.raises(ConfigError, match=r"rollout-2\.key_secret is missing"):
        deploy(topo, "compose", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.deploy-*"))
    secret.write_bytes(kept)
    secret.chmod(0o600)
    bare = tmp_path / "bare.yaml"
    bare.write_text(topo.read_text().replace("keys: {dir: keys}", ""))
    with pytest.raises(ConfigError, match="needs the topology's keys"):
        deploy(bare, "kubernetes", tmp_path / "out")
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(topo.read_text().replace("keys: {dir: keys}", "keys: {dir: keys}\ndeploy: {gpus: {rollout: 1}}"))
    with pytest.raises(ConfigError, match=r"deploy\.accelerator"):
        deploy(gpu, "skypilot", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    loop = tmp_path / "loop.yaml"
    loop.write_text(topo.read_text().replace(HOST, "127.0.0.1"))
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.listen: tcp://127\.0\.0\.1:47000 is loopback"):
        deploy(loop, "skypilot", tmp_path / "out")
    deploy(loop, "compose", tmp_path / "out")  # Compose and Kubernetes give every node a name of its own
    shutil.rmtree(tmp_path / "out")
    model = tmp_path / "model.yaml"  # a model no pod can get: never a random one in its place
    model.write_text(topo.read_text() + "model: {path: m}\n")
    with pytest.raises(ConfigError, match=r"model\.fetch: the nodes need the model and .*m is missing here"):
        deploy(model, "compose", tmp_path / "out")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    deploy(model, "compose", tmp_path / "out")  # mounted from this machine
    with pytest.raises(ConfigError, match="a pod can only fetch it"):
        deploy(model, "kubernetes", tmp_path / "k8s")


def _as_container(out: Path, node: str, argv: list[str], root: Path) -> list[str]:
    """``argv`` as node ``node``'s container runs it, its mounts as directories here: the bundle at
    ``CONF``, its own secrets at ``SECRET``, a store at ``STORE``; it binds loopback only."""
    conf = root / node / "conf"
    shutil.copytree(out / "bundle", conf)
    topo = conf / "topology.yaml"
    topo.write_text(topo.read_text().replace(SECRET, str(out / "secrets" / node)).replace(HOST, "localhost"))
    subst = {CONF: str(conf), STORE: str(root / node / "store"), SECRET: str(out / "secrets" / node)}
    args = []
    for a in argv:
        for k, v in subst.items():
            a = a.replace(k, v)
        args.append(a.replace("0.0.0.0", "127.0.0.1"))
    return [sys.executable, *args[1:]]


def test_the_deployed_units_run_as_their_containers_would_and_converge(tmp_path: Path) -> None:
    """SkyPilot's units keep the topology's listen addresses (a name, here meaning ``localhost``: children
    dial a name) while each node binds ``--bind`` (here 127.0.0.1): every node ends on the trainer's last
    version, each with only its own secret — a pool member too, with only its credential."""
    ports = free_ports(2)
    topo = _topology(tmp_path, ports, extra="pools: [{name: spot, parents: [relay_eu], max_size: 2}]")
    d, _ = deploy(topo, "skypilot", tmp_path / "out", members={"spot": 1})
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {u.name: tmp_path / f"{u.name}.log" for u in d.units}
    try:
        for u in d.units:
            argv = _as_container(tmp_path / "out", u.name, list(u.argv), tmp_path / "run")
            with logs[u.name].open("wb") as err:
                procs[u.name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

        def last(name: str, event: str) -> int:
            return max((e["version"] for e in log_events(logs[name]) if e["event"] == event), default=-1)

        wait_until(lambda: last("trainer", VERSION_PUBLISHED) >= STEPS, 180, "the trainer's last version")
        wait_until(
            lambda: all(last(u.name, VERSION_COMMITTED) >= STEPS for u in d.units if u.role != "trainer"),
            120,
            "every node on the last version",
        )
        digests = {
            u.name: {e["version"]: e.get("digest") for e in log_events(logs[u.name]) if e["event"] == VERSION_COMMITTED}
            for u in d.units
            if u.role != "trainer"
        }
        published = {
            e["version"]: e.get("digest") for e in log_events(logs["trainer"]) if e["event"] == VERSION_PUBLISHED
        }
        assert all(v[STEPS] == published[STEPS] for v in digests.values())
        started = {u.name: next(e for e in log_events(logs[u.name]) if e["event"] == NODE_STARTED) for u in d.units}
        assert all(e["authenticated"] for e in started.values())
        assert started["trainer"]["listen"] == f"tcp://127.0.0.1:{ports[0]}"  # bound where --bind says
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_node_bind_is_refused_where_it_means_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = _topology(tmp_path)
    assert main(["node", "--topology", str(topo), "--name", "rollout-1", "--bind", "tcp://0.0.0.0:1"]) != 0
    assert "'rollout-1' has no listen address" in capsys.readouterr().err
    assert main(["node", "--topology", str(topo), "--name", "trainer", "--bind", "0.0.0.0:47000"]) != 0
    assert "--bind must be tcp://HOST:PORT" in capsys.readouterr().err
