"""G8: canonical keys. Equal calls share a key; different calls do not; bad values are named."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
import json
import os
import string
import subprocess
import sys
import uuid
from decimal import Decimal
from typing import Any, NamedTuple

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskdedup import ConfigError, KeyEncodingError, Policy
from taskdedup.keys import (
    bind_arguments,
    canonical,
    digest,
    encode_arguments,
    signature_parameters,
)


def notify(user_id: int, channel: str = "email", *extra: Any, **options: Any) -> None: ...


KEY = Policy().bind("users.notify", notify).key_for


def key(*args: Any, **kwargs: Any) -> str:
    """The dedup key of ``notify(*args, **kwargs)``, straight from the keys module."""
    bound = bind_arguments("users.notify", notify, args, kwargs)
    return digest("users.notify", encode_arguments("users.notify", bound))


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1


class Paint(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: int


@dataclasses.dataclass
class Vector:
    x: int
    y: int


@dataclasses.dataclass
class Cached:
    value: int
    memo: Any = dataclasses.field(default=None, compare=False)


class User(pydantic.BaseModel):
    id: int
    tags: list[str]


class Team(pydantic.BaseModel):
    name: str
    members: list[User]


class Pair(NamedTuple):
    a: int
    b: int


class Name(str):
    pass


class Count(int):
    pass


def enc(value: Any) -> bytes:
    return encode_arguments("t", {"v": value})


# -- binding ----------------------------------------------------------------------------------


def test_positional_keyword_and_default_forms_share_a_key() -> None:
    forms = [
        ((1,), {}),
        ((), {"user_id": 1}),
        ((1, "email"), {}),
        ((), {"channel": "email", "user_id": 1}),
    ]
    assert len({key(*a, **k) for a, k in forms}) == 1
    assert len({KEY(a, k) for a, k in forms}) == 1
    assert key(1) != key(1, "sms")
    assert key(1, retry=True) == key(user_id=1, retry=True)
    assert key(1, retry=True) != key(1, retry=False)
    assert key(1) != key(1, retry=None)  # an absent option is not a None one


def test_bound_arguments_have_defaults_star_args_and_merged_kwargs() -> None:
    assert bind_arguments("t", notify, (1,), {}) == {"user_id": 1, "channel": "email", "extra": ()}
    assert bind_arguments("t", notify, (1, "sms", 2, 3), {"x": 4}) == {
        "user_id": 1,
        "channel": "sms",
        "extra": (2, 3),
        "x": 4,
    }
    assert key(1, "email", 2) != key(1, "email") != key(1, "email", (2,))
    assert key(1, "email", 2) != key(1, "email", x=2)


def test_a_call_that_does_not_bind_is_refused_with_the_task_and_argument_named() -> None:
    with pytest.raises(KeyEncodingError, match=r"users\.notify") as err:
        KEY((), {"channel": "sms"})
    assert isinstance(err.value, TypeError)
    assert err.value.task == "users.notify" and err.value.argument == "user_id"
    assert "pass arguments that match the task's signature" in str(err.value)

    def strict(a: int, /) -> None: ...

    with pytest.raises(KeyEncodingError, match=r"'mail\.send'.*too many positional") as err:
        bind_arguments("mail.send", strict, (1, 2), {})
    assert err.value.argument == "*"
    with pytest.raises(KeyEncodingError, match="unexpected keyword argument") as err:
        bind_arguments("mail.send", strict, (1,), {"b": 2})
    assert err.value.argument == "b"


def test_kwargs_that_shadow_positional_only_or_star_args_names_are_refused_not_merged() -> None:
    # Merging {"a": 2} over the positional a=1 would give f(1, a=2) and f(5, a=2) one key.
    def f(a: int, /, **kw: Any) -> None: ...

    with pytest.raises(KeyEncodingError, match="ambiguous") as err:
        bind_arguments("t", f, (1,), {"a": 2})
    assert err.value.argument == "a"
    with pytest.raises(KeyEncodingError, match="ambiguous"):
        key(1, extra=(5,))
    assert bind_arguments("t", f, (1,), {"b": 2}) == {"a": 1, "b": 2}


def test_signature_parameters_list_what_a_bound_call_can_hold() -> None:
    assert signature_parameters(notify) == ["user_id", "channel", "extra"]
    # keys=["options"] would select nothing and make every call one key: refused up front.
    with pytest.raises(ConfigError, match="options"):
        Policy(keys=["options"]).bind("users.notify", notify)
    by_extra = Policy(keys=["extra"]).bind("users.notify", notify).key_for
    assert by_extra((1, "a", 9)) == by_extra((2, "b", 9)) != by_extra((1, "a", 8))


def test_keys_select_arguments_and_key_callables_replace_them() -> None:
    by_user = Policy(keys=["user_id"]).bind("users.notify", notify).key_for
    assert by_user((1, "sms")) == by_user((1, "email"))
    assert by_user((1,)) != by_user((2,))
    custom = Policy(key=lambda user_id, **_: user_id % 10).bind("users.notify", notify).key_for
    assert custom((3,)) == custom((13,))
    fixed = Policy(key="singleton").bind("users.notify", notify).key_for
    assert fixed((1,)) == fixed((2,))


# -- digest -----------------------------------------------------------------------------------


def test_digest_has_a_fixed_length_and_covers_task_and_queue() -> None:
    encoded = enc(1)
    for d in (digest("a", encoded), digest("a" * 500, enc("x" * 10_000), "q" * 300)):
        assert len(d) == 32 and set(d) <= set(string.hexdigits.lower())
    assert digest("a", encoded) != digest("b", encoded)
    assert digest("a", encoded, "q1") != digest("a", encoded, "q2") != digest("a", encoded)
    assert digest("a", encoded, "") != digest("a", encoded)  # no queue is not the "" queue
    assert digest("a", encoded) == digest("a", enc(1))
    per_queue = Policy(per_queue=True).bind("users.notify", notify).key_for
    assert per_queue((1,), queue="a") != per_queue((1,), queue="b")
    assert KEY((1,), queue="a") == KEY((1,), queue="b")


def test_digest_parts_cannot_slide_into_each_other() -> None:
    e = b'{"v":1}'
    assert digest("ab", b"c") != digest("a", b"bc")
    assert digest("a", e, "bc") != digest("ab", e, "c")
    assert digest("ab", e) != digest("a", e, "b")
    assert digest("t", e, "q") != digest("t", b"q" + e)
    # A task name that holds bytes looking like framing must not absorb the arguments' frame.
    inner = b"x"
    framed = b"\x00" + len(inner).to_bytes(8, "big") + inner
    smuggled = "a\x00" + len(framed).to_bytes(8, "big").decode("latin-1")
    assert digest("a", framed) != digest(smuggled, inner)
    assert digest("a", framed) != digest("a\x00", framed[1:])


short = st.text(alphabet="ab\x00\x01", max_size=3)


@given(
    short, short, st.none() | short, st.none() | short, st.binary(max_size=3), st.binary(max_size=3)
)
def test_distinct_digest_inputs_give_distinct_digests(
    t1: str, t2: str, q1: str | None, q2: str | None, e1: bytes, e2: bytes
) -> None:
    assert (digest(t1, e1, q1) == digest(t2, e2, q2)) == ((t1, q1, e1) == (t2, q2, e2))


# -- canonical encoding -----------------------------------------------------------------------


def test_types_that_look_alike_do_not_collide() -> None:
    values = [
        True,
        1,
        1.0,
        "1",
        b"1",
        [1],
        (1,) * 2,
        {1},
        {"1": 1},
        {1: 1},
        {True: 1},
        None,
        "None",
        Decimal(1),
        Level.LOW,
        Count(2),
        -0.0,
        0.0,
        dt.timedelta(microseconds=1),
        # containers that mimic the encoder's own tagged forms
        ["float", "1.0"],
        ["list", 1],
        ["set", 1],
        {"f": "1.0"},
        {"d": []},
        ["decimal", "1E0"],
        ["map", [1, 1]],
    ]
    assert len({enc(v) for v in values}) == len(values)


def test_rich_values_encode_deterministically() -> None:
    u = uuid.uuid4()
    utc = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)
    plus2 = utc.astimezone(dt.timezone(dt.timedelta(hours=2)))
    assert enc(u) == enc(uuid.UUID(str(u))) != enc(str(u)) != enc(uuid.uuid4())
    assert enc(utc) == enc(plus2)  # one instant, two time zones
    assert enc(utc.replace(tzinfo=None)) != enc(utc)  # naive is not UTC
    assert enc(utc) != enc(utc + dt.timedelta(microseconds=1))
    assert enc(dt.date(2026, 1, 2)) != enc(dt.datetime(2026, 1, 2)) != enc("2026-01-02")
    assert enc(dt.time(3, 4)) == enc(dt.time(3, 4)) != enc(dt.time(3, 5))
    assert enc(dt.time(3, 4)) != enc(dt.time(3, 4, tzinfo=dt.timezone.utc))
    assert enc(dt.timedelta(seconds=90)) == enc(dt.timedelta(minutes=1.5)) != enc(90)
    assert enc(b"\x00\xff") == enc(bytearray(b"\x00\xff")) == enc(memoryview(b"\x00\xff"))
    assert enc(b"\x00\xff") != enc(b"\x00\xfe")
    assert enc(Color.RED) != enc("red") and enc(Color.RED) == enc(Color("red"))
    assert enc(Color.RED) != enc(Color.BLUE) and enc(Color.RED) != enc(Paint.RED)
    assert enc(Level.LOW) != enc(1)
    assert enc(Point(1, 2)) == enc(Point(x=1, y=2)) != enc(Point(2, 1))
    assert enc(Point(1, 2)) != enc(Vector(1, 2)) != enc({"x": 1, "y": 2})
    assert enc(Cached(1, memo="a")) == enc(Cached(1, memo=object())) != enc(Cached(2))
    assert (
        enc(User(id=1, tags=["a"])) == enc(User(tags=["a"], id=1)) != enc({"id": 1, "tags": ["a"]})
    )
    assert enc(User(id=1, tags=["a"])) != enc(User(id=1, tags=["b"]))
    team = Team(name="x", members=[User(id=1, tags=[])])
    assert enc({"team": team}) == enc({"team": Team.model_validate(team.model_dump())})
    assert enc(float("nan")) == enc(float("nan")) != enc(float("inf"))


def test_decimals_share_a_key_exactly_when_they_are_equal() -> None:
    assert enc(Decimal("1.0")) == enc(Decimal("1.00")) == enc(Decimal("1")) != enc(Decimal("1.01"))
    assert enc(Decimal("1E+2")) == enc(Decimal("100")) == enc(Decimal("100.000"))
    assert enc(Decimal("0")) == enc(Decimal("-0.00")) == enc(Decimal("0E+5"))
    assert enc(Decimal("-1.5")) != enc(Decimal("1.5"))
    # More digits than the decimal context keeps: rounding here would merge different jobs.
    assert enc(Decimal("1.0000000000000000000000000000001")) != enc(Decimal(1))
    assert enc(Decimal("NaN")) == enc(Decimal("NaN")) != enc(Decimal("Infinity"))


def test_subclasses_of_plain_types_encode_as_their_base_type() -> None:
    assert enc(Name("bob")) == enc("bob")
    assert enc({Name("k"): Count(3)}) == enc({"k": 3})
    assert enc(Pair(1, 2)) == enc((1, 2)) == enc([1, 2])
    assert enc(collections.OrderedDict([("b", 1), ("a", 2)])) == enc({"a": 2, "b": 1})
    assert enc(collections.defaultdict(int, {"a": 1})) == enc({"a": 1})


class Loose(str):
    """A str whose instances are never equal, so one dict can hold two keys spelled "k"."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def test_keys_that_encode_alike_do_not_make_the_key_depend_on_insertion_order() -> None:
    first, second = Loose("k"), Loose("k")
    assert enc({first: 1, second: 2}) == enc({second: 2, first: 1})
    assert enc({first: 1, second: 2}) != enc({"k": 1}) != enc({"k": 2})


def test_canonical_is_plain_json_and_names_what_it_cannot_encode() -> None:
    value = {"when": dt.date(2026, 1, 1), "ids": {3, 1, 2}, 2: [Decimal("1.50"), b"x"]}
    structure = canonical(value)
    assert json.loads(json.dumps(structure)) == structure  # only plain JSON types inside
    reordered = {
        "ids": {2, 1, 3},
        2: (Decimal("1.5"), bytearray(b"x")),
        "when": dt.date(2026, 1, 1),
    }
    assert canonical(reordered) == structure
    assert canonical({**value, "ids": {1, 2}}) != structure
    with pytest.raises(KeyEncodingError, match=r"task 'billing\.charge': argument 'card\[0\]'"):
        canonical([object()], task="billing.charge", argument="card")


_IN_A_CHILD = """
import datetime, decimal, sys, uuid
from taskdedup.keys import bind_arguments, digest, encode_arguments
value = {
    "tags": {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"},
    "mixed": {1: "a", "b": 2, (3, "c"): {4.5, "d", None}},
    "when": datetime.datetime(2026, 1, 1, 9, tzinfo=datetime.timezone.utc),
    "id": uuid.UUID(int=7), "price": decimal.Decimal("9.90"), "raw": b"\\x00",
}
print(digest("t", encode_arguments("t", value), "q"))
"""


def test_keys_are_the_same_in_every_process() -> None:
    # Producers are separate processes with different hash seeds (set and dict iteration order).
    digests = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _IN_A_CHILD], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 32


def test_strings_with_lone_surrogates_encode_and_stay_distinct() -> None:
    assert enc("\ud83d\ude00") != enc("\U0001f600") != enc("\ud83d")


def test_unencodable_arguments_name_the_task_and_the_argument() -> None:
    with pytest.raises(KeyEncodingError) as err:
        KEY((1, object()))
    message = str(err.value)
    assert "users.notify" in message and "'channel'" in message and "object" in message
    assert "keys=[...]" in message
    with pytest.raises(KeyEncodingError, match=r"users\.notify.*'callback'.*function"):
        key(1, callback=lambda: None)
    with pytest.raises(KeyEncodingError) as err:
        key({"items": [1, 2, object()]})
    assert err.value.argument == "user_id.items[2]"
    with pytest.raises(KeyEncodingError, match=r"'user_id\[<a key>\]'"):
        key({object(): 1})
    with pytest.raises(KeyEncodingError, match=r"'user_id\.y'"):
        key(Point(1, object()))  # type: ignore[arg-type]


def test_recursive_and_absurdly_deep_values_are_refused_not_a_crash() -> None:
    nested: list[Any] = []
    nested.append(nested)
    with pytest.raises(KeyEncodingError, match=r"users\.notify.*'user_id'.*nested deeper"):
        KEY((nested,))
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(KeyEncodingError, match="nested deeper"):
        enc(loop)
    deep: Any = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(KeyEncodingError, match="nested deeper"):
        enc(deep)
    ok: Any = 1
    for _ in range(50):
        ok = {"a": [ok]}
    assert enc(ok) == enc(ok)


def test_an_integer_too_long_to_print_is_a_key_error_naming_the_argument() -> None:
    with pytest.raises(KeyEncodingError, match="'big'"):
        encode_arguments("t", {"small": 1, "big": 10**5000})


# -- properties -------------------------------------------------------------------------------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)

# Small domains, so that near-collisions (same leaves, different structure) are common.
tiny_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-1, 2)
    | st.sampled_from([0.0, -0.0, 1.0, float("nan")])
    | st.text(alphabet="1ab", max_size=2)
    | st.binary(max_size=1)
)
tiny_hashable = st.recursive(
    st.integers(-1, 2) | st.text(alphabet="1a", max_size=2),
    lambda inner: st.tuples(inner) | st.tuples(inner, inner),
    max_leaves=3,
)
tiny = st.recursive(
    tiny_scalar,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(tiny_hashable, inner, max_size=3)
        | st.frozensets(tiny_hashable, max_size=3)
    ),
    max_leaves=8,
)


def oracle(value: Any) -> Any:
    """What makes two values the same job: type and value, with tuple == list (independent)."""
    if value is None or isinstance(value, bool | int | str | bytes):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, list | tuple):
        return ("seq", tuple(oracle(v) for v in value))
    if isinstance(value, dict):
        return ("dict", frozenset((oracle(k), oracle(v)) for k, v in value.items()))
    if isinstance(value, frozenset):
        return ("set", frozenset(oracle(v) for v in value))
    raise AssertionError(value)


@given(tiny, tiny)
def test_keys_are_equal_exactly_when_the_values_are_the_same(a: Any, b: Any) -> None:
    assert (enc(a) == enc(b)) == (oracle(a) == oracle(b))
    assert (key(1, x=a) == key(1, x=b)) == (oracle(a) == oracle(b))


@given(json_like, json_like)
def test_different_values_give_different_keys(a: Any, b: Any) -> None:
    assert (enc(a) == enc(b)) == (oracle(a) == oracle(b))


@given(st.integers(), st.integers())
def test_different_integers_give_different_keys(a: int, b: int) -> None:
    assert (key(a) == key(b)) == (a == b)


@given(st.text(), st.text())
def test_different_strings_give_different_keys(a: str, b: str) -> None:
    assert (key(1, a) == key(1, b)) == (a == b)


@given(st.dictionaries(st.text(max_size=6), json_like, min_size=1, max_size=6), st.randoms())
def test_dict_order_never_changes_the_key(mapping: dict[str, Any], rnd: Any) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    assert enc(dict(items)) == enc(mapping)
    assert KEY((1,), dict(items)) == KEY((1,), mapping)


@given(
    st.dictionaries(st.integers(-3, 3) | st.text(max_size=2) | st.tuples(st.integers()), tiny),
    st.randoms(),
)
def test_order_of_mixed_type_keys_never_changes_the_key(mapping: dict[Any, Any], rnd: Any) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    assert enc(dict(items)) == enc(mapping)


@given(st.sets(st.integers() | st.text(max_size=4) | st.floats(allow_nan=False)), st.randoms())
def test_set_order_never_changes_the_key(values: set[Any], rnd: Any) -> None:
    shuffled = list(values)
    rnd.shuffle(shuffled)
    assert enc(set(shuffled)) == enc(values) == enc(frozenset(values))


@given(st.lists(json_like, max_size=5))
def test_tuples_and_lists_encode_alike(values: list[Any]) -> None:
    assert enc(values) == enc(tuple(values))
    assert enc({"k": [values]}) == enc({"k": (tuple(values),)})


@given(st.integers(), st.text(max_size=10))
def test_every_equivalent_call_form_shares_one_key(user_id: int, channel: str) -> None:
    assert KEY((user_id, channel)) == KEY((), {"user_id": user_id, "channel": channel})
    assert key(user_id, channel) == key(channel=channel, user_id=user_id)


offsets = st.builds(
    dt.timezone, st.timedeltas(min_value=dt.timedelta(hours=-23), max_value=dt.timedelta(hours=23))
)


@given(
    st.datetimes(
        min_value=dt.datetime(2, 1, 1), max_value=dt.datetime(9998, 1, 1), timezones=offsets
    ),
    offsets,
)
def test_one_instant_in_any_time_zone_shares_a_key(moment: dt.datetime, zone: dt.tzinfo) -> None:
    assert enc(moment) == enc(moment.astimezone(zone))
    assert enc(moment) != enc(moment.replace(tzinfo=None))
    assert enc(moment) != enc(moment + dt.timedelta(microseconds=1))


@given(st.uuids(), st.decimals(allow_nan=False, allow_infinity=False), st.binary(max_size=8))
def test_rich_values_round_trip_to_the_same_key(u: uuid.UUID, d: Decimal, b: bytes) -> None:
    assert enc([u, d, b]) == enc((uuid.UUID(bytes=u.bytes), Decimal(str(d)), bytearray(b)))
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    padded = Decimal((sign, (*digits, 0, 0, 0), exponent - 3))  # exact, no context rounding
    assert padded == d and enc(padded) == enc(d)
    assert enc(d) != enc(d.next_plus())
