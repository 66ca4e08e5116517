"""Engine conformance: deltas applied to a rollout engine leave it bit-identical to the trainer.

Every engine must pass these (issue 6 adds vLLM): read back after apply, atomic
version switch, greedy generation equal to a reference forward pass, and an
applied delta really changing what the engine computes.
"""

from __future__ import annotations

import pytest
import torch

from aurora.codec import Weights
from aurora.codec.decoder import receive
from aurora.codec.encoder import encode
from aurora.engine import Engine, EngineSpec, Prompt, SyntheticEngine, TorchEngine, WeightUpdate
from aurora.errors import DeltaFormatError, ProtocolError
from aurora.learner import SyntheticLearner, SyntheticSpec
from aurora.model import CharTokenizer, ModelSpec, build_model

SPEC = ModelSpec(preset="tiny", seed=3)


def _full(version: int, w: Weights) -> WeightUpdate:
    return WeightUpdate(version, w.digest(), w, None)


def _bits_equal(a: Weights, b: Weights) -> bool:
    return set(a) == set(b) and all((a[n].bits == b[n].bits).all() for n in a)


@pytest.fixture(scope="module")
def versions() -> list[Weights]:
    learner = SyntheticLearner(SyntheticSpec(model=SPEC, density=0.05, seed=1))
    return [learner.initial().copy(), learner.step().copy(), learner.step().copy()]


ENGINES = {"torch": lambda: TorchEngine(EngineSpec(model=SPEC)),
           "synthetic": lambda: SyntheticEngine(EngineSpec(kind="synthetic", model=SPEC))}  # fmt: skip


def _engine(kind: str) -> Engine:
    return ENGINES[kind]()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_a_delta_applied_to_the_host_copy_and_then_the_engine_is_bit_identical(
    kind: str, versions: list[Weights]
) -> None:
    engine = _engine(kind)
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


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_an_update_that_understates_what_changed_is_caught_by_the_digest_and_reloaded(
    kind: str, versions: list[Weights]
) -> None:
    engine = _engine(kind)
    engine.apply(_full(0, versions[0]))
    engine.apply(WeightUpdate(1, versions[1].digest(), versions[1], touched=[]))  # claims nothing changed
    assert engine.version == 1
    assert _bits_equal(engine.weights(), versions[1])


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_weights_that_do_not_match_their_digest_leave_the_engine_serving_nothing(
    kind: str, versions: list[Weights]
) -> None:
    engine = _engine(kind)
    engine.apply(_full(0, versions[0]))
    with pytest.raises(DeltaFormatError, match="digest"):
        engine.apply(WeightUpdate(1, versions[2].digest(), versions[1], None))
    assert engine.version is None
    with pytest.raises(ProtocolError, match="serves version None"):
        engine.generate([Prompt(0, "1+1=")], 1)


def test_greedy_generation_matches_a_reference_forward_pass(versions: list[Weights]) -> None:
    engine = TorchEngine(EngineSpec(model=SPEC, temperature=0.0, max_new_tokens=12))
    engine.apply(_full(1, versions[1]))
    prompts = [Prompt(0, "12+7="), Prompt(1, "3+45="), Prompt(2, "100+1=")]
    got = engine.generate(prompts, 1)
    ref = build_model(SPEC).float()
    ref.load_state_dict({n: t.float() for n, t in versions[1].to_tensors().items()}, strict=False)
    tok = CharTokenizer()
    for p, c in zip(prompts, got, strict=True):
        ids = tok.encode(p.text)
        for t, lp in zip(c.tokens, c.logprobs, strict=True):
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([ids])).logits[0, -1].float()
            assert int(logits.argmax()) == t
            assert abs(float(torch.log_softmax(logits, -1)[t]) - lp) < 1e-4
            ids.append(t)
        assert c.version == 1
        assert len(c.tokens) == len(c.logprobs) >= 1


def test_an_applied_delta_changes_what_the_engine_computes(versions: list[Weights]) -> None:
    engine = TorchEngine(EngineSpec(model=SPEC, seed=5))
    prompts = [Prompt(i, f"{i}+{i}=") for i in range(4)]
    engine.apply(_full(0, versions[0]))
    before = engine.generate(prompts, 0)
    engine.apply(_full(2, versions[2]))
    after = engine.generate(prompts, 2)
    assert [c.logprobs for c in before] != [c.logprobs for c in after]
    with pytest.raises(ProtocolError):
        engine.generate(prompts, 0)
