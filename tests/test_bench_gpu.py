"""`aurora bench gpu`, the one-command GPU check, on a machine without a GPU: every check says it did
not run (and nothing runs); an unknown check is refused; the short RL run it makes (a trainer and one
vLLM rollout on the tiny model) runs here on the CPU too (slow layer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aurora.bench import gpu
from aurora.cli import main


def test_without_a_gpu_every_check_says_it_did_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "gpu_count", lambda: 0)
    assert main(["bench", "gpu", "--json", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr().out
    for name in ("codec", "vllm", "trainer", "rl"):
        assert f"{name:<8} not run" in out
    r = json.loads((tmp_path / "g.json").read_text())
    assert r["gpus"] == 0
    assert [c["ok"] for c in r["checks"]] == [None] * 4
    assert main(["bench", "gpu", "--only", "rl,nvme"]) == 2
    assert "--only: no check nvme (checks: codec, vllm, trainer, rl)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_checks_short_rl_run_runs(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    c = gpu.rl(tmp_path, 1)  # here on the CPU: the same topology, vLLM's CPU build
    assert c.ok, c.figure
    assert c.figure.startswith("reward: first")
