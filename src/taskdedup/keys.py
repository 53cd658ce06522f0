"""Canonical dedup keys (G8): equal calls give equal keys, different calls different ones.

A call is bound to the task function's signature with defaults applied, so ``f(1)``,
``f(a=1)`` and ``f(1, b=<default>)`` are one call. Each value is turned into a type-tagged,
JSON-able structure whose text does not depend on dict or set order, and the text is hashed with
the task name (and the queue, when asked) into a fixed-length digest. A value that has no
faithful canonical form is refused with an error naming the task and the argument, rather than
keyed on something unstable such as ``repr`` or ``id``.

Tagged values (floats, bytes, UUIDs, dicts, sets, ...) become one-entry JSON objects such as
``{"f": "1.5"}``; plain values and lists never become objects, so no user value can pass for
a tag.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import functools
import hashlib
import inspect
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from .errors import KeyEncodingError

DIGEST_SIZE = 16  # bytes: 32 hex characters
MAX_DEPTH = 64

_dumps = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


@functools.lru_cache(maxsize=4096)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def signature_parameters(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters, in order."""
    return list(_signature(fn).parameters)


def bind_arguments(
    task: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """A call as ``{parameter: value}`` with defaults applied.

    ``*args`` appears under its name as a tuple; the items of ``**kwargs`` are merged in as if
    they were named parameters. A call that does not bind raises KeyEncodingError.
    """
    sig = _signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise KeyEncodingError(
            task, "*", f"does not bind: {exc}; pass arguments that match the task's signature"
        ) from None
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _unencodable(value: Any, task: str, argument: str) -> KeyEncodingError:
    return KeyEncodingError(
        task,
        argument,
        f"has type {type(value).__qualname__}, which taskdedup cannot turn into a key; pass "
        "JSON-like values, or choose the key arguments with keys=[...] or key=callable",
    )


def _float(value: float) -> Any:
    if math.isnan(value):
        return {"f": "nan"}
    return {"f": repr(value)}


def _datetime(value: dt.datetime) -> Any:
    if value.tzinfo is None or value.utcoffset() is None:
        return {"dtn": value.isoformat()}
    return {"dt": value.astimezone(dt.timezone.utc).isoformat()}


def _decimal(value: Decimal) -> Any:
    if value.is_nan():
        return {"dec": "NaN"}
    return {"dec": str(value.normalize()) if value else "0"}


def _sorted(items: list[Any]) -> list[Any]:
    return sorted(items, key=_dumps)


class _Encoder:
    """Turns one argument into its canonical structure; errors name the task and argument."""

    __slots__ = ("argument", "task")

    def __init__(self, task: str, argument: str) -> None:
        self.task, self.argument = task, argument

    def __call__(self, value: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise KeyEncodingError(
                self.task, self.argument, f"is nested deeper than {MAX_DEPTH} levels (recursive?)"
            )
        kind = type(value)
        if kind is str or kind is int or value is None or kind is bool:
            return value
        simple = _SIMPLE.get(kind)
        if simple is not None:
            return simple(value)
        if kind is list or kind is tuple:
            return [self(v, depth + 1) for v in value]
        if kind is set or kind is frozenset:
            return {"s": _sorted([self(v, depth + 1) for v in value])}
        if kind is dict:
            return self._mapping(value, depth)
        return self._other(value, depth)

    def _mapping(self, value: Mapping[Any, Any], depth: int) -> Any:
        pairs = [[self(k, depth + 1), self(v, depth + 1)] for k, v in value.items()]
        return {"d": _sorted(pairs)}

    def _other(self, value: Any, depth: int) -> Any:
        if isinstance(value, enum.Enum):
            return {"enum": [type(value).__qualname__, self(value.value, depth + 1)]}
        if isinstance(value, bool):
            return bool(value)
        if isinstance(value, str):
            return str(value)
        if isinstance(value, int):
            return int(value)
        for base, simple in _SIMPLE.items():
            if isinstance(value, base):
                return simple(value)
        if isinstance(value, list | tuple):
            return [self(v, depth + 1) for v in value]
        if isinstance(value, set | frozenset):
            return {"s": _sorted([self(v, depth + 1) for v in value])}
        if isinstance(value, Mapping):
            return self._mapping(value, depth)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {
                f.name: self(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)
            }
            return {"dc": [type(value).__qualname__, fields]}
        dump = getattr(value, "model_dump", None)
        if dump is not None and _is_pydantic(value):
            return {"pd": [type(value).__qualname__, self(dump(mode="python"), depth + 1)]}
        raise _unencodable(value, self.task, self.argument)


def _is_pydantic(value: Any) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic is optional
        return False
    return isinstance(value, BaseModel)


_SIMPLE: dict[type[Any], Callable[[Any], Any]] = {
    float: _float,
    bytes: lambda v: {"b": base64.b64encode(v).decode()},
    bytearray: lambda v: {"b": base64.b64encode(bytes(v)).decode()},
    memoryview: lambda v: {"b": base64.b64encode(v.tobytes()).decode()},
    uuid.UUID: lambda v: {"u": str(v)},
    dt.datetime: _datetime,
    dt.date: lambda v: {"date": v.isoformat()},
    dt.time: lambda v: {"time": v.isoformat()},
    dt.timedelta: lambda v: {"td": (v.days * 86400 + v.seconds) * 1_000_000 + v.microseconds},
    Decimal: _decimal,
}


def canonical(value: Any, *, task: str = "?", argument: str = "?") -> Any:
    """The JSON-able, deterministic, type-tagged structure of ``value``."""
    return _Encoder(task, argument)(value)


def encode_arguments(task: str, bound: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a mapping of argument name to value."""
    out: dict[str, Any] = {}
    for name, value in bound.items():
        kind = type(value)
        if kind is str or kind is int or value is None:
            out[name] = value
        else:
            out[name] = _Encoder(task, name)(value)
    return _dumps(out).encode()


def digest(task: str, encoded: bytes, queue: str | None = None) -> str:
    """A 32-hex-character digest of the task name, the queue (if any) and the arguments."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in (task.encode(), b"" if queue is None else b"q" + queue.encode()):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(encoded)
    return h.hexdigest()
