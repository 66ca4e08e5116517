"""WebRTC message framing: pieces within the size limit, flags right, the message back intact;
garbage in a reassembled message is a `BadMessage`, never anything else."""

from __future__ import annotations

import contextlib

import pytest
from aurora.transport.webrtc import (
    BULK,
    CONTROL,
    MORE,
    Reassembly,
    decode_frame,
    encode_message,
    encode_pieces,
)
from hypothesis import given
from hypothesis import strategies as st

from aurora.protocol.messages import BadMessage, Have, Lane, LinkCredit, LinkData, Probe, encode_app


@given(bufs=st.lists(st.binary(max_size=300), max_size=4), piece_bytes=st.integers(1, 64))
def test_pieces_reassemble_to_the_message_at_every_boundary(bufs: list[bytes], piece_bytes: int) -> None:
    msg = Probe(i=3, note="x")
    pieces = encode_pieces(
        LinkData(z=[len(encode_app(msg))] + [len(b) for b in bufs]), (encode_app(msg), *bufs), piece_bytes=piece_bytes
    )
    assert all(1 < len(p) <= piece_bytes + 1 for p in pieces)
    assert [p[0] for p in pieces] == [MORE] * (len(pieces) - 1) + [0]
    frame, got, parts = decode_frame(b"".join(p[1:] for p in pieces))
    assert isinstance(frame, LinkData)
    assert got == msg
    assert [bytes(g) for g in parts] == bufs
    assert b"".join(p[1:] for p in encode_message(encode_app(msg), tuple(bufs))) == b"".join(p[1:] for p in pieces)


def test_a_control_message_is_one_piece_flagged_control() -> None:
    (piece,) = encode_pieces(LinkCredit(n=7), (), last_flags=CONTROL)
    assert piece[0] == CONTROL
    assert decode_frame(piece[1:])[0] == LinkCredit(n=7)


@given(st.binary(max_size=200))
def test_garbage_is_a_bad_message(data: bytes) -> None:
    with contextlib.suppress(BadMessage):
        decode_frame(data)


def test_sizes_that_do_not_add_up_are_refused() -> None:
    (piece,) = encode_pieces(LinkData(z=[1000]), (b"short",))
    with pytest.raises(BadMessage, match="length"):
        decode_frame(piece[1:])


@given(
    bulk=st.binary(min_size=1, max_size=400),
    order=st.lists(st.sampled_from(["bulk", "control", "frame"]), max_size=80),
)
def test_a_control_message_between_the_pieces_of_a_bulk_one_leaves_both_intact(bulk: bytes, order: list[str]) -> None:
    """The pieces of a control-lane message (and control frames) may go out between those of a bulk-lane
    one (the sender holds one lock per lane): the receiver joins each lane apart (CI once saw a ``Have``
    spliced into a bulk message, and both lost)."""
    queues = {
        "bulk": encode_pieces(LinkData(z=[len(encode_app(Probe(i=1)))]), (encode_app(Probe(i=1)),), piece_bytes=16)
        + encode_message(encode_app(Probe(i=2)), (bulk,), Lane.BULK),
        "control": encode_message(encode_app(Have(v=7)), (), Lane.CONTROL),
        "frame": encode_pieces(LinkCredit(n=3), (), last_flags=CONTROL),
    }
    queues["bulk"] = [bytes([p[0] | BULK]) + p[1:] for p in queues["bulk"]]
    arrival = [queues[k].pop(0) for k in order if queues[k]] + [p for k in queues for p in queues[k]]
    r = Reassembly(1 << 20)
    got = [decode_frame(d) for p in arrival if (d := r.add(p)) is not None]
    apps = [m for _, m, _ in got if m is not None]
    assert [m for m in apps if isinstance(m, Probe)] == [Probe(i=1), Probe(i=2)]
    assert [m for m in apps if isinstance(m, Have)] == [Have(v=7)]
    assert [f for f, m, _ in got if m is None] == [LinkCredit(n=3)]
    assert [bytes(b[0]) for _, m, b in got if m == Probe(i=2)] == [bulk]


def test_a_message_past_the_limit_overflows() -> None:
    r = Reassembly(100)
    assert r.add(bytes([MORE | BULK]) + b"x" * 60) is None
    with pytest.raises(OverflowError):
        r.add(bytes([MORE | BULK]) + b"x" * 60)
