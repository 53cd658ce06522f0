"""Dedup keys: bind a call to its task's signature, encode the arguments canonically, digest them.

Two submissions of the same job must get the same dedup key however the caller spelled them
(guarantee G8): ``f(1)``, ``f(a=1)`` and ``f(1, b=<default>)`` bind to one mapping of parameter
names to values; dict order, set order and tuple-versus-list do not matter; UUIDs, datetimes,
Decimals, bytes, enums, dataclasses and pydantic models encode deterministically, in every process
and on every run (no ``hash()``, no ``id()``, no ``repr()`` of arbitrary objects).

Two *different* jobs must never share a key, so the encoding is injective. Its grammar:

* ``None``, ``bool``, ``int`` and ``str`` encode as themselves (JSON ``true`` is not ``1``);
* a mapping whose keys are all strings encodes as a JSON object;
* everything else encodes as a JSON array whose first element is a type tag: ``["list", ...]``
  (tuples too), ``["map", [k, v], ...]`` (other keys), ``["set", ...]``, ``["float", repr]``,
  ``["bytes", base64]``, ``["uuid", str]``, ``["datetime", utc_iso]``,
  ``["naive_datetime", iso]``, ``["date", iso]``, ``["time", iso]``,
  ``["timedelta", microseconds]``, ``["decimal", "<sign><digits>E<exp>"]``,
  ``["enum", qualname, value]``, ``["dataclass", qualname, {field: value}]`` and
  ``["pydantic", qualname, dump]``.

Every JSON array is tagged, so a user's list that looks like a tagged value (``["float", "1.0"]``)
still encodes differently from the value (``["list", "float", "1.0"]``), and ``1``, ``True``,
``1.0`` and ``"1"`` all differ. A value outside the grammar is an error at enqueue time
(:class:`~taskdedup.errors.KeyEncodingError`, naming the task and the argument), never a silent
best effort that could differ between processes.

This module is on the enqueue hot path: the encoder dispatches on ``type(value)`` through a dict
(which learns the subclasses it meets), and only then falls back to ``isinstance`` checks;
signatures are cached per function.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import decimal
import enum
import functools
import hashlib
import inspect
import json
import re
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from .errors import ConfigError, KeyEncodingError

__all__ = [
    "DIGEST_SIZE",
    "MAX_DEPTH",
    "bind_arguments",
    "canonical",
    "digest",
    "encode_arguments",
    "signature_parameters",
]

#: Bytes in a digest (its hex form has twice as many characters).
DIGEST_SIZE = 16

#: How deeply containers may nest; deeper (or self-containing) values are a KeyEncodingError.
MAX_DEPTH = 100

_HINT = "pass JSON-like values, or choose the key arguments with keys=[...] or key=callable"

# The one JSON encoder (equivalent to json.dumps with these arguments, without building an
# encoder per call). Its input is acyclic by construction, so the circular check is skipped.
_dumps = json.JSONEncoder(
    sort_keys=True,
    separators=(",", ":"),
    ensure_ascii=False,
    allow_nan=True,
    check_circular=False,
).encode

_Encoder = Callable[[Any, int], Any]


class _Unencodable(Exception):
    """Internal: a value cannot be encoded; carries the path to it (innermost segment first)."""

    def __init__(self, reason: str, *, with_path: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.with_path = with_path
        self.path: list[str] = []

    def add(self, segment: str) -> None:
        if self.with_path:
            self.path.append(segment)

    def where(self, argument: str) -> str:
        return argument + "".join(reversed(self.path))


def _type_name(t: type) -> str:
    module = getattr(t, "__module__", None)
    qualname = getattr(t, "__qualname__", t.__name__)
    return qualname if module in (None, "builtins") else f"{module}.{qualname}"


def _too_deep() -> _Unencodable:
    return _Unencodable(
        f"is nested deeper than {MAX_DEPTH} levels or contains itself; {_HINT}",
        with_path=False,
    )


def _key_segment(key: Any) -> str:
    if type(key) is str and key.isidentifier():
        return "." + key
    text = repr(key)
    return f"[{text if len(text) <= 40 else text[:37] + '...'}]"


# -- the encoder ------------------------------------------------------------------------------

_PRIMITIVE: frozenset[type] = frozenset({str, int, bool, type(None)})


def _canon(value: Any, depth: int) -> Any:
    t = type(value)
    if t in _PRIMITIVE:
        return value
    encoder = _DISPATCH.get(t)
    if encoder is None:
        encoder = _resolve(t, value)
    return encoder(value, depth)


def _enc_sequence(value: Sequence[Any], depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    depth += 1
    out: list[Any] = ["list"]
    append = out.append
    index = 0
    try:
        for index, item in enumerate(value):  # noqa: B007 - index is read by the handler
            append(item if type(item) in _PRIMITIVE else _canon(item, depth))
    except _Unencodable as exc:
        exc.add(f"[{index}]")
        raise
    return out


def _canonical_pairs(value: Mapping[Any, Any], depth: int) -> tuple[list[tuple[Any, Any]], bool]:
    pairs: list[tuple[Any, Any]] = []
    all_str = True
    for key, item in value.items():
        if type(key) is str:
            ckey: Any = key
        else:
            try:
                ckey = _canon(key, depth)
            except _Unencodable as exc:
                exc.add("[<a key>]")
                raise
            if type(ckey) is not str:
                all_str = False
        try:
            citem = item if type(item) in _PRIMITIVE else _canon(item, depth)
        except _Unencodable as exc:
            exc.add(_key_segment(key))
            raise
        pairs.append((ckey, citem))
    return pairs, all_str


def _pair_order(pair: tuple[Any, Any]) -> tuple[str, str]:
    return _dumps(pair[0]), _dumps(pair[1])


def _enc_mapping(value: Mapping[Any, Any], depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    pairs, all_str = _canonical_pairs(value, depth + 1)
    if all_str:
        obj = dict(pairs)
        if len(obj) == len(pairs):  # two keys encoding alike (odd str subclasses) fall through
            return obj  # the JSON encoder sorts the keys
    pairs.sort(key=_pair_order)
    return ["map", *([k, v] for k, v in pairs)]


def _enc_set(value: AbstractSet[Any], depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    depth += 1
    try:
        items = [item if type(item) in _PRIMITIVE else _canon(item, depth) for item in value]
    except _Unencodable as exc:
        exc.add("[<a set element>]")
        raise
    # The order depends only on the encoded elements, so equal sets always sort alike.
    if all(type(item) is str for item in items):
        items.sort()
    else:
        items.sort(key=_dumps)
    return ["set", *items]


def _enc_float(value: float, depth: int) -> Any:
    return ["float", float.__repr__(value)]  # repr round-trips; nan/inf/-0.0 are stable


def _enc_bytes(value: bytes | bytearray | memoryview, depth: int) -> Any:
    raw = value.tobytes() if isinstance(value, memoryview) else bytes(value)
    return ["bytes", base64.b64encode(raw).decode("ascii")]


def _enc_uuid(value: uuid.UUID, depth: int) -> Any:
    return ["uuid", str(value)]


def _enc_datetime(value: _dt.datetime, depth: int) -> Any:
    if value.utcoffset() is None:  # naive, by Python's own definition
        return ["naive_datetime", value.isoformat()]
    try:
        utc = value.astimezone(_dt.timezone.utc)
    except OverflowError:
        raise _Unencodable(f"is a datetime that cannot be converted to UTC; {_HINT}") from None
    return ["datetime", utc.isoformat()]


def _enc_date(value: _dt.date, depth: int) -> Any:
    return ["date", value.isoformat()]


def _enc_time(value: _dt.time, depth: int) -> Any:
    return ["time", value.isoformat()]  # carries the UTC offset when the time has one


def _enc_timedelta(value: _dt.timedelta, depth: int) -> Any:
    return ["timedelta", (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds]


def _enc_decimal(value: decimal.Decimal, depth: int) -> Any:
    # Exact and independent of the decimal context (Decimal.normalize() would round to it).
    if not value.is_finite():
        return ["decimal", str(value)]
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    coefficient = "".join(map(str, digits)).rstrip("0")
    if not coefficient:
        return ["decimal", "0"]  # 0, -0, 0.00 and 0E+5 are all equal
    exponent += len(digits) - len(coefficient)
    return ["decimal", f"{'-' if sign else ''}{coefficient}E{exponent}"]


def _enc_enum(value: enum.Enum, depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    try:
        inner = _canon(value.value, depth + 1)
    except _Unencodable as exc:
        exc.add(".value")
        raise
    return ["enum", type(value).__qualname__, inner]


def _enc_dataclass(value: Any, depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    depth += 1
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        if not field.compare:  # like ==, ignore fields the class excludes from comparison
            continue
        try:
            fields[field.name] = _canon(getattr(value, field.name), depth)
        except _Unencodable as exc:
            exc.add("." + field.name)
            raise
    return ["dataclass", type(value).__qualname__, fields]


def _enc_pydantic(value: Any, depth: int) -> Any:
    if depth >= MAX_DEPTH:
        raise _too_deep()
    dumped = value.model_dump(mode="python")
    return ["pydantic", type(value).__qualname__, _canon(dumped, depth + 1)]


def _as_int(value: int, depth: int) -> Any:
    return int.__int__(value)  # a plain int, whatever the subclass overrides


def _as_str(value: str, depth: int) -> Any:
    return str.__str__(value)


# Exact types first; _resolve adds the subclasses it meets.
_DISPATCH: dict[type, _Encoder] = {
    list: _enc_sequence,
    tuple: _enc_sequence,
    dict: _enc_mapping,
    set: _enc_set,
    frozenset: _enc_set,
    float: _enc_float,
    bytes: _enc_bytes,
    bytearray: _enc_bytes,
    memoryview: _enc_bytes,
    uuid.UUID: _enc_uuid,
    _dt.datetime: _enc_datetime,
    _dt.date: _enc_date,
    _dt.time: _enc_time,
    _dt.timedelta: _enc_timedelta,
    decimal.Decimal: _enc_decimal,
}
_DISPATCH_LIMIT = 4096  # learned types beyond this are resolved each time, never cached

# isinstance fallbacks, in order: Enum before int/str (IntEnum, StrEnum), datetime before date.
_FALLBACKS: tuple[tuple[type, _Encoder], ...] = (
    (enum.Enum, _enc_enum),
    (int, _as_int),  # bool cannot be subclassed
    (str, _as_str),
    (float, _enc_float),
    (bytes, _enc_bytes),
    (bytearray, _enc_bytes),
    (_dt.datetime, _enc_datetime),
    (_dt.date, _enc_date),
    (_dt.time, _enc_time),
    (_dt.timedelta, _enc_timedelta),
    (decimal.Decimal, _enc_decimal),
    (uuid.UUID, _enc_uuid),
)
_CONTAINER_FALLBACKS: tuple[tuple[type, _Encoder], ...] = (
    (list, _enc_sequence),
    (tuple, _enc_sequence),  # namedtuples too
    (Mapping, _enc_mapping),
    (AbstractSet, _enc_set),
)


def _pydantic_base_model() -> type | None:
    # Only a process that imported pydantic can hold a model, so never import it here.
    module = sys.modules.get("pydantic")
    base = getattr(module, "BaseModel", None) if module is not None else None
    return base if isinstance(base, type) else None


def _resolve(t: type, value: Any) -> _Encoder:
    """The encoder for a type outside the dispatch dict (learned for next time)."""
    encoder: _Encoder | None = None
    for base, candidate in _FALLBACKS:
        if issubclass(t, base):
            encoder = candidate
            break
    if encoder is None:
        model = _pydantic_base_model()
        if dataclasses.is_dataclass(t):
            encoder = _enc_dataclass
        elif model is not None and issubclass(t, model):
            encoder = _enc_pydantic
        else:
            for base, candidate in _CONTAINER_FALLBACKS:
                if issubclass(t, base):
                    encoder = candidate
                    break
    if encoder is None:
        raise _Unencodable(
            f"has type {_type_name(t)}, which taskdedup cannot turn into a key; {_HINT}"
        )
    if len(_DISPATCH) < _DISPATCH_LIMIT:
        _DISPATCH[t] = encoder
    return encoder


# -- public API -------------------------------------------------------------------------------


def canonical(value: Any, *, task: str = "?", argument: str = "?") -> Any:
    """Return a JSON-serialisable, deterministic, type-tagged structure for ``value``.

    Equal arguments (in the sense of G8) give equal structures and different ones give different
    structures; see the module docstring for the grammar. Raises KeyEncodingError naming ``task``
    and ``argument`` (with the path inside it, e.g. ``user.items[2]``) for a value outside it.
    """
    if type(value) in _PRIMITIVE:
        return value
    try:
        return _canon(value, 0)
    except _Unencodable as exc:
        raise KeyEncodingError(task, exc.where(argument), exc.reason) from None
    except RecursionError:  # only if the caller was already deep in the stack
        raise KeyEncodingError(task, argument, _too_deep().reason) from None


def encode_arguments(task: str, bound: Mapping[str, Any]) -> bytes:
    """Canonical bytes of a mapping of argument name -> value (names sorted).

    Errors are KeyEncodingError naming the task and the argument.
    """
    encoded: dict[str, Any] = {}
    for name, value in bound.items():
        encoded[name] = (
            value if type(value) in _PRIMITIVE else canonical(value, task=task, argument=name)
        )
    try:
        text = _dumps(encoded)
    except ValueError as exc:  # an int past sys.get_int_max_str_digits()
        culprit = "?"
        for name, value in encoded.items():
            try:
                _dumps(value)
            except ValueError:
                culprit = name
                break
        raise KeyEncodingError(task, culprit, f"cannot be encoded ({exc}); {_HINT}") from None
    # surrogatepass: a str holding lone surrogates still has one exact, distinct encoding.
    return text.encode("utf-8", "surrogatepass")


_PERSON = b"taskdedup.key.v1"  # blake2b personalisation (16 bytes): versions the key format


def digest(task: str, encoded: bytes, queue: str | None = None) -> str:
    """Fixed-length hex digest (32 characters) of task name, queue and encoded arguments.

    Each part is length-prefixed, so ``("a", b"bc")`` and ``("ab", b"c")`` differ, and a missing
    queue differs from every queue name, including ``""``.
    """
    task_bytes = task.encode("utf-8", "surrogatepass")
    parts = [len(task_bytes).to_bytes(8, "big"), task_bytes]
    if queue is None:
        parts.append(b"\x00")
    else:
        queue_bytes = queue.encode("utf-8", "surrogatepass")
        parts += [b"\x01", len(queue_bytes).to_bytes(8, "big"), queue_bytes]
    parts += [len(encoded).to_bytes(8, "big"), encoded]
    return hashlib.blake2b(b"".join(parts), digest_size=DIGEST_SIZE, person=_PERSON).hexdigest()


@functools.lru_cache(maxsize=1024)
def _cached_signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        hash(fn)
    except TypeError:  # an unhashable callable: no caching
        return inspect.signature(fn)
    return _cached_signature(fn)


@functools.lru_cache(maxsize=1024)
def _plain_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The parameter names when every parameter is plain positional-or-keyword (the common
    case, where a call with all its arguments by position binds by zip); else None."""
    params = inspect.signature(fn).parameters.values()
    if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return tuple(p.name for p in params)
    return None


def signature_parameters(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s parameters, as keys of :func:`bind_arguments` results.

    Used by Policy to validate ``keys=[...]``. A ``*args`` parameter is listed (it binds under
    its name); a ``**kwargs`` parameter is not, since its items are merged in under their own
    names. Raises ConfigError if ``fn`` has no inspectable signature.
    """
    try:
        sig = _signature(fn)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot read the signature of {fn!r}: {exc}") from exc
    return [p.name for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]


_QUOTED_NAME = re.compile(r"'([^']+)'")


def bind_arguments(
    task: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call to ``fn``'s signature with defaults applied: ``{param_name: value}``.

    A ``*args`` parameter appears under its name as a tuple; a ``**kwargs`` parameter's items are
    merged in as if they were named parameters (so ``f(x=1)`` with ``**kw`` gives ``{"x": 1}``).
    A call that does not bind (missing or unexpected argument) raises KeyEncodingError naming the
    task and the argument (``'*'`` when there is no single one).
    """
    if not kwargs:
        try:
            names = _plain_names(fn)
        except (TypeError, ValueError):  # unhashable or no signature: the full path says so
            names = None
        if names is not None and len(names) == len(args):
            return dict(zip(names, args, strict=True))
    try:
        sig = _signature(fn)
    except (TypeError, ValueError) as exc:
        raise KeyEncodingError(
            task, "*", f"cannot be bound: the task function has no signature ({exc})"
        ) from exc
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        text = str(exc)
        match = _QUOTED_NAME.search(text)
        raise KeyEncodingError(
            task,
            match.group(1) if match else "*",
            f"does not bind to the task's signature: {text}; "
            "pass arguments that match the task's signature",
        ) from exc
    bound.apply_defaults()
    parameters = sig.parameters
    out: dict[str, Any] = {}
    extra: Mapping[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            extra = value
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(value)
        else:
            out[name] = value
    for name, value in extra.items():
        if name in out:
            # Only a positional-only or *args name can clash; merging would make two different
            # calls share a key, so refuse rather than guess.
            raise KeyEncodingError(
                task,
                name,
                "is passed in **kwargs but is also the name of a positional-only or *args "
                "parameter, so the key would be ambiguous; rename the parameter or choose the "
                "key with key=callable",
            )
        out[name] = value
    return out
