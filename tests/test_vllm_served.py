"""What a rollout takes from a ``vllm serve`` (`aurora.rl.engines.vllm_served`), without one running: the
command it is started with, and a sample of its answer checked before anything uses it (a sample's
log-probabilities one per token and of that token, at most the tokens asked for, spans from token 0,
increasing, inside the sample). The server itself is tested in tests/test_served_rollout.py (slow layer)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from aurora.config.rl import EngineSpec, ModelSpec, ServeSpec
from aurora.rl.engines.vllm_served import EngineServerError, _Choice, _made, serve_argv


def _choice(
    tokens: list[int], lp_tokens: list[int] | None = None, spans: list[tuple[str, int]] | None = None
) -> _Choice:
    raw = {
        "token_ids": tokens,
        "logprobs": {
            "content": [{"token_id": t, "logprob": -0.5} for t in (tokens if lp_tokens is None else lp_tokens)]
        },
        "weight_versions": [{"version": v, "start": s, "end": len(tokens)} for v, s in spans or []],
    }
    return msgspec.json.decode(json.dumps(raw), type=_Choice)


def test_a_served_sample_is_taken_with_its_spans() -> None:
    assert _made(_choice([5, 6, 7], spans=[("3:1", 0), ("4:2", 2)]), 8) == (
        [5, 6, 7],
        [-0.5] * 3,
        [("3:1", 0), ("4:2", 2)],
    )
    assert _made(_choice([]), 8) == ([], [], [])  # an empty sample vLLM leaves unlabelled


@pytest.mark.parametrize(
    ("choice", "why"),
    [
        (_choice([5, 6], lp_tokens=[5]), "do not match"),
        (_choice([5, 6], lp_tokens=[5, 9]), "not of its sample's token"),
        (_choice(list(range(9))), "do not match"),
        (_choice([5, 6], spans=[("3:1", 1)]), "out of order"),
        (_choice([5, 6], spans=[("3:1", 0), ("4:2", 0)]), "out of order"),
        (_choice([5, 6], spans=[("3:1", 0), ("4:2", 2)]), "out of order"),
    ],
)
def test_a_served_sample_that_does_not_add_up_is_refused(choice: _Choice, why: str) -> None:
    with pytest.raises(EngineServerError, match=why):
        _made(choice, 8)


def test_the_server_is_started_with_the_backend_and_the_engines_settings() -> None:
    spec = EngineSpec(
        kind="vllm",
        model=ModelSpec(path="/m", max_positions=512),
        seed=7,
        kv_cache_mb=32,
        serve=ServeSpec(url="http://[::1]:8123"),
    )
    argv = serve_argv(spec, "/m", python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]

    def flags(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flags("--host") == "::1"
    assert flags("--port") == "8123"
    assert flags("--max-model-len") == "512"
    assert flags("--seed") == "7"
    assert flags("--kv-cache-memory-bytes") == str(32 << 20)
    assert json.loads(flags("--weight-transfer-config")) == {"backend": "aurora"}
    assert flags("--worker-extension-cls") == "aurora.vllm_backend.AuroraWorkerExtension"
    assert "--no-enable-prefix-caching" in argv  # keep: no new request reuses KV of an older version
    assert "--enable-scale-out" in argv  # the token-in-token-out generate endpoint


def _answer(n: int, tokens: int, tag: str = "3:1") -> dict[str, object]:
    content = [{"token_id": 5, "logprob": -0.25, "rank": 1, "top_logprobs": [{"token_id": 5, "logprob": -0.25}]}]
    choice = {
        "index": 0,
        "token_ids": [5] * tokens,
        "logprobs": {"content": content * tokens},
        "weight_versions": [{"version": tag, "start": 0, "end": tokens}],
    }
    return {"choices": [choice] * n}


@pytest.mark.parametrize(("tag", "ok"), [("3:1", True), ("default", False), ("3:1:2", False)])
def test_a_long_answer_is_read_whole_and_a_strange_tag_refused(tag: str, ok: bool) -> None:
    """A real HTTP server on loopback answers the generate call (8 samples of 4000 tokens: about 3 MB)."""
    from aiohttp import ClientSession, web

    from aurora.rl.engines.vllm_served import ServedVllm

    async def go() -> None:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            assert body["token_ids"] == [1, 2]
            return web.json_response(_answer(8, 4000, tag))

        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        spec = EngineSpec(kind="vllm", model=ModelSpec(path="/m"), serve=ServeSpec(url=f"http://127.0.0.1:{port}"))
        client = ServedVllm(spec, "/m")
        client._session = ClientSession()
        try:
            if ok:
                made = await client.generate([1, 2], {"n": 8, "max_tokens": 4000})
                assert len(made) == 8
                assert all(len(toks) == len(lps) == 4000 for toks, lps, _ in made)
            else:
                with pytest.raises(EngineServerError, match="a weight-version tag this engine never set"):
                    await client.generate([1, 2], {"n": 8, "max_tokens": 4000})
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(go())


def test_an_answer_that_is_not_json_is_the_servers_error() -> None:
    from aurora.rl.engines.vllm_served import _decode, _Generated

    with pytest.raises(EngineServerError, match="/inference/v1/generate"):
        _decode(b"<html>502 Bad Gateway</html>", _Generated, "/inference/v1/generate")
    with pytest.raises(EngineServerError, match="aurora_names"):
        _decode({"not": "a list"}, list[str], "/collective_rpc aurora_names")
