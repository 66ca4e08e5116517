"""Strict conversion of parsed YAML into frozen dataclasses, with errors that name the path.

`convert(cls, data, file=...)` walks ``cls``'s type hints: dataclasses (unknown
keys and missing required fields are errors), ``int``/``float``/``str``/``bool``
(no silent coercion: ``"3"`` is not an int, ``true`` is not an int, an int is
accepted where a float is expected), ``Literal[...]``, ``X | None``,
``tuple[X, ...]``, ``dict[str, X]`` and unions of dataclasses tagged by a
``kind`` field (a mapping without ``kind`` is the union's first class). Every error is a `ConfigError` carrying the file and the path
in it (``nodes[3].parent``). Cross-field rules belong in each dataclass's
``__post_init__``, raising ``ConfigError(message, path=field)``; `convert`
puts the object's own path in front.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from aurora.errors import ConfigError

T = TypeVar("T")


def convert(cls: type[T], data: Any, *, file: str | None = None, path: str = "") -> T:
    return typing.cast(T, _convert(cls, data, file, path))


def _where(path: str) -> str:
    return path or "(top level)"


def _fail(file: str | None, path: str, msg: str) -> ConfigError:
    return ConfigError(msg, file=file, path=_where(path))


def _tname(t: Any) -> str:
    if isinstance(t, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}.get(
            t.__name__, t.__name__
        )
    return str(t).replace("typing.", "")


def _convert(t: Any, v: Any, file: str | None, path: str) -> Any:
    origin = get_origin(t)
    if t is Any:
        return v
    if origin in (Union, types.UnionType):
        args = get_args(t)
        if v is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _convert(rest[0], v, file, path)
        if all(dataclasses.is_dataclass(a) for a in rest):
            return _tagged(rest, v, file, path)
        for a in rest:
            try:
                return _convert(a, v, file, path)
            except ConfigError:
                pass
        raise _fail(file, path, f"expected {' or '.join(_tname(a) for a in rest)}, got {v!r}")
    if origin is Literal:
        if v not in get_args(t):
            raise _fail(file, path, f"expected one of {', '.join(repr(a) for a in get_args(t))}, got {v!r}")
        return v
    if origin is tuple:
        args = get_args(t)
        if not isinstance(v, list):
            raise _fail(file, path, f"expected a list, got {type(v).__name__}")
        return tuple(_convert(args[0], x, file, f"{path}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        _, vt = get_args(t)
        if not isinstance(v, dict):
            raise _fail(file, path, f"expected a mapping, got {type(v).__name__}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _fail(file, path, f"keys must be strings, got {k!r}")
            out[k] = _convert(vt, x, file, f"{path}.{k}" if path else k)
        return out
    if dataclasses.is_dataclass(t):
        return _dataclass(typing.cast(type, t), v, file, path)
    if t is bool:
        if not isinstance(v, bool):
            raise _fail(file, path, f"expected true or false, got {v!r}")
        return v
    if t is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(file, path, f"expected an integer, got {v!r}")
        return v
    if t is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _fail(file, path, f"expected a number, got {v!r}")
        return float(v)
    if t is str:
        if not isinstance(v, str):
            raise _fail(file, path, f"expected a string, got {v!r}")
        return v
    raise TypeError(f"strict config: unsupported field type {t!r} at {path}")


def _tagged(classes: list[Any], v: Any, file: str | None, path: str) -> Any:
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise _fail(file, path, f"expected a mapping, got {type(v).__name__}")
    kinds = {}
    for c in classes:
        f = {x.name: x for x in dataclasses.fields(c)}["kind"]
        kinds[f.default] = c
    kind = v.get("kind", next(iter(kinds)))
    if kind not in kinds:
        raise _fail(file, f"{path}.kind", f"expected one of {', '.join(map(repr, kinds))}, got {kind!r}")
    return _dataclass(kinds[kind], v, file, path)


def _dataclass(cls: type, v: Any, file: str | None, path: str) -> Any:
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise _fail(file, path, f"expected a mapping, got {type(v).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(v) - set(fields))
    if unknown:
        sub = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise _fail(file, sub, f"unknown key (allowed: {', '.join(sorted(fields))})")
    kw = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in v:
            kw[name] = _convert(hints[name], v[name], file, sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _fail(file, sub, "missing required key")
    try:
        return cls(**kw)
    except ConfigError as e:
        if e.file is None:  # a __post_init__ rule: its path, if any, is relative to this object
            sub = ".".join(p for p in (path, e.path) if p)
            raise ConfigError(e.message, file=file, path=_where(sub)) from None
        raise
