"""WebRTC message framing: pieces within the size limit, flags right, the message back intact;
garbage in a reassembled message is a `BadMessage`, never anything else."""

from __future__ import annotations

import contextlib

import pytest
from aurora.transport.webrtc import CONTROL, MORE, decode_frame, encode_message, encode_pieces
from hypothesis import given
from hypothesis import strategies as st

from aurora.protocol.messages import BadMessage, LinkCredit, LinkData, Probe, encode_app


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
