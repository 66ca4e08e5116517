"""A rollout whose engine is a ``vllm serve`` on its host (`aurora.rl.engines.vllm_served`), on the tiny
model: one the rollout launches, in a real cluster of processes (`aurora run`), and one its user
started (the command `aurora topology check` prints), fed versions while its OpenAI-compatible API
answers other callers. vLLM's own server with Aurora's weight-transfer backend loaded as a plugin."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from aurora.config.rl import EngineSpec, ModelSpec, ServeSpec, SyntheticSpec
from aurora.events import ENGINE_CHECKED, ENGINE_SERVER_LAUNCHED, ENGINE_SERVER_STOPPED
from aurora.rl.engines import WeightUpdate, make_engine
from aurora.rl.engines.vllm_served import EngineServerError
from aurora.rl.learners.synthetic import SyntheticLearner
from aurora.rl.model import init_model_dir
from aurora.rl.types import Prompt
from aurora.runtime.processes import end_group, start_group
from tests.helpers import free_ports, one_rollout_topology
from tests.test_engine_async import _delta

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LEARNER = "{kind: grpo, group_size: 8, prompts_per_step: 32, lr: 1.0e-3, warm_start_steps: 20}"


def _topology(tmp: Path, serve: str, model: str = "") -> Path:
    engine = f"{{kind: vllm, max_new_tokens: 5, temperature: 1.0, serve: {serve}}}"
    return one_rollout_topology(tmp, learner=LEARNER, engine=engine, steps=6, model=model)


def _events(log: Path, event: str) -> list[dict[str, object]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            e = json.loads(line)
            if e.get("event") == event:
                out.append(e)
    return out


@pytest.mark.timeout(600)
def test_a_rollout_generates_on_the_vllm_serve_it_launches_and_stops(tmp_path: Path) -> None:
    (serve,) = free_ports(1)
    topo = _topology(tmp_path, f'{{url: "http://127.0.0.1:{serve}"}}')
    check = subprocess.run(
        [sys.executable, "-m", "aurora", "topology", "check", str(topo)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    assert f"rollout-1: generates on a vllm serve at http://127.0.0.1:{serve} that it starts and stops" in check.stdout
    state = tmp_path / "state"
    r = subprocess.run(
        [sys.executable, "-m", "aurora", "run", str(topo), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: every node holds version 6" in r.stdout
    log = state / "rollout-1.log"
    launched = _events(log, ENGINE_SERVER_LAUNCHED)
    assert len(launched) == 1
    checked = _events(log, ENGINE_CHECKED)
    assert checked
    assert all(e["ok"] for e in checked)  # every version it served, read back bit for bit
    assert any(e["partial"] for e in checked)  # deltas went in as deltas, not whole models
    ok = re.search(r"^rollout-1 .* ok (\d+) rejected 0", r.stdout, re.M)
    assert ok is not None, r.stdout[-2000:]
    assert int(ok.group(1)) >= 6 * 4  # the trainer learned from the served rollout's results
    assert _events(log, ENGINE_SERVER_STOPPED)
    assert not psutil.pid_exists(int(str(launched[0]["pid"]))) or psutil.Process(
        int(str(launched[0]["pid"]))
    ).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@pytest.mark.timeout(600)
def test_a_rollout_feeds_a_vllm_serve_its_user_started_while_others_use_its_api(tmp_path: Path) -> None:
    import aiohttp

    model = ModelSpec(path=str(init_model_dir(tmp_path / "tiny", "tiny", seed=3)))
    (port,) = free_ports(1)
    spec = EngineSpec(  # the topology's engine (its seed 0, the server's)
        kind="vllm",
        model=model,
        max_new_tokens=8,
        serve=ServeSpec(url=f"http://127.0.0.1:{port}", launch=False),
    )
    topo = _topology(tmp_path, f'{{url: "http://127.0.0.1:{port}", launch: false}}', f"{{path: {model.path}}}")
    check = subprocess.run(
        [sys.executable, "-m", "aurora", "topology", "check", str(topo)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    line = next(x for x in check.stdout.splitlines() if x.startswith("rollout-1: generates on the vllm serve"))
    command = line.split("started on its host by: ", 1)[1]
    env_part, _, argv_part = command.partition(" python ")
    env = {**os.environ, **dict(kv.split("=", 1) for kv in env_part.split())}
    argv = [sys.executable, *shlex.split(argv_part)]
    with (tmp_path / "serve.log").open("wb") as out:
        server = start_group(argv, env=env, stdout=out, stderr=out)
    learner = SyntheticLearner(SyntheticSpec(model=model, density=0.05, seed=1))
    versions = [learner.initial().copy(), learner.step().copy()]

    async def go() -> None:
        engine = make_engine(spec)
        try:
            await engine.start()  # waits for the server it did not start
            host = versions[0].copy()
            await engine.apply(WeightUpdate(0, host.digest(), host, None))
            await engine.apply(_delta(host, versions[0], versions[1], 1))
            c = await engine.complete(Prompt(1, "1+2="), 4)
            await engine._last_check
            assert engine.version == c.version == 1
            assert len(c.samples) == 4
            assert all(len(s.tokens) == len(s.logprobs) for s in c.samples)
            assert engine.stager is not None
            assert engine.stager.digest(engine.stager.served) == versions[1].digest()
            assert (engine.partial_updates, engine.full_reloads) == (1, 0)
            # the same server answers an OpenAI-style client meanwhile, on the version it was given
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{spec.serve.url}/v1/completions",  # type: ignore[union-attr]
                    json={"model": model.path, "prompt": "1+2=", "max_tokens": 3},
                ) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["text"] is not None
                async with http.get(f"{spec.serve.url}/weight_info") as r:  # type: ignore[union-attr]
                    assert (await r.json())["weight_version"] == "1:2"
        finally:
            await engine.close()

    async def refused() -> None:  # a server that does not serve as the engine needs is refused, naming why
        engine = make_engine(dataclasses.replace(spec, seed=5))
        with pytest.raises(EngineServerError, match=r"seed 0 \(the engine needs 5\)"):
            await engine.start()

    try:
        asyncio.run(go())
        asyncio.run(refused())
        assert server.poll() is None  # the rollout leaves a server it did not start running
    finally:
        end_group(server, grace_s=10.0)
