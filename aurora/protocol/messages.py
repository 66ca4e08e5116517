"""Every message Aurora's nodes exchange, typed: encoded, decoded and validated here and nowhere else.

Two layers travel on every link:

* **link frames** (`LinkFrame`): what a transport puts around each message — ``d`` data
  (an application message and its buffers follow), ``c`` flow-control credit, ``hb``
  heartbeat, ``x`` close. Only transports read them.
* **application messages** (`AppMessage`): the version stream (hello, path, refusal,
  manifest, chunk, seal, version reports), work (want, grant, renew, renewed, result,
  verdict), status, and WebRTC signalling. Channels carry these.

On the wire each message is a msgpack map whose kind is under ``"k"`` (msgspec Structs
tagged by ``k``); raw byte buffers travel beside it, never inside it. Every field has its
type, range and size limit here; buffers per kind are bounded by `BUFFER_LIMITS`.

Invariants:

* `decode_link` / `decode_app` raise only `BadMessage` (with a reason a person can read) for
  any input whatsoever, and allocate no more than a small multiple of what they were given:
  every length is bounded before use (the decoder's own limits, then these schemas);
* a decoded message has exactly its fields, each of its type and within its range (unknown
  or missing fields, wrong types, NaN where a number is bounded: all `BadMessage`);
* ``decode_app(encode_app(m)) == m`` for every valid message.

What a message *means* in a context (a grant arriving from a child, a worker speaking for
another) is the receiver's rule, not this module's.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

# ------------------------------------------------------------------ limits (and where they come from)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Node names: letters, digits, ``-``, ``_``, ``.``; they become file and log names."""
MAX_VERSION = 2**53
"""Version numbers: exact in a float and in JSON, and far beyond any run."""
MAX_PATH = 64
"""Nodes on a path from the trainer (tree depth)."""
MAX_REASON_CHARS = 512
MAX_LEASES = 256
"""Leases per grant or renewal (`LeaseSpec.prompts_per_lease` is bounded by it)."""
MAX_GROUP = 256
MAX_SPANS = 64
"""Version switches within one sample (more: the sample is far too stale to count anyway)."""
"""Samples per prompt (GRPO's group size)."""
MAX_PROMPT_TOKENS = 16_384
MAX_NEW_TOKENS = 16_384
MAX_TOKEN_ID = 2**31 - 1
MIN_LOGPROB = -1e4
"""Below any log-probability a sampled token can have; the coordinator applies the real rule."""
MAX_CHUNKS = 1 << 20
"""Chunks of one delta (4 TiB of weights at 4 MiB a chunk)."""
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""A manifest is a row a tensor (~100 B): this is 100,000+ tensors; nodes' links refuse larger frames."""
MAX_CHUNK_BYTES = 4 * 1024 * 1024
"""As `aurora.codec.format.MAX_CHUNK_BYTES` (a test keeps them equal)."""
MAX_SEAL_BYTES = 1024
MAX_SDP_CHARS = 64 * 1024
MAX_FINGERPRINTS = 8
MAX_STATS = 64
"""Keys in a status map (the learner's step figures, rejection reasons, sync times)."""
MAX_NODES = 4096
"""Nodes a status snapshot describes."""
MAX_PROBE_BUFFERS = 8
POOL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$"
"""Pool names: as node names, without ``.`` and at most 40 (a member is ``POOL.`` and 16 hex digits)."""

U32 = Annotated[int, Meta(ge=0, lt=2**32)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Version = Annotated[int, Meta(ge=0, le=MAX_VERSION)]
Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
Reason = Annotated[str, Meta(max_length=MAX_REASON_CHARS)]
Token = Annotated[bytes, Meta(min_length=16, max_length=32)]
"""A lease token: at least 128 random bits (the coordinator mints them)."""
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
LogProb = Annotated[float, Meta(ge=MIN_LOGPROB, le=0.0)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]
Mbit = Annotated[float, Meta(gt=0.0, le=1e7)]
"""A link rate in Mbit/s (positive and finite: NaN and infinity fail the bounds)."""
Stat = None | bool | int | Annotated[float, Meta(ge=-1e300, le=1e300)] | Annotated[str, Meta(max_length=256)]
StatKey = Annotated[str, Meta(max_length=64)]


class BadMessage(ValueError):
    """Bytes from a peer that are not a valid message; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class _Msg(Struct, tag_field="k", forbid_unknown_fields=True):
    """Base of every tagged message (treat them as values: nothing changes one after it is made)."""


# ------------------------------------------------------------------ link frames
class LinkData(_Msg, tag="d"):
    """An application message follows: the next frame (ZeroMQ), or the sizes ``z`` of the
    application header and each buffer (WebRTC, where everything is one byte string)."""

    z: Annotated[list[U32], Meta(max_length=1 + MAX_PROBE_BUFFERS)] | None = None


class LinkCredit(_Msg, tag="c"):
    n: Count
    """Control-lane messages the sender has read from this link in total."""
    b: Count = 0
    """Bulk-lane bytes (as `aurora.protocol.link.bulk_size` counts them) the sender has read in total."""


class LinkBeat(_Msg, tag="hb"):
    i: Count
    """The sender's incarnation (grows across its restarts)."""
    s: Count
    """Heartbeat sequence number."""
    r: Count
    """Control-lane read total, as in `LinkCredit`."""
    rb: Count = 0
    """Bulk-lane read total in bytes, as in `LinkCredit`."""
    n: Name | None = None
    """The sender's node name (a client's hello; with CurveZMQ its key decides, and must agree)."""


class LinkClose(_Msg, tag="x"):
    reason: Reason = "closed by peer"


LinkFrame = LinkData | LinkCredit | LinkBeat | LinkClose


# ------------------------------------------------------------------ membership and the version stream
class MemberCert(Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    """A pool member's certificate (`aurora.auth.pool`): the pool's Ed25519 signature ``sig`` over the
    pool, the member's CurveZMQ public ``key`` (Z85) and its expiry ``expires`` (Unix seconds)."""

    pool: Annotated[str, Meta(pattern=POOL_NAME_PATTERN)]
    key: Annotated[bytes, Meta(min_length=40, max_length=40)]
    expires: Count
    sig: Annotated[bytes, Meta(min_length=64, max_length=64)]


class Hello(_Msg, tag="hello"):
    """A child's first message on a new channel to its parent: the version it holds. A ``probe``
    only asks whether the parent would take it (answered with its path or a refusal, then closed).
    A pool member shows its ``cert``."""

    v: Version | None
    probe: bool = False
    cert: MemberCert | None = None


class StatusQuery(_Msg, tag="status?"):
    """First message of a control channel: answered with one `StatusSnapshot`, then closed."""


class SignalHello(_Msg, tag="signal"):
    """First message of a channel that carries only WebRTC signalling (the parent is the rendezvous)."""


class PathUpdate(_Msg, tag="path"):
    """The parent's path from the trainer, this node's parent last (sent on attach and on every move)."""

    path: Annotated[list[Name], Meta(min_length=1, max_length=MAX_PATH)]


class Refused(_Msg, tag="refused"):
    reason: Reason


class Have(_Msg, tag="version"):
    """A child now holds version ``v`` (after a commit)."""

    v: Version


class Held(_Msg, tag="held"):
    """Node ``n`` committed version ``v`` (relayed up to the trainer, for sync times)."""

    n: Name
    v: Version


class SealWire(Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    """A version's seal (`aurora.auth.seal`): the signed body and the trainer's Ed25519 signature."""

    body: Annotated[bytes, Meta(max_length=MAX_SEAL_BYTES)]
    sig: Annotated[bytes, Meta(min_length=64, max_length=64)]


class DeltaManifest(_Msg, tag="delta_manifest"):
    """A delta (or snapshot, ``base`` None) begins: ``n`` chunks follow. Buffer: the packed manifest.
    ``seal``: present when the sender has it already (a catch-up); a streamed delta's comes after
    its chunks (`DeltaSeal`)."""

    base: Version | None
    target: Version
    n: Annotated[int, Meta(ge=0, le=MAX_CHUNKS)]
    seal: SealWire | None = None


class DeltaChunk(_Msg, tag="delta_chunk"):
    """Chunk ``i`` of the delta to ``target``. Buffer: the packed chunk."""

    target: Version
    i: Annotated[int, Meta(ge=0, lt=MAX_CHUNKS)]


class DeltaSeal(_Msg, tag="delta_seal"):
    """The seal of the delta to ``target`` whose chunks were just streamed."""

    target: Version
    seal: SealWire


# ------------------------------------------------------------------ status
class NodeReport(Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """What a node reports about itself about once a second."""

    version: Version | None = None
    parent: Name | None = None
    planned: bool = True
    """Attached to its planned parent (False: to a fallback)."""
    bytes_in: Count = 0
    completions: Count | None = None
    accepted: Count | None = None
    rejected: Count | None = None
    tok_s: Seconds | None = None
    switches: Count | None = None
    switch_ms: Seconds | None = None
    link_mbit: Mbit | None = None
    """The rate this node last received a bulk transfer from its parent at (a snapshot or catch-up big
    enough to time, manifest to last chunk: `aurora.actors.flow`); None until one came."""
    age_s: Seconds = 0.0
    """In a snapshot: seconds since the trainer heard this report."""


class Status(_Msg, tag="status"):
    """Node ``n``'s report (relayed up to the trainer)."""

    n: Name
    r: NodeReport


class TrainerStats(Struct, forbid_unknown_fields=True, frozen=True):
    version: Version | None
    accepted: Count
    rejected: Annotated[dict[StatKey, Count], Meta(max_length=MAX_STATS)]
    in_flight: Count
    pending: Count
    dropped_stale: Count
    parked: Count


class Snapshot(Struct, forbid_unknown_fields=True, frozen=True):
    """The cluster's status as the trainer gathered it."""

    trainer: TrainerStats
    nodes: Annotated[dict[Name, NodeReport], Meta(max_length=MAX_NODES)]
    sync_s: Annotated[dict[Annotated[str, Meta(max_length=24)], Seconds], Meta(max_length=MAX_STATS)]
    step: Annotated[dict[StatKey, Stat], Meta(max_length=MAX_STATS)]
    planned: Annotated[dict[Name, Name], Meta(max_length=MAX_NODES)] = {}
    """Each node's planned parent."""
    pools: Annotated[
        dict[Annotated[str, Meta(pattern=POOL_NAME_PATTERN)], Annotated[list[Name], Meta(max_length=MAX_NODES)]],
        Meta(max_length=MAX_STATS),
    ] = {}
    """Each pool's members (those the trainer has admitted)."""
    speeds: Annotated[dict[Name, Annotated[float, Meta(gt=0.0, le=1e9)]], Meta(max_length=MAX_NODES)] = {}
    """Each rollout's generation speed as the work pool measured it (prompts per second with a full
    lease: `aurora.protocol.speed`), for those measured; work is divided by it."""


class StatusSnapshot(_Msg, tag="status_snapshot"):
    snap: Snapshot


# ------------------------------------------------------------------ work
class Want(_Msg, tag="want"):
    """Worker ``w`` can take up to ``n`` prompts, generating with version ``v``."""

    w: Name
    n: Annotated[int, Meta(ge=1, le=MAX_LEASES)]
    v: Version | None = None


class LeaseGrant(Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    item: Count
    token: Token
    ttl_s: Annotated[float, Meta(gt=0.0, le=1e6)]
    tokens: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    """The prompt, as the trainer tokenized it (the worker generates from exactly these ids)."""


class Grant(_Msg, tag="grant"):
    """Leases for worker ``w``; ``n`` samples per prompt."""

    w: Name
    n: Annotated[int, Meta(ge=1, le=MAX_GROUP)]
    leases: Annotated[list[LeaseGrant], Meta(min_length=1, max_length=MAX_LEASES)]


class Renew(_Msg, tag="renew"):
    w: Name
    tokens: Annotated[list[Token], Meta(min_length=1, max_length=MAX_LEASES)]


class LeaseRenewal(Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    item: Count
    token: Token
    ttl_s: Annotated[float, Meta(gt=0.0, le=1e6)]


class Renewed(_Msg, tag="renewed"):
    w: Name
    leases: Annotated[list[LeaseRenewal], Meta(min_length=1, max_length=MAX_LEASES)]


class SampleWire(Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    """One sample: the generated token ids, each one's behaviour log-probability, and (when a version
    switch landed while it was generated) which versions made which tokens: ``spans`` of ``(version,
    first token index)``, the first at index 0, both strictly increasing, each index inside the sample."""

    tokens: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_NEW_TOKENS)]
    logprobs: Annotated[list[LogProb], Meta(min_length=1, max_length=MAX_NEW_TOKENS)]
    spans: Annotated[list[tuple[Version, Count]], Meta(max_length=MAX_SPANS)] = []

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError("a sample's tokens and log-probabilities differ in length")
        if self.spans:
            if self.spans[0][1] != 0:
                raise ValueError("a sample's first version span must start at token 0")
            for (v0, i0), (v1, i1) in zip(self.spans, self.spans[1:], strict=False):
                if not (v1 > v0 and i1 > i0):
                    raise ValueError("a sample's version spans must increase in version and token index")
            if self.spans[-1][1] >= len(self.tokens):
                raise ValueError("a sample's version span starts past its last token")


class Result(_Msg, tag="result"):
    """Worker ``w``'s group of samples for leased prompt ``item``; ``v`` is the oldest version that made
    any of their tokens (a sample with spans starts at ``v`` or later; one without was made by ``v``)."""

    w: Name
    item: Count
    token: Token
    v: Version
    samples: Annotated[list[SampleWire], Meta(min_length=1, max_length=MAX_GROUP)]

    def __post_init__(self) -> None:
        firsts = [s.spans[0][0] if s.spans else self.v for s in self.samples]
        if min(firsts) != self.v:
            raise ValueError("a result's version must be the oldest of its samples' versions")


class Verdict(_Msg, tag="verdict"):
    w: Name
    item: Count
    ok: bool
    reason: Reason | None = None


class Join(_Msg, tag="join"):
    """Pool member ``w``, which said hello to ``parent`` with ``cert``, asks the trainer for a place (the
    trainer checks the certificate again: a relay is not trusted with who is a member)."""

    w: Name
    parent: Name
    cert: MemberCert


class Admitted(_Msg, tag="admitted"):
    """The trainer's answer to a `Join`: a place in the pool (``ok``), or the ``reason`` there is none."""

    w: Name
    ok: bool
    reason: Reason | None = None


# ------------------------------------------------------------------ WebRTC signalling
SdpText = Annotated[str, Meta(max_length=MAX_SDP_CHARS)]
Fingerprints = Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(min_length=1, max_length=MAX_FINGERPRINTS)]
ConnId = Annotated[str, Meta(max_length=128)]


class RtcOffer(_Msg, tag="rtc_offer"):
    to: Name
    sender: Name = msgspec.field(name="from")
    id: ConnId
    sdp: SdpText
    fingerprint: Fingerprints


class RtcAnswer(_Msg, tag="rtc_answer"):
    to: Name
    sender: Name = msgspec.field(name="from")
    id: ConnId
    sdp: SdpText
    fingerprint: Fingerprints


class RtcRefused(_Msg, tag="rtc_refused"):
    to: Name
    sender: Name = msgspec.field(name="from")
    id: ConnId
    reason: Reason


Signal = RtcOffer | RtcAnswer | RtcRefused


# ------------------------------------------------------------------ bulk transfers (`aurora.transport.bulk`)
TransferId = Annotated[str, Meta(max_length=128)]
MAX_BULK_BYTES = 1 << 42
MAX_BULK_FRAME_BYTES = 64 * 1024 * 1024
MAX_RANGES = 1 << 16


class BulkOffer(_Msg, tag="bulk_offer"):
    id: TransferId
    size: Annotated[int, Meta(ge=0, le=MAX_BULK_BYTES)]
    frame_bytes: Annotated[int, Meta(ge=1, le=MAX_BULK_FRAME_BYTES)]
    digest: Annotated[bytes, Meta(min_length=16, max_length=16)]
    round: Count = 0
    streams: Annotated[int, Meta(ge=1, le=1024)] = 1


class BulkWant(_Msg, tag="bulk_want"):
    id: TransferId
    missing: Annotated[list[Annotated[list[Count], Meta(min_length=2, max_length=2)]], Meta(max_length=MAX_RANGES)]
    """Half-open ``[start, end)`` frame ranges the receiver still needs."""


class BulkDone(_Msg, tag="bulk_done"):
    id: TransferId


class BulkIncomplete(_Msg, tag="bulk_incomplete"):
    id: TransferId


class BulkFrame(_Msg, tag="bulk_frame"):
    """Frame ``i`` of a transfer, and its digest. Buffer: the frame."""

    id: TransferId
    i: Count
    d: Annotated[int, Meta(ge=0)]
    """The frame's xxh3-64 digest (msgpack's integers stop at 2**64: the bound is the wire's)."""


class BulkEnd(_Msg, tag="bulk_end"):
    id: TransferId
    round: Count


# ------------------------------------------------------------------ diagnostics
class Probe(_Msg, tag="probe"):
    """For link tests and diagnostics; nodes never act on one."""

    i: Count = 0
    note: Annotated[str, Meta(max_length=256)] = ""


AppMessage = Union[  # noqa: UP007  (msgspec needs the Union for a tagged decode)
    Hello,
    StatusQuery,
    SignalHello,
    PathUpdate,
    Refused,
    Have,
    Held,
    DeltaManifest,
    DeltaChunk,
    DeltaSeal,
    Status,
    StatusSnapshot,
    Want,
    Grant,
    Renew,
    Renewed,
    Result,
    Verdict,
    Join,
    Admitted,
    RtcOffer,
    RtcAnswer,
    RtcRefused,
    BulkOffer,
    BulkWant,
    BulkDone,
    BulkIncomplete,
    BulkFrame,
    BulkEnd,
    Probe,
]
UP = (Want, Renew, Result, Join)
"""Work messages that travel up, towards the trainer."""
DOWN = (Grant, Renewed, Verdict, Admitted)
"""Work messages that travel down, towards a worker."""

BUFFER_LIMITS: dict[type[_Msg], tuple[int, ...]] = {
    DeltaManifest: (MAX_MANIFEST_BYTES,),
    DeltaChunk: (MAX_CHUNK_BYTES,),
    BulkFrame: (MAX_BULK_FRAME_BYTES,),
}
"""Exactly these buffers, each at most this many bytes; every other kind carries none (a `Probe` up to
`MAX_PROBE_BUFFERS`, of any size the link allows)."""

MAX_HEADER_BYTES = 1 << 20
"""An application header above this is refused before it is decoded (the largest real one, a status
snapshot of thousands of nodes, is a few hundred kB)."""

_link_decoder = msgspec.msgpack.Decoder(LinkFrame)
_app_decoder = msgspec.msgpack.Decoder(AppMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: _Msg) -> bytes:
    """A link frame or an application message as msgpack."""
    return _encoder.encode(msg)


encode_app = encode
encode_link = encode


def _reason(e: msgspec.DecodeError) -> str:
    return str(e)[:MAX_REASON_CHARS]


def decode_link(data: bytes | memoryview) -> LinkFrame:
    """A link frame; raises `BadMessage`."""
    if len(data) > 4096:
        raise BadMessage(f"link frame of {len(data)} bytes (at most 4096)")
    try:
        return _link_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise BadMessage(f"malformed link frame: {_reason(e)}") from None


def decode_app(data: bytes | memoryview, buffers: Sequence[memoryview | bytes] = ()) -> AppMessage:
    """An application message, with its buffers checked against `BUFFER_LIMITS`; raises `BadMessage`."""
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n > MAX_HEADER_BYTES:
        raise BadMessage(f"message header of {n} bytes (at most {MAX_HEADER_BYTES})")
    try:
        msg: AppMessage = _app_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise BadMessage(f"malformed message: {_reason(e)}") from None
    check_buffers(msg, buffers)
    return msg


class Lane(enum.Enum):
    """Which of a link's two lanes a message travels in (`aurora.protocol.link`): control messages
    never wait behind bulk ones (docs/transport.md)."""

    CONTROL = "control"
    BULK = "bulk"


BULK_MESSAGES: tuple[type[_Msg], ...] = (DeltaManifest, DeltaChunk, DeltaSeal, BulkFrame, BulkEnd, Probe)
"""The bulk lane's messages: a version's stream (its seal after its chunks), a striped payload's frames
and each stream's end after them, throughput probes. Everything else is control."""


def lane_of(msg: _Msg) -> Lane:
    """The lane ``msg`` travels in (both ends classify alike: order holds within a lane)."""
    return Lane.BULK if isinstance(msg, BULK_MESSAGES) else Lane.CONTROL


def check_buffers(msg: _Msg, buffers: Sequence[memoryview | bytes]) -> None:
    sizes = [b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers]
    kind = type(msg)
    if kind is Probe:
        if len(sizes) > MAX_PROBE_BUFFERS:
            raise BadMessage(f"probe with {len(sizes)} buffers (at most {MAX_PROBE_BUFFERS})")
        return
    limits = BUFFER_LIMITS.get(kind, ())
    if len(sizes) != len(limits):
        raise BadMessage(f"{kind_of(msg)!r} carries {len(sizes)} buffers, expected {len(limits)}")
    for size, limit in zip(sizes, limits, strict=True):
        if size > limit:
            raise BadMessage(f"{kind_of(msg)!r} buffer of {size} bytes (at most {limit})")


def kind_of(msg: _Msg) -> str:
    """A message's wire kind (its ``k``)."""
    return str(type(msg).__struct_config__.tag)


__all__ = [
    "BUFFER_LIMITS",
    "DOWN",
    "UP",
    "Admitted",
    "AppMessage",
    "BadMessage",
    "DeltaChunk",
    "DeltaManifest",
    "DeltaSeal",
    "Grant",
    "Have",
    "Held",
    "Hello",
    "Join",
    "LeaseGrant",
    "LeaseRenewal",
    "LinkBeat",
    "LinkClose",
    "LinkCredit",
    "LinkData",
    "LinkFrame",
    "MemberCert",
    "NodeReport",
    "PathUpdate",
    "Probe",
    "Refused",
    "Renew",
    "Renewed",
    "Result",
    "RtcAnswer",
    "RtcOffer",
    "RtcRefused",
    "SampleWire",
    "SealWire",
    "Signal",
    "SignalHello",
    "Snapshot",
    "Status",
    "StatusQuery",
    "StatusSnapshot",
    "TrainerStats",
    "Verdict",
    "Want",
    "decode_app",
    "decode_link",
    "encode",
    "kind_of",
]
