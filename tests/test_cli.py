"""`aurora delta ...` end to end on safetensors checkpoints, including user mistakes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aurora.cli import main
from aurora.codec import Weights
from aurora.store.checkpoint import load_checkpoint
from tests.helpers import perturb


@pytest.fixture
def ckpts(tmp_path: Path) -> tuple[Path, Path, Weights]:
    torch.manual_seed(0)
    base = Weights.from_tensors(
        {
            "model.embed.weight": (torch.randn(300, 64) * 0.02).to(torch.bfloat16),
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(300, 64) * 0.02).to(torch.bfloat16),
        }
    )
    target = perturb(base, 0.02, 1)
    save_file(base.to_tensors(), str(tmp_path / "base.safetensors"))
    # The target as a sharded HF checkpoint: an index plus two shards.
    t = target.to_tensors()
    save_file({"model.embed.weight": t["model.embed.weight"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {k: t[k] for k in ("model.norm.weight", "lm_head.weight")}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    wm = {
        "model.embed.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tmp_path / "base.safetensors", tmp_path / "model.safetensors.index.json", target


def test_encode_apply_inspect(
    ckpts: tuple[Path, Path, Weights], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, target_index, target = ckpts
    d, out = tmp_path / "d.audelta", tmp_path / "out.safetensors"
    assert main(["delta", "encode", str(base), str(target_index), "-o", str(d), "--base-version", "4"]) == 0
    assert "v4->v5" in capsys.readouterr().out
    assert main(["delta", "apply", str(base), str(d), "-o", str(out)]) == 0
    assert Weights.from_tensors(load_checkpoint(out)).digest() == target.digest()
    assert "digests verified" in capsys.readouterr().out
    assert main(["delta", "inspect", str(d), "--json", "--chunks"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["base_version"] == 4
    assert info["target_version"] == 5
    assert info["complete"]
    assert 0 < info["density"] < 0.05
    assert info["bytes_per_changed"] > 0
    assert {c["kind"] for c in info["chunk_list"]} <= {"delta", "raw"}
    assert main(["delta", "inspect", str(d)]) == 0
    assert "bytes_per_changed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p / "missing.safetensors", "no such file"),
        (lambda p: (p / "junk.safetensors").write_bytes(b"\x00" * 40) and p / "junk.safetensors", "not a readable"),
        (lambda p: (p / "i.index.json").write_text("{}") and p / "i.index.json", "weight_map"),
    ],
)
def test_bad_checkpoints_give_one_line(
    ckpts: tuple[Path, Path, Weights], tmp_path: Path, make: object, needle: str
) -> None:
    base, _, _ = ckpts
    bad = make(tmp_path)  # type: ignore[operator]
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "delta", "encode", str(base), str(bad), "-o", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_apply_to_wrong_base_writes_nothing(ckpts: tuple[Path, Path, Weights], tmp_path: Path) -> None:
    base, target_index, _ = ckpts
    d, out = tmp_path / "d.audelta", tmp_path / "out.safetensors"
    assert main(["delta", "encode", str(base), str(target_index), "-o", str(d)]) == 0
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "delta", "apply", str(target_index), str(d), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "wrong base" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
    trunc = tmp_path / "t.audelta"
    trunc.write_bytes(d.read_bytes()[:-7])
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "delta", "inspect", str(trunc)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert "truncated" in r.stderr


def test_help_lists_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "aurora", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "delta" in r.stdout
    assert "bench" in r.stdout
    r = subprocess.run([sys.executable, "-m", "aurora", "delta", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_keys_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import stat

    import zmq.auth

    assert main(["keys", "generate", "relay-b", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    public, secret = zmq.auth.load_certificate(str(tmp_path / "relay-b.key_secret"))
    assert public.decode() in out
    assert secret is not None
    assert len(public) == 40
    assert stat.S_IMODE((tmp_path / "relay-b.key_secret").stat().st_mode) == 0o600
    assert main(["keys", "generate", "relay-b", "-o", str(tmp_path)]) == 2  # never overwrites
    assert "refusing to overwrite" in capsys.readouterr().err


def test_topology_check_prints_the_tree_or_one_line_naming_the_path(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora",
            "topology",
            "check",
            str(Path(__file__).parent.parent / "topologies" / "wan-4region.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "└── " in r.stdout
    assert "estimated time to all" in r.stdout
    bad = tmp_path / "t.yaml"
    bad.write_text("name: x\nregions: [{name: a}]\nnodes: [{name: t, role: trainer, region: b, listen: 'tcp://h:1'}]\n")
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "topology", "check", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert r.stderr.strip() == f"aurora: error: {bad}:nodes[0].region: no region named 'b'"


def test_model_init_writes_a_loadable_model_and_refuses_a_used_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path / "tiny"
    assert main(["model", "init", str(d), "--preset", "tiny", "--seed", "3"]) == 0
    assert str(d) in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(str(d))
    assert model.config.model_type == "qwen3"
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.decode(tok("12+7=")["input_ids"], skip_special_tokens=True) == "12+7="
    before = (d / "model.safetensors").read_bytes()
    assert main(["model", "init", str(d)]) == 2  # never overwrites a model
    assert "not empty" in capsys.readouterr().err
    assert (d / "model.safetensors").read_bytes() == before
    assert main(["model", "init", str(tmp_path / "other"), "--seed", "3"]) == 0
    assert (tmp_path / "other" / "model.safetensors").read_bytes() == before  # the seed fixes the weights


def test_bad_codec_threads_and_bench_sizes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(Path(__file__).parent.parent / "topologies" / "tiny.yaml")
    assert main(["node", "--topology", tiny, "--name", "trainer", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "aurora: error: --threads must be at least 1, not 0"
    assert main(["bench", "codec", "--scale", "--sizes", "64M,lots"]) == 2
    assert "--sizes: 'lots' is not an element count" in capsys.readouterr().err
