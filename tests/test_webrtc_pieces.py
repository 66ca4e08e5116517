"""WebRTC message framing: pieces within the size limit, flags right, the message back intact."""

from __future__ import annotations

from aurora.transport.webrtc import CONTROL, MORE, decode_message, encode_pieces
from hypothesis import given
from hypothesis import strategies as st


@given(bufs=st.lists(st.binary(max_size=300), max_size=4), piece_bytes=st.integers(1, 64))
def test_pieces_reassemble_to_the_message_at_every_boundary(bufs: list[bytes], piece_bytes: int) -> None:
    header = {"k": "d", "h": {"x": 1}, "z": [len(b) for b in bufs]}
    pieces = encode_pieces(header, tuple(bufs), piece_bytes=piece_bytes)
    assert all(1 < len(p) <= piece_bytes + 1 for p in pieces)
    assert [p[0] for p in pieces] == [MORE] * (len(pieces) - 1) + [0]
    env, got = decode_message(b"".join(p[1:] for p in pieces))
    assert env == header
    assert [bytes(g) for g in got] == bufs


def test_a_control_message_is_one_piece_flagged_control() -> None:
    (piece,) = encode_pieces({"k": "c", "n": 7}, (), last_flags=CONTROL)
    assert piece[0] == CONTROL
    assert decode_message(piece[1:])[0] == {"k": "c", "n": 7}
