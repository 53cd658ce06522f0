"""G8: canonical keys. Equal calls share a key; different calls do not; bad values are named."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Any

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskdedup import KeyEncodingError, Policy
from taskdedup.keys import canonical, digest, encode_arguments


def notify(user_id: int, channel: str = "email", *extra: Any, **options: Any) -> None: ...


KEY = Policy().bind("users.notify", notify).key_for


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Point:
    x: int
    y: int


class User(pydantic.BaseModel):
    id: int
    tags: list[str]


def enc(value: Any) -> bytes:
    return encode_arguments("t", {"v": value})


def test_positional_keyword_and_default_forms_share_a_key() -> None:
    forms = [
        ((1,), {}),
        ((), {"user_id": 1}),
        ((1, "email"), {}),
        ((), {"channel": "email", "user_id": 1}),
    ]
    assert len({KEY(a, k) for a, k in forms}) == 1
    assert KEY((1,), {}) != KEY((1, "sms"), {})
    assert KEY((1,), {"retry": True}) == KEY((), {"retry": True, "user_id": 1})
    assert KEY((1,), {"retry": True}) != KEY((1,), {"retry": False})


def test_keys_select_arguments_and_key_callables_replace_them() -> None:
    by_user = Policy(keys=["user_id"]).bind("users.notify", notify).key_for
    assert by_user((1, "sms")) == by_user((1, "email"))
    assert by_user((1,)) != by_user((2,))
    custom = Policy(key=lambda user_id, **_: user_id % 10).bind("users.notify", notify).key_for
    assert custom((3,)) == custom((13,))
    fixed = Policy(key="singleton").bind("users.notify", notify).key_for
    assert fixed((1,)) == fixed((2,))


def test_digest_has_a_fixed_length_and_covers_task_and_queue() -> None:
    encoded = enc(1)
    assert len(digest("a", encoded)) == len(digest("a" * 500, enc("x" * 10_000))) == 32
    assert digest("a", encoded) != digest("b", encoded)
    assert digest("a", encoded, "q1") != digest("a", encoded, "q2") != digest("a", encoded)
    assert digest("ab", enc("c")) != digest("a", enc("bc"))
    per_queue = Policy(per_queue=True).bind("users.notify", notify).key_for
    assert per_queue((1,), queue="a") != per_queue((1,), queue="b")
    assert KEY((1,), queue="a") == KEY((1,), queue="b")


def test_types_that_look_alike_do_not_collide() -> None:
    values = [True, 1, 1.0, "1", b"1", [1], (1,) * 2, None, "None", Decimal(1), ["f", "1.0"]]
    assert len({enc(v) for v in values}) == len(values)


def test_rich_values_encode_deterministically() -> None:
    u = uuid.uuid4()
    utc = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)
    plus2 = utc.astimezone(dt.timezone(dt.timedelta(hours=2)))
    assert enc(u) == enc(uuid.UUID(str(u)))
    assert enc(utc) == enc(plus2)  # one instant, two time zones
    assert enc(utc.replace(tzinfo=None)) != enc(utc)  # naive is not UTC
    assert enc(Decimal("1.0")) == enc(Decimal("1.00")) != enc(Decimal("1.01"))
    assert enc(dt.date(2026, 1, 2)) != enc(dt.datetime(2026, 1, 2))
    assert enc(dt.time(3, 4)) == enc(dt.time(3, 4))
    assert enc(dt.timedelta(seconds=90)) == enc(dt.timedelta(minutes=1.5))
    assert enc(b"\x00\xff") == enc(bytearray(b"\x00\xff")) == enc(memoryview(b"\x00\xff"))
    assert enc(Color.RED) != enc("red") and enc(Color.RED) == enc(Color("red"))
    assert enc(Point(1, 2)) == enc(Point(x=1, y=2)) != enc(Point(2, 1))
    assert (
        enc(User(id=1, tags=["a"])) == enc(User(tags=["a"], id=1)) != enc({"id": 1, "tags": ["a"]})
    )
    assert enc(float("nan")) == enc(float("nan"))


def test_unencodable_arguments_name_the_task_and_the_argument() -> None:
    with pytest.raises(KeyEncodingError) as err:
        KEY((1, object()))
    message = str(err.value)
    assert "users.notify" in message and "'channel'" in message and "object" in message
    with pytest.raises(KeyEncodingError, match=r"'options'|'callback'"):
        KEY((1,), {"callback": lambda: None})
    nested: list[Any] = []
    nested.append(nested)
    with pytest.raises(KeyEncodingError, match="nested deeper"):
        KEY((nested,))


def test_a_call_that_does_not_bind_is_refused_with_the_task_named() -> None:
    with pytest.raises(KeyEncodingError, match=r"users\.notify") as err:
        KEY((), {"channel": "sms"})
    assert isinstance(err.value, TypeError)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=6), json_like, min_size=1, max_size=6), st.randoms())
def test_dict_order_never_changes_the_key(mapping: dict[str, Any], rnd: Any) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    assert enc(dict(items)) == enc(mapping)
    assert KEY((1,), dict(items)) == KEY((1,), mapping)


@given(st.sets(st.integers() | st.text(max_size=4), max_size=10), st.randoms())
def test_set_order_never_changes_the_key(values: set[Any], rnd: Any) -> None:
    shuffled = list(values)
    rnd.shuffle(shuffled)
    assert enc(set(shuffled)) == enc(values) == enc(frozenset(values))


@given(st.lists(json_like, max_size=5))
def test_tuples_and_lists_encode_alike(values: list[Any]) -> None:
    assert enc(values) == enc(tuple(values))


@given(json_like, json_like)
def test_different_values_give_different_keys(a: Any, b: Any) -> None:
    if canonical(a) != canonical(b):
        assert KEY((1,), {"x": a}) != KEY((1,), {"x": b})
    else:
        assert KEY((1,), {"x": a}) == KEY((1,), {"x": b})


@given(st.integers(), st.text(max_size=10))
def test_every_equivalent_call_form_shares_one_key(user_id: int, channel: str) -> None:
    assert KEY((user_id, channel)) == KEY((), {"user_id": user_id, "channel": channel})
