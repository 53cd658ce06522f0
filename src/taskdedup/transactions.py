"""Enqueue inside the caller's database transaction, on a PostgreSQL store in that database.

Inside an open transaction of the database the store lives in, an enqueue writes its lock row
in that transaction and publishes its message only once the transaction commits:

- a rollback leaves neither a lock nor a job (the row was never committed; the publish is
  dropped with the transaction);
- the caller gets its job id (or the holder's) at once;
- a process that dies between the commit and the publish leaves a lock that was never
  confirmed: it lapses within ``grace`` (G11), so the key is never stranded.

Three ways in: Django's ``transaction.atomic()`` (found by itself when Django's connection is
to the store's database, on psycopg 3), a SQLAlchemy ``Session`` passed to
:func:`transaction` (its commit publishes), or ``with transaction(conn):`` around a psycopg
connection or a SQLAlchemy ``Connection`` (the block is the transaction: it commits at the
end, then publishes). ``async with transaction(...)`` takes an ``AsyncSession`` or a psycopg
``AsyncConnection``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from .errors import ConfigError

log = logging.getLogger("taskdedup")

Publish = Callable[[], Any]  # returns None, or an awaitable (taskiq's kick)


class Transaction:
    """An open transaction that enqueues join: its connection (psycopg 3, sync or async),
    and the publishes to run once it commits (dropped if it rolls back)."""

    def __init__(self, conn: Any, on_commit: Callable[[Publish], None] | None = None) -> None:
        self.conn = conn
        self.pending: list[Publish] = []
        #: job ids whose locks this transaction took (unconfirmed until the commit publishes)
        self.taken: set[str] = set()
        self._on_commit = on_commit

    def after_commit(self, publish: Publish) -> None:
        """Run ``publish`` once the transaction commits (never, if it rolls back)."""
        if self._on_commit is not None:
            self._on_commit(publish)
        else:
            self.pending.append(publish)

    def committed(self) -> list[Publish]:
        """The publishes waiting for the commit, handed over once."""
        done, self.pending = self.pending, []
        return done


_CURRENT: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar(
    "taskdedup_transaction", default=None
)


def current(store: Any) -> Transaction | None:
    """The open transaction an enqueue on ``store`` joins: the one of ``transaction()``, else
    Django's atomic block on the store's database; None: the store's own transactions."""
    found = _CURRENT.get()
    if found is not None:
        if not (hasattr(store, "same_database") and store.same_database(found.conn)):
            raise ConfigError(
                f"taskdedup.transaction(): the store ({type(store).__name__}) is not the "
                "database of this connection, so the job's lock cannot be written in its "
                "transaction; set the taskdedup url to that PostgreSQL database, or enqueue "
                "outside the block"
            )
        return found
    if "django.db" in sys.modules and hasattr(store, "same_database"):
        return _django(store)
    return None


def _django(store: Any) -> Transaction | None:
    from django.db import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        connections,
    )
    from django.db import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        transaction as django_transaction,
    )

    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block or conn.connection is None:
            continue
        raw = conn.connection
        if type(raw).__module__.split(".")[0] != "psycopg":
            _warn_once(
                conn.alias,
                "taskdedup: Django's database %r runs on %s, not psycopg 3: an enqueue inside "
                "its atomic() does not join the transaction (install psycopg 3 for Django)",
                conn.alias,
                type(raw).__module__,
            )
            continue
        if store.same_database(raw):
            block = conn.atomic_blocks[0] if conn.atomic_blocks else None
            kept = getattr(conn, "_taskdedup_transaction", None)
            if kept is not None and kept[0] is block:  # (the same outermost atomic block)
                return kept[1]  # type: ignore[no-any-return]
            on_commit = functools.partial(django_transaction.on_commit, using=conn.alias)
            found = Transaction(raw, on_commit)
            conn._taskdedup_transaction = (block, found)
            return found
    return None


_warned: set[str] = set()


def _warn_once(what: str, message: str, *args: object) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message, *args)


@contextlib.contextmanager
def transaction(target: Any) -> Iterator[Transaction]:
    """Join the enqueues in this block to ``target``'s transaction: a SQLAlchemy ``Session``
    (its commit publishes them, its rollback drops them), or a psycopg ``Connection`` or
    SQLAlchemy ``Connection`` with no transaction open (the block is one: it commits at the
    end, then publishes)."""
    if _is_session(target):
        with _session(target) as found:
            yield found
        return
    raw, block = _raw_and_block(target)
    found = Transaction(raw)
    with block:
        token = _CURRENT.set(found)
        try:
            yield found
        finally:
            _CURRENT.reset(token)
    for publish in found.committed():  # (the block committed: it raised otherwise)
        _run(publish)


@contextlib.asynccontextmanager
async def atransaction(target: Any) -> AsyncIterator[Transaction]:
    """:func:`transaction` for asyncio: a SQLAlchemy ``AsyncSession`` or ``AsyncConnection``,
    or a psycopg ``AsyncConnection``; the block commits at its end, then publishes."""
    if hasattr(target, "get_raw_connection") or hasattr(target, "sync_session"):
        if target.in_transaction():  # a SQLAlchemy AsyncSession or AsyncConnection
            raise _nested(target)
        block = target.begin()
    else:  # psycopg AsyncConnection
        if target.info.transaction_status != 0:  # (IDLE)
            raise _nested(target)
        block = target.transaction()
    async with block:
        if hasattr(target, "sync_session"):  # (an AsyncSession: its connection's driver's)
            raw = await _adriver(await target.connection())
        else:
            raw = await _adriver(target) if hasattr(target, "get_raw_connection") else target
        found = Transaction(raw)
        token = _CURRENT.set(found)
        try:
            yield found
        finally:
            _CURRENT.reset(token)
    for publish in found.committed():
        await _arun(publish)


async def _adriver(conn: Any) -> Any:
    raw = await conn.get_raw_connection()
    return raw.driver_connection


def _is_session(target: Any) -> bool:
    return hasattr(target, "get_bind") and hasattr(target, "new")


@contextlib.contextmanager
def _session(session: Any) -> Iterator[Transaction]:
    """A SQLAlchemy Session's transaction: its next commit publishes, a rollback drops."""
    from sqlalchemy import event  # type: ignore[import-not-found,unused-ignore]

    found: Transaction = session.info.get("taskdedup_transaction") or Transaction(
        session.connection().connection.driver_connection
    )
    if "taskdedup_transaction" not in session.info:
        session.info["taskdedup_transaction"] = found

        def committed(_: Any) -> None:
            for publish in found.committed():
                _run(publish)

        event.listen(session, "after_commit", committed)
        event.listen(session, "after_rollback", lambda _: found.committed())
    token = _CURRENT.set(found)
    try:
        yield found
    finally:
        _CURRENT.reset(token)


def _raw_and_block(target: Any) -> tuple[Any, Any]:
    if hasattr(target, "begin") and hasattr(target, "in_transaction"):  # SQLAlchemy Connection
        if target.in_transaction():
            raise _nested(target)
        return target.connection.driver_connection, target.begin()
    if type(target).__module__.split(".")[0] == "psycopg":
        if target.info.transaction_status != 0:  # (IDLE)
            raise _nested(target)
        return target, target.transaction()
    raise ConfigError(
        f"taskdedup.transaction() takes a psycopg 3 connection or a SQLAlchemy Session or "
        f"Connection on psycopg 3, not {type(target).__name__}"
    )


def _nested(target: Any) -> ConfigError:
    return ConfigError(
        f"taskdedup.transaction({type(target).__name__}) must open the transaction: this one "
        "is already in one, whose commit taskdedup would not see. Enter it first, or pass the "
        "SQLAlchemy Session (whose commit it hears); in Django, atomic() is joined by itself"
    )


def _run(publish: Publish) -> None:
    """Publish after the commit; an error is logged, as the caller has its answer already
    (whatever was taken for the job is given back by the publish itself, G5)."""
    try:
        publish()
    except Exception:
        log.exception("taskdedup: a publish after the commit failed")


async def _arun(publish: Publish) -> None:
    try:
        result = publish()
        if isinstance(result, Awaitable):
            await result
    except Exception:
        log.exception("taskdedup: a publish after the commit failed")
