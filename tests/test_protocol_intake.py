"""`aurora.protocol.intake.Intake` as shipped, driven with no event loop: examples of each rule, then
hypothesis sequences of manifests, chunks, seals, trust checks, commits and lost parents (honest and
not) against the module's invariants — an input that raises changes nothing; versions only move
forward, a delta only onto its base; one `Finish` per delta, only once every chunk and (streamed) its
seal are in; only a streamed delta is forwarded, each piece once, the seal only after its check."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora.errors import AuthError, DeltaFormatError, ProtocolError
from aurora.protocol.intake import (
    Abandon,
    Announced,
    Begin,
    DecodeAhead,
    Finish,
    Forward,
    Intake,
    TimeLink,
)


def _announce(target: int, base: int | None, n: int, *, sealed: bool = False, fits: bool = True) -> Announced:
    return Announced(target, base, n, target, base, n, sealed, fits)


def test_a_streamed_delta_is_forwarded_chunk_by_chunk_and_finished_after_its_seal() -> None:
    k = Intake("relay", 3, authenticates=True, held_sealed=True)
    assert k.manifest(_announce(4, 3, 2)) == [Begin(4, streamed=True)]
    assert k.chunk_added(4, 1) == [Forward(4, 1), DecodeAhead(4)]
    assert k.chunk_added(4, 0) == [Forward(4, 0)]  # complete: no link timing for a streamed delta
    assert k.sealed(4) == [Finish(4)]
    assert k.trust(has_seal=True, bytes_sealed=True, seal_base=3).forward_seal
    k.committed(4, sealed=True)
    assert k.version == 4
    assert k.receiving is None


def test_a_catch_up_is_not_forwarded_and_its_state_is_checked() -> None:
    k = Intake("rollout", 1, authenticates=True, held_sealed=True)
    assert k.manifest(_announce(5, 1, 1, sealed=True)) == [Begin(5, streamed=False)]
    assert k.chunk_added(5, 0) == [TimeLink(5), Finish(5)]
    trust = k.trust(has_seal=True, bytes_sealed=False, seal_base=4)
    assert trust.check_state
    assert not trust.forward_seal


def test_the_rules_refuse_what_a_parent_gets_wrong_and_change_nothing() -> None:
    k = Intake("n", 3, authenticates=True, held_sealed=True)
    with pytest.raises(ProtocolError, match="from version 2"):
        k.manifest(_announce(4, 2, 1))
    with pytest.raises(ProtocolError, match="holds 3 already"):
        k.manifest(_announce(3, None, 1, sealed=True))
    with pytest.raises(DeltaFormatError, match="layout"):
        k.manifest(_announce(4, 3, 1, fits=False))
    with pytest.raises(ProtocolError, match="does not match"):
        k.manifest(Announced(4, 3, 1, 4, 3, 2, False, True))
    with pytest.raises(ProtocolError, match="not announced"):
        k.chunk_added(4, 0)
    k.manifest(_announce(4, 3, 1))
    with pytest.raises(ProtocolError, match="out of place"):
        k.sealed(4)  # before its chunk
    k.chunk_added(4, 0)
    with pytest.raises(ProtocolError, match="not announced"):
        k.chunk_added(4, 0)  # twice
    k.sealed(4)
    with pytest.raises(AuthError, match="not the one the trainer sealed"):
        k.trust(has_seal=True, bytes_sealed=False, seal_base=3)
    assert k.failed() == [Abandon(4, streamed=True)]
    assert k.version == 3
    empty = Intake("n", None, authenticates=True, held_sealed=False)
    assert empty.refuses_unparsed(header_sealed=False)
    with pytest.raises(AuthError, match="first version"):
        empty.manifest(_announce(0, None, 1))


# ---------------------------------------------------------------- sequences
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("manifest"),
            st.integers(-1, 2),  # target offset from the version held
            st.sampled_from(["held", "other", "snapshot"]),
            st.integers(0, 3),  # chunks
            st.booleans(),  # sealed in the manifest
            st.sampled_from([True, True, True, False]),  # layout fits
            st.sampled_from([False, False, False, True]),  # header mismatch
        ),
        st.tuples(st.just("chunk"), st.integers(-1, 3), st.booleans()),
        st.tuples(st.just("seal"), st.booleans()),
        st.tuples(st.just("trust"), st.booleans(), st.booleans(), st.booleans()),
        st.tuples(st.just("commit")),
        st.tuples(st.just("lost")),
    ),
    max_size=40,
)


def _state(k: Intake) -> Any:
    return copy.deepcopy((k.version, k.held_sealed, k._delta))


@settings(max_examples=400, deadline=None)
@given(ops=OPS, start=st.sampled_from([None, 0, 5]), authenticates=st.booleans())
def test_intake_invariants_hold_over_any_sequence(
    ops: list[tuple[Any, ...]], start: int | None, authenticates: bool
) -> None:
    k = Intake("n", start, authenticates=authenticates, held_sealed=start is not None)
    held = start
    delta: dict[str, Any] | None = None  # the reference: the delta in progress
    finished: set[int] = set()
    """The deltas (by the step that began them) that got their `Finish`."""
    ops_seen: list[Any] = []
    for op in ops:
        ops_seen.append(op)
        before = _state(k)
        call: Any
        if op[0] == "manifest":
            _, offset, base_kind, n, sealed, fits, mismatch = op
            target = max(0, (held if held is not None else 0) + offset)
            base = None if base_kind == "snapshot" else (held if base_kind == "held" else (held or 0) + 7)
            a = Announced(target, base, n, target, base, n + 1 if mismatch else n, sealed, fits)
            ok = (
                not mismatch
                and fits
                and (base is None or base == held)
                and (held is None or target > held)
                and not (held is None and authenticates and not sealed)
            )
            call = lambda a=a: k.manifest(a)  # noqa: E731
        elif op[0] == "chunk":
            _, i, right = op
            target = delta["target"] if delta is not None and right else -5
            ok = delta is not None and right and 0 <= i < delta["n"] and i not in delta["arrived"]
            call = lambda t=target, i=i: k.chunk_added(t, i)  # noqa: E731
        elif op[0] == "seal":
            target = delta["target"] if delta is not None and op[1] else -5
            ok = (
                delta is not None
                and op[1]
                and delta["streamed"]
                and len(delta["arrived"]) == delta["n"]
                and not delta["sealed"]
            )
            call = lambda t=target: k.sealed(t)  # noqa: E731
        elif op[0] == "trust":
            _, has_seal, bytes_sealed, base_right = op
            seal_base = delta["base"] if delta is not None and base_right else -3
            ok = (
                delta is not None
                and delta["id"] in finished
                and (has_seal or not authenticates)
                and not (has_seal and delta["streamed"] and not bytes_sealed)
                and not (has_seal and bytes_sealed and delta["base"] is not None and not base_right)
            )
            call = lambda h=has_seal, b=bytes_sealed, sb=seal_base: k.trust(  # noqa: E731
                has_seal=h, bytes_sealed=b, seal_base=sb
            )
        elif op[0] == "commit":
            ok = delta is not None and delta["id"] in finished
            committing = delta["target"] if delta is not None else -1
            call = lambda t=committing: k.committed(t, sealed=True)  # noqa: E731
        else:
            ok = True
            call = k.parent_lost
        try:
            out = call()
        except (ProtocolError, AuthError, DeltaFormatError):
            if op[0] == "trust" and ok:  # the one rule left out of the reference: an unsealed base
                assert authenticates
                assert not k.held_sealed
            else:
                assert not ok, f"refused what the rules allow: {op}"
            assert _state(k) == before, "a refused input changed the state"
            continue
        assert ok, f"took what the rules refuse: {op}"
        if op[0] == "manifest":
            begin = next(c for c in out if isinstance(c, Begin))
            assert begin.streamed == (held is not None and target == held + 1 and not sealed)
            if delta is not None:
                assert out[0] == Abandon(delta["target"], delta["streamed"])
            delta = {"target": target, "base": base, "n": n, "streamed": begin.streamed, "arrived": set()}
            delta["sealed"], delta["id"] = sealed, len(ops_seen)
        elif op[0] == "chunk":
            assert delta is not None
            delta["arrived"].add(op[1])
            forwards = [c for c in out if isinstance(c, Forward)]
            assert forwards == ([Forward(delta["target"], op[1])] if delta["streamed"] else [])
        elif op[0] == "seal":
            assert delta is not None
            delta["sealed"] = True
        elif op[0] == "trust":
            assert delta is not None
            assert out.forward_seal == delta["streamed"]
            assert out.check_state == (authenticates and op[1] and not op[2])
            out = []
        elif op[0] == "commit":
            assert delta is not None
            assert held is None or delta["target"] > held, "versions only move forward"
            assert delta["base"] is None or delta["base"] == held, "a delta only onto its base"
            held, delta = delta["target"], None
            out = []
        else:
            delta = None
        finishes = [c for c in out if isinstance(c, Finish)]
        if finishes:
            assert delta is not None
            assert finishes == [Finish(delta["target"])]
            assert delta["id"] not in finished, "two Finish for one delta"
            assert len(delta["arrived"]) == delta["n"]
            assert delta["sealed"] or not delta["streamed"]
            finished.add(delta["id"])
        elif delta is not None and delta["id"] not in finished:
            complete = len(delta["arrived"]) == delta["n"]
            assert not (complete and (delta["sealed"] or not delta["streamed"])), "complete but not finished"
        assert k.version == held
