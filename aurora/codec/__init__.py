"""The lossless sparse-delta codec (format v3; docs/delta-format.md).

Typical use::

    base, target = Weights.from_tensors(sd0), Weights.from_tensors(sd1)
    manifest, chunks = encode_stream(base, target, base_version=0, target_version=1)
    rx = DeltaReceiver(manifest)
    for c in chunks:            # any order, over any transport
        rx.add(c)               # verified on arrival
    rx.stage(base).commit(base) # all-or-nothing, digests checked

Nothing here does I/O, reads a clock or logs.
"""

from aurora.codec.decoder import DeltaReceiver, Patch, StagedDelta, apply, apply_in_place, receive
from aurora.codec.encoder import SNAPSHOT_THRESHOLD, Coding, Delta, EncodeStats, encode, encode_stream
from aurora.codec.format import MAX_CHUNK_BYTES, ChunkKind, Manifest, Transform, unpack_chunk, unpack_manifest
from aurora.codec.ops import compose, invert
from aurora.codec.weights import TensorBits, Weights

__all__ = [
    "MAX_CHUNK_BYTES",
    "SNAPSHOT_THRESHOLD",
    "ChunkKind",
    "Coding",
    "Delta",
    "DeltaReceiver",
    "EncodeStats",
    "Manifest",
    "Patch",
    "StagedDelta",
    "TensorBits",
    "Transform",
    "Weights",
    "apply",
    "apply_in_place",
    "compose",
    "encode",
    "encode_stream",
    "invert",
    "receive",
    "unpack_chunk",
    "unpack_manifest",
]
