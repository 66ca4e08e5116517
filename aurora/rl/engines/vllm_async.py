"""`AsyncVllmEngine`: continuous rollouts on vLLM's async engine; a version switch pauses, never drains.

The engine is vLLM's `AsyncLLM` (its engine core in a process of its own,
spawned), started with Aurora's weight-transfer backend
(`aurora.vllm_backend`). Everything here is a coroutine on the node's event
loop; nothing blocks it but the staging write, which runs in a thread.

Generation (`complete`): one leased prompt is one vLLM request (``n``
samples), submitted when it is granted, and its `Completion` is returned as
soon as that request is done — no batch waits for its slowest sample.

A switch (`apply`): ``pause_generation(mode="keep")`` freezes the requests in
flight (they are not aborted), the touched tensors' groups are loaded through
vLLM's weight-update session, tagged with ``weight_version`` ``"V:L"`` (version
V, the engine's L-th load), and generation resumes; the requests in flight go
on with the new weights. vLLM reports, for every sample, which tags made which
of its output tokens; a sample made by more than one version carries
``Sample.spans`` [(version, first token index), …], and a completion's version
is the *oldest* version in any of its samples (the one the trainer's staleness
rule judges). The importance ratio uses the per-token behaviour
log-probabilities, which each token was sampled with, whatever its version.

KV under the old version (``engine.kv_on_switch``): ``keep`` (the default) lets
a request in flight keep the KV cache its earlier tokens computed under the
old version — nothing is recomputed, the switch costs only the load — and
turns vLLM's prefix caching off, so no *new* request ever reuses KV of an
older version. ``recompute`` preempts every running request at the switch
(vLLM's ``reset_prefix_cache(reset_running_requests=True)``), so their KV is
computed again under the new weights. Either way the tokens are labelled by
the version that sampled them.

Verification, off the switch's critical path: after generation resumes, the
backend reads back what was staged (in the engine core, between steps) and
the engine compares the digest with the version's. A completion is returned
only when every load that made its tokens has passed its check; one made
(in part) by a load that failed is dropped (logged) and generated again. A
failed check leaves the engine serving nothing (`unserved` is set) until the
worker loads the version again, every tensor; a version that fails twice
running makes `complete` raise `DeltaFormatError` (the worker crashes, and its
restart loads again). A load that fails in vLLM is retried whole while still
paused; one that fails whole leaves generation paused — a half-loaded model
never generates. So no result made with weights that are not bit for bit the
version's ever leaves the worker. Checks run in load order: a switch waits for
the previous load's check (the record of verified tensors it builds on).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import structlog

from aurora import vllm_backend
from aurora.config.rl import EngineSpec
from aurora.errors import ConfigError, DeltaFormatError, EngineError
from aurora.events import ENGINE_CHECKED
from aurora.rl.engines.base import WeightUpdate, prompt_ids
from aurora.rl.engines.vllm_engine import Entry, Staged, Stager, _vllm_start, sampled, sampling_fields
from aurora.rl.model import Tokenizer
from aurora.rl.types import Completion, Prompt, Sample

Made = tuple[list[int], list[float], list[tuple[str, int]]]
"""A sample as a vLLM returned it: token ids, behaviour log-probabilities, and vLLM's weight-version spans
(the tag in force, first token index)."""

Sampled = tuple[list[int], list[float], list[tuple[int, int, int]]]
"""A sample as vLLM made it: token ids, behaviour log-probabilities, and its spans (version, load, first
token index) from its tokens' weight versions (`spans_of`)."""

log = structlog.get_logger("aurora.rl.engines.vllm_async")


def _tag(version: int, serial: int) -> str:
    return f"{version}:{serial}"


def _untag(tag: str) -> tuple[int, int]:
    v, _, load = tag.partition(":")
    return int(v), int(load)


def spans_of(weight_versions: Sequence[tuple[str, int]], fallback: str) -> list[tuple[int, int, int]]:
    """vLLM's weight-version spans of one sample, (tag, first token index), as (version, load, first token
    index); consecutive spans of one load merged. A sample vLLM labelled with nothing was made by
    ``fallback`` (the tag served when it was submitted; vLLM leaves an empty output unlabelled)."""
    out: list[tuple[int, int, int]] = []
    for tag, start in weight_versions:
        v, load = _untag(tag)
        if not out or out[-1][1] != load:
            out.append((v, load, int(start)))
    if not out:
        v, load = _untag(fallback)
        out.append((v, load, 0))
    return out


class VllmClient(Protocol):
    """The ways into one vLLM that `AsyncVllmEngine` uses: its async engine in a process of this node
    (`InProcessVllm`) or a ``vllm serve`` on this host over HTTP (`aurora.rl.engines.vllm_served`).
    Every method is vLLM's own public interface (its engine client, its RL and generate endpoints);
    ``aurora_*`` calls go to the Aurora backend's worker extension through ``collective_rpc``."""

    async def start(self) -> None: ...
    async def names(self) -> list[str]: ...
    async def init_transfer(self, staging: str) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def load(self, update_info: dict[str, Any], tag: str) -> None: ...
    async def reset_running_kv(self) -> None: ...
    async def digests(self, name: str) -> dict[str, Entry]: ...
    async def generate(self, ids: list[int], fields: dict[str, Any], *, labelled: bool = True) -> list[Made]:
        """``fields``' samples of ``ids``; ``labelled`` False: made before any version (their labels unused)."""
        ...

    async def close(self) -> None: ...


class InProcessVllm:
    """vLLM's `AsyncLLM` made by this process, its engine core a spawned process of its own."""

    def __init__(self, spec: EngineSpec, model_dir: str) -> None:
        self.spec, self.dir = spec, model_dir
        self.llm: Any = None

    async def start(self) -> None:
        """Start vLLM's engine core (a spawned process: its start-up does not see this process's modules)."""
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        with _vllm_start():
            from vllm.config.weight_transfer import WeightTransferConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            vllm_backend.register()
            m = self.spec.the_model
            args = AsyncEngineArgs(
                model=self.dir,
                dtype="bfloat16",
                seed=self.spec.seed,
                enforce_eager=True,
                kv_cache_memory_bytes=self.spec.kv_cache_mb << 20,
                logprobs_mode="processed_logprobs",
                max_model_len=m.max_positions,
                enable_prefix_caching=self.spec.kv_on_switch == "recompute",
                tensor_parallel_size=self.spec.tensor_parallel,
                weight_transfer_config=WeightTransferConfig(backend=vllm_backend.BACKEND),
                worker_extension_cls=vllm_backend.EXTENSION,
            )
            self.llm = AsyncLLM.from_engine_args(args)

    async def names(self) -> list[str]:
        return list((await self.llm.collective_rpc("aurora_names"))[0])

    async def init_transfer(self, staging: str) -> None:
        await self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"staging": staging}})

    async def pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def load(self, update_info: dict[str, Any], tag: str) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.start_weight_update()
        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await self.llm.finish_weight_update(weight_version=tag)

    async def reset_running_kv(self) -> None:
        await self.llm.reset_prefix_cache(reset_running_requests=True)

    async def digests(self, name: str) -> dict[str, Entry]:
        return dict((await self.llm.collective_rpc("aurora_digests", args=(name,)))[0])  # `Stager.record` normalises

    async def generate(self, ids: list[int], fields: dict[str, Any], *, labelled: bool = True) -> list[Made]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**fields, output_kind=RequestOutputKind.FINAL_ONLY)  # every sample at once
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex):
            final = out
        assert final is not None
        made: list[Made] = []
        for o in final.outputs:
            spans = [(str(w.version), int(w.start)) for w in o.weight_versions or []]
            made.append((*sampled(o), spans))
        return made

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


class AsyncVllmEngine:
    """Continuous generation and pausing switches on vLLM's async engine (module docstring): in this
    process (`InProcessVllm`), or a ``vllm serve`` (``client``: `aurora.rl.engines.vllm_served.ServedVllm`,
    as `aurora.rl.engines.make_engine` picks for an engine with ``serve``).

    ``version``: the version generation runs on now (its check may still be running); None before the
    first load and while a failed engine serves nothing. Call `start` on the node's event loop first."""

    continuous = True
    """Driven by `aurora.actors.work.ContinuousWorker` (not the batch `Worker`)."""

    def __init__(self, spec: EngineSpec, client: Callable[[EngineSpec, str], VllmClient] | None = None) -> None:
        m = spec.the_model
        if m.path is None:
            raise ConfigError("a vllm engine needs a model directory (model.path)", path="engine.model.path")
        self.spec = spec
        self.dir = m.directory()
        self.tok = Tokenizer.for_model(m)
        self.version: int | None = None
        self.vllm: VllmClient = (client or InProcessVllm)(spec, str(self.dir))
        self.stager: Stager | None = None
        self._tag = ""
        self._checks: dict[int, asyncio.Future[bool]] = {}
        """Load serial -> its check: True passed, False failed (its results are dropped)."""
        self._loaded: dict[int, int] = {}
        """Load serial -> the version it loaded (a sample's labels must name one of these)."""
        self._last_check: asyncio.Task[None] | None = None
        self._switch = asyncio.Lock()
        self._host: WeightUpdate | None = None
        self.broken: BaseException | None = None
        self.dropped = 0
        """Completions dropped because a load that made their tokens failed its check."""
        self.check_s = 0.0
        """Seconds spent on checks (reading back, in the engine core, and comparing)."""
        self.pause_s = 0.0
        """Seconds generation was paused by switches."""
        self.last_switch: dict[str, float] = {}
        """The last switch's parts (ms): the staging write (before the pause), waiting for the pause
        (the step in flight ends), the load through vLLM and the resume."""
        self.full_reloads = 0
        self._failed: int | None = None
        """The version whose last load failed its check (a second failure of it is fatal)."""
        self.serving = asyncio.Event()
        """Set while the engine serves a version (or is broken: then `complete` raises)."""
        self.unserved = asyncio.Event()
        """Set when a failed check left the engine serving nothing (the worker reloads)."""

    @property
    def partial_updates(self) -> int:
        return self.stager.partial_updates if self.stager is not None else 0

    async def start(self) -> None:
        """Start the vLLM (or reach the served one), warm it up, and open its Aurora backend; on a failure
        whatever was started is stopped."""
        try:
            await self.vllm.start()
            await self._warm_up()
            self.stager = Stager(set(await self.vllm.names()))
            await self.vllm.init_transfer(str(self.stager.dir))
        except BaseException:
            await self.close()
            raise

    async def _warm_up(self) -> None:
        """One short request on the directory's weights before any version: an engine's first step
        creates its kernels' primitives (seconds on a busy CPU), which would otherwise hold up the
        first leased prompt and the first switch's pause."""
        # as a rollout's requests are (seeded, several samples, log-probabilities)
        fields = {"n": 2, "temperature": 1.0, "max_tokens": 2, "logprobs": 0, "seed": 0}
        t0 = time.perf_counter()
        await self.vllm.generate([0, 1], fields, labelled=False)
        log.info("engine_warmed_up", warm_up_ms=round((time.perf_counter() - t0) * 1e3, 1))

    async def close(self) -> None:
        await self.vllm.close()

    # -- switching
    async def apply(self, update: WeightUpdate) -> None:
        """Switch to ``update``'s version: pause (keep), load, resume; its check runs after (module
        docstring). Returns once generation runs on the new version."""
        async with self._switch:
            if self._last_check is not None:
                await self._last_check
            self.broken = None  # a worker restarted after a fatal check tries again, every tensor
            staged = await self._load(update, update.touched)
            self._host = update
            self._last_check = asyncio.create_task(self._check(update, staged))

    async def _load(self, update: WeightUpdate, touched: Any) -> Staged:
        """Stage, then pause (keep), load, resume: the staging write is outside the pause. A partial load
        that fails is followed, still paused, by a load of every tensor; a full load that fails raises
        and leaves generation paused (a half-loaded model never generates; the next `apply` resumes it)."""
        assert self.stager is not None
        t0 = time.perf_counter()
        staged = await asyncio.to_thread(self.stager.stage, update.weights, touched)
        t1 = time.perf_counter()
        await self.vllm.pause()
        t2 = time.perf_counter()
        try:
            await self._session(update, staged)
        except Exception as e:
            if staged.partial is False:
                raise
            log.warning("vllm_update_failed", version=update.version, error=repr(e), retry="every tensor")
            staged = await asyncio.to_thread(self.stager.stage, update.weights, None)
            await self._session(update, staged)
        await self.vllm.resume()
        t3 = time.perf_counter()
        self.pause_s += t3 - t1
        self.last_switch = {
            "stage_ms": round((t1 - t0) * 1e3, 2),
            "pause_wait_ms": round((t2 - t1) * 1e3, 2),
            "load_ms": round((t3 - t2) * 1e3, 2),
        }
        self.stager.partial_updates += staged.partial
        self.serving.set()
        return staged

    async def _session(self, update: WeightUpdate, staged: Staged) -> None:
        """One vLLM weight-update session of a staged file, tagged ``"V:L"`` (the file is removed if it
        fails)."""
        assert self.stager is not None
        tag = _tag(update.version, staged.serial)
        self._checks[staged.serial] = asyncio.get_running_loop().create_future()
        self._loaded[staged.serial] = update.version
        try:
            await self.vllm.load(self.stager.update_info(staged), tag)
            if self.spec.kv_on_switch == "recompute":
                await self.vllm.reset_running_kv()
        except Exception:
            staged.path.unlink(missing_ok=True)
            self._checks.pop(staged.serial).set_result(False)
            self.version = None
            self.serving.clear()
            raise
        self.version, self._tag = update.version, tag

    async def _check(self, update: WeightUpdate, staged: Staged) -> None:
        """Verify a load. A failed one is dropped with its results and the engine serves nothing
        (`unserved` is set: the worker loads the version again, every tensor); a version that fails
        twice running leaves the engine broken."""
        assert self.stager is not None
        t0 = time.perf_counter()
        try:
            got = await self.vllm.digests(staged.path.name)
        finally:
            staged.path.unlink(missing_ok=True)
        record = Stager.record(staged, got)
        ok = Stager.digest(record) == update.digest
        dt = time.perf_counter() - t0
        self.check_s += dt
        self._checks[staged.serial].set_result(ok)
        log.info(ENGINE_CHECKED, version=update.version, ok=ok, check_ms=round(dt * 1e3, 2), partial=staged.partial)
        if ok:
            self.stager.served = record
            self._failed = None
            return
        if self._failed == update.version:
            self.broken = DeltaFormatError(f"engine weights do not hash to version {update.version}'s digest")
            self.serving.set()  # waiting completions wake to the error
        log.warning(
            "engine_full_reload",
            version=update.version,
            why="the engine's weights did not hash to the version's digest: its results are dropped",
            again=self.broken is None,
        )
        self._failed = update.version
        self.full_reloads += 1
        self.version = None
        self.serving.clear()
        self.unserved.set()

    # -- generation
    async def complete(self, prompt: Prompt, n: int = 1) -> Completion:
        """``n`` samples for ``prompt``, made with the versions the engine served while it ran, each of
        whose loads passed its check (module docstring)."""
        ids = prompt_ids(prompt, self.tok)
        while True:
            if self.broken is not None:
                raise self.broken
            if self.version is None:
                self.serving.clear()
                await self.serving.wait()
                continue
            got = await self._generate(ids, prompt, n)
            labels = {(v, load) for s in got for v, load, _ in s[2]}
            if any(self._loaded.get(load) != v for v, load in labels):
                raise EngineError(f"vLLM labelled tokens with loads {sorted(labels)}, not all of them this engine's")
            loads = {load for _, load in labels}
            if all([await asyncio.shield(self._checks[load]) for load in sorted(loads)]):
                return self._completion(prompt, ids, got)
            self.dropped += 1
            log.warning("results_dropped", item=prompt.id, why="a load that made them failed its check")

    async def _generate(self, ids: list[int], prompt: Prompt, n: int) -> list[Sampled]:
        fields, reps = sampling_fields(self.spec, cast(int, self.version), prompt.id, n)
        tag = self._tag
        outs = await asyncio.gather(*(self.vllm.generate(ids, fields) for _ in range(reps)))
        return [(toks, lps, spans_of(spans, tag)) for out in outs for toks, lps, spans in out]

    def _completion(self, prompt: Prompt, ids: list[int], got: list[Sampled]) -> Completion:
        oldest = min(spans[0][0] for _, _, spans in got)
        samples = []
        for toks, lps, spans in got:
            versions: list[tuple[int, int]] = []
            for v, _, first in spans:  # a reload of one version is one version to the trainer
                if not versions or versions[-1][0] != v:
                    versions.append((v, first))
            plain = len(versions) == 1 and versions[0][0] == oldest
            samples.append(Sample(toks, lps, [] if plain else versions))
        return Completion(prompt.id, ids, samples, oldest)
