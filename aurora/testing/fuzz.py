"""Hostile bytes derived from the wire schemas: hypothesis strategies for fuzzing live nodes.

Every strategy here starts from `aurora.protocol.messages` as msgspec describes it
(`msgspec.inspect`), so a field added to a message is fuzzed without a change here:

* `valid_message(t)` — a value the decoder accepts for type ``t`` (a struct becomes the
  map — or list, for ``array_like`` ones — that msgspec reads);
* `malformed_message(t)` — a valid one with one thing broken: a required field dropped,
  an unknown field added, a value of the wrong type, a number far out of range (huge,
  negative, NaN, infinite), a string or list past its limit, or the same breakage one
  level down;
* `hostile_frames()` — what an attacker puts on a ZeroMQ link: a link frame and an
  application header (valid, malformed, truncated, or random bytes) and some buffers.

Values stay msgpack-encodable (integers within [-2**63, 2**64)), because the point is
what a real peer could send.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec.inspect as mi
from hypothesis import strategies as st

from aurora.protocol.messages import AppMessage, LinkData, LinkFrame, encode_link

WRONG: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    2**64 - 1,
    -(2**63),
    math.nan,
    math.inf,
    -math.inf,
    1e308,
    "",
    "x" * 70,
    "\x00",
    b"",
    b"\xff" * 40,
    [],
    [1, "a"],
    {},
    {"k": "hello"},
    [[[[[]]]]],
]
"""Values of the wrong type, or at the edge of a range, for any field."""

APP = mi.type_info(AppMessage)
LINK = mi.type_info(LinkFrame)
assert isinstance(APP, mi.UnionType)
assert isinstance(LINK, mi.UnionType)
APP_KINDS: list[mi.StructType] = [t for t in APP.types if isinstance(t, mi.StructType)]
LINK_KINDS: list[mi.StructType] = [t for t in LINK.types if isinstance(t, mi.StructType)]


def _int(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
    return st.integers(lo, min(hi, 2**64 - 1))


def _float(t: mi.FloatType) -> st.SearchStrategy[float]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return st.floats(
        lo, hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None, allow_nan=False, allow_infinity=False
    )


def _sized(t: Any, items: Callable[[int, int], st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else lo + 3, lo + 3)
    return items(lo, hi)


def valid_value(t: Any) -> st.SearchStrategy[Any]:
    """A plain value the decoder accepts for msgspec type ``t``."""
    if isinstance(t, mi.UnionType):
        return st.one_of(*[valid_value(x) for x in t.types])
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        return _int(t)
    if isinstance(t, mi.FloatType):
        return _float(t)
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return st.from_regex(t.pattern, fullmatch=True).filter(lambda s: len(s) <= (t.max_length or 10**6))
        return _sized(t, lambda lo, hi: st.text(min_size=lo, max_size=hi))
    if isinstance(t, mi.BytesType):
        return _sized(t, lambda lo, hi: st.binary(min_size=lo, max_size=hi))
    if isinstance(t, mi.ListType):
        return _sized(t, lambda lo, hi: st.lists(valid_value(t.item_type), min_size=lo, max_size=hi))
    if isinstance(t, mi.TupleType):
        return st.tuples(*[valid_value(x) for x in t.item_types])
    if isinstance(t, mi.DictType):
        return _sized(
            t,
            lambda lo, hi: st.dictionaries(
                valid_value(t.key_type), valid_value(t.value_type), min_size=lo, max_size=hi
            ),
        )
    if isinstance(t, mi.StructType):
        return valid_message(t)
    if isinstance(t, mi.AnyType):
        return st.sampled_from(WRONG)
    raise TypeError(f"fuzz: no strategy for {t!r}")


def valid_message(t: mi.StructType) -> st.SearchStrategy[Any]:
    """A struct as the map (or list) the decoder reads: every required field, some optional ones."""
    fields = {f.encode_name: valid_value(f.type) for f in t.fields}
    optional = [f.encode_name for f in t.fields if not f.required]

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        keep = draw(st.sets(st.sampled_from(optional))) if optional else set()
        values = {f.encode_name: draw(fields[f.encode_name]) for f in t.fields if f.required or f.encode_name in keep}
        if t.array_like:
            return [draw(fields[f.encode_name]) for f in t.fields]
        if t.tag_field is not None:
            values = {t.tag_field: t.tag, **values}
        return values

    return build()


@st.composite
def malformed_message(draw: st.DrawFn, t: mi.StructType) -> Any:
    """A valid struct value with one thing broken (see the module docstring)."""
    value = draw(valid_message(t))
    if t.array_like:
        how = draw(st.sampled_from(["short", "long", "wrong"]))
        if how == "short" or not value:
            return value[:-1]
        if how == "long":
            return [*value, draw(st.sampled_from(WRONG))]
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(st.sampled_from(WRONG)), *value[i + 1 :]]
    keys = [k for k in value if k != t.tag_field]
    how = draw(st.sampled_from(["drop", "extra", "wrong", "deep", "tag"] if keys else ["extra", "tag"]))
    if how == "drop":
        del value[draw(st.sampled_from(keys))]
    elif how == "extra":
        value[draw(st.text(min_size=1, max_size=8))] = draw(st.sampled_from(WRONG))
    elif how == "tag":
        value[t.tag_field or "k"] = draw(st.sampled_from([*WRONG, "nonsense", "delta_chunk", "hello"]))
    else:
        k = draw(st.sampled_from(keys))
        field = next(f for f in t.fields if f.encode_name == k)
        inner = _struct_in(field.type)
        if how == "deep" and inner is not None:
            value[k] = (
                draw(malformed_message(inner))
                if not isinstance(field.type, mi.ListType)
                else [draw(malformed_message(inner))]
            )
        else:
            value[k] = draw(
                st.one_of(
                    st.sampled_from(WRONG),
                    st.text(min_size=600, max_size=700),
                    st.lists(st.integers(-(2**63), 2**64 - 1), min_size=300, max_size=300),
                )
            )
    return value


def _struct_in(t: Any) -> mi.StructType | None:
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.ListType):
        return _struct_in(t.item_type)
    if isinstance(t, mi.UnionType):
        return next((s for s in map(_struct_in, t.types) if s is not None), None)
    return None


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


@st.composite
def app_header(draw: st.DrawFn) -> bytes:
    """An application header: valid, malformed, truncated, or random bytes."""
    kind = draw(st.sampled_from(APP_KINDS))
    how = draw(st.sampled_from(["valid", "malformed", "malformed", "truncated", "random"]))
    if how == "random":
        return draw(st.binary(max_size=300))
    value = draw(valid_message(kind) if how == "valid" else malformed_message(kind))
    data = pack(value)
    if how == "truncated" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


@st.composite
def hostile_frames(draw: st.DrawFn) -> list[bytes]:
    """What an attacker sends as one ZeroMQ message after its link is up (see the module docstring)."""
    how = draw(st.sampled_from(["data", "data", "data", "link", "link-malformed", "random"]))
    if how == "random":
        return draw(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
    if how == "link":
        return [pack(draw(valid_message(draw(st.sampled_from(LINK_KINDS)))))]
    if how == "link-malformed":
        return [pack(draw(malformed_message(draw(st.sampled_from(LINK_KINDS)))))]
    buffers = draw(st.lists(st.binary(max_size=64), max_size=3))
    return [encode_link(LinkData()), draw(app_header()), *buffers]
