"""How PostgresStore runs an operation, in a transaction of its own or in the caller's open
transaction (see ``transactions.py``).

On its ordinary path an enqueue, a peek, a claim, a finish or a batch of confirmations is one
statement, one round trip: a function (``<prefix>_acquire``, ``_claim``, ``_finish``,
``_confirm``) that locks the key, reads its rows and writes the change, the twin of the shared
transition for that path (:func:`one_statement`). Off it a claim or a finish writes nothing and
answers :class:`Fallback`, the rows it read and their digest; the shared transition runs on
them here and its writes go out in a second statement that writes only if the rows still
match the digest (``<prefix>_save_if``). Every other operation, and one whose rows changed in
between, takes the general way: two round trips in psycopg's pipeline mode. Round trip 1
begins, takes the keys' advisory locks, reads the clock and the rows (``<prefix>_open``); the
shared transition runs on them here; round trip 2 writes what changed (``<prefix>_save``) and
commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import psycopg
import psycopg.errors
import psycopg_pool

from .. import transactions
from ..errors import StoreUnavailable
from .base import (
    Acquire,
    AcquireReply,
    Claim,
    ClaimReply,
    Confirm,
    Finish,
    FinishReply,
    MarkTick,
    Op,
    Pace,
    Peek,
    R,
    Remember,
    Reserve,
    ReserveAll,
)
from .record_store import TRANSITIONS
from .sql import PURGE_BATCH, Miss, Row, Rows, wanted

if TYPE_CHECKING:
    from .postgres_schema import Queries


class PostgresStore(Protocol):
    """What an operation needs of the store (``postgres.PostgresStore``)."""

    prefix: str
    history: bool
    issued: int
    class_id: int
    timeout_ms: int
    synchronous_commit: str
    sql: Queries
    _checked: bool

    def purge_due(self) -> bool: ...

    def _pool(self) -> psycopg_pool.ConnectionPool[Any]: ...

    def _ready_pool(self) -> psycopg_pool.ConnectionPool[Any]: ...

    async def _apool(self) -> psycopg_pool.AsyncConnectionPool[Any]: ...


#: Errors that mean "the database cannot answer now" (G5), not a bug in a request.
_UNAVAILABLE = (psycopg.OperationalError, psycopg_pool.PoolTimeout, OSError)
#: Errors after which the same transaction, run again, may well succeed.
_AGAIN = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
#: One write transaction in this many also purges a batch of expired rows.
PURGE_EVERY = 64


class _Call:
    """One operation's transaction: the statements of both round trips, and its answer."""

    def __init__(
        self, store: PostgresStore, op: Op[Any], extra: list[tuple[str, str]], joined: bool = False
    ) -> None:
        self.store, self.op, self.joined = store, op, joined
        plan = wanted(op)
        self.everything = plan is None
        tags, jobs = plan or ([], [])
        self.tags = sorted({*tags, *(t for t, _ in extra)})
        self.jobs = {*jobs, *extra}
        self.answer: Any = None
        self.wrote = False  # its writes (or commit) went out: the outcome is the database's

    def opening(self) -> list[tuple[str, tuple[Any, ...]]]:
        """Round trip 1: begin (on an autocommit connection: psycopg's own BEGIN would cost a
        round trip of its own), then lock the keys, read the clock and the rows."""
        s = self.store
        if self.everything:
            return [("BEGIN", ()), (s.sql.all, ())]
        jobs = sorted(self.jobs)
        jtags, jparts = [t for t, _ in jobs], [p for _, p in jobs]
        if self.joined:  # the caller's transaction: no BEGIN, and its settings left alone
            return [(s.sql.open, (s.class_id, self.tags, jtags, jparts, None, None))]
        args = (s.class_id, self.tags, jtags, jparts, str(s.timeout_ms), s.synchronous_commit)
        return [("BEGIN", ()), (s.sql.open, args)]

    def _load(self, tag: str, part: str) -> Row | None:
        if (tag, part) in self.jobs or (tag in self.tags and not part.startswith("job:")):
            return None  # read in round trip 1, and not there
        raise Miss(tag, part)

    def closing(self, read: list[Row]) -> list[tuple[str, tuple[Any, ...]]]:
        """Run the transition on what round trip 1 read (the clock first, then the rows);
        round trip 2: the writes (the commit follows them)."""
        s = self.store
        now_us, rows = int(read[0][3]), read[1:]
        records = Rows(s.prefix, now_us, rows, self._load, everything=self.everything)
        records.history, records.issued = s.history, s.issued
        self.answer = TRANSITIONS[type(self.op)](self.op, records)
        s.issued = records.issued
        writes, deletes = records.changes()
        if self.everything:
            return []  # the tools' scans write nothing (expired rows are the purge's)
        if not writes and not deletes:
            return []  # (read only: safe to run again on a new connection)
        self.wrote = True  # from here on, whether it was committed is the database's to say
        purge = PURGE_BATCH if s.purge_due() else 0
        wt, wp, wb, we = ([row[i] for row in writes] for i in range(4))
        dt, dp = [t for t, _ in deletes], [p for _, p in deletes]
        return [(s.sql.save, (wt, wp, wb, we, dt, dp, now_us // 1000, purge))]

    def closing_if(self, read: Fallback) -> tuple[str, tuple[Any, ...]] | None:
        """Run the transition on the rows a one-statement function read before it fell back;
        the statement that writes its changes if those rows are still as read (None: nothing
        to write, the answer stands)."""
        rows: list[Row] = [tuple(row) for row in json.loads(read.rows)]
        closing = self.closing([("", "", "", read.now_us), *rows])
        if not closing:
            return None
        s, jobs = self.store, sorted(self.jobs)
        keys = (s.class_id, self.tags, [t for t, _ in jobs], [p for _, p in jobs], read.seen)
        return s.sql.save_if, (*keys, *closing[0][1], str(s.timeout_ms), s.synchronous_commit)


JOINS: frozenset[type[Any]] = frozenset(
    (Acquire, Peek, Remember, Reserve, ReserveAll, Pace, MarkTick)
)


@dataclasses.dataclass(frozen=True, slots=True)
class Fallback:
    """A one-statement function's answer for a case off its path: it wrote nothing, and read
    these rows (``<prefix>_seen``'s JSON) at ``now_us``; ``seen`` is their digest."""

    now_us: int
    seen: str
    rows: str


def one_statement(
    store: PostgresStore, op: Op[Any], joined: bool
) -> tuple[str, tuple[Any, ...], Callable[[Any], Any]] | None:
    """The statement that answers ``op`` in one round trip on its ordinary path, its
    arguments and how to read its row; None: ``op`` takes the open/save path. The functions
    answer :class:`Fallback` (having written nothing) for a case off that path. Each is safe to send
    again when its reply was lost: an acquire of the same job id is the holder's, a claim
    carrying the same nonce is answered as it was, a finish is done already."""
    wait, sync = (None, None) if joined else (str(store.timeout_ms), store.synchronous_commit)
    kind = type(op)
    args: tuple[Any, ...]
    if kind is Peek:
        peek = cast(Peek, op)
        args = (store.class_id, peek.key, "", 0, 0, peek.record_duplicate, "", wait, sync, 0)
        return store.sql.acquire, (*args, True), acquired
    if kind is Acquire:
        a = cast(Acquire, op)
        if a.debounce_ms or a.cancel or a.payload is not None or a.guard is not None:
            return None
        purge = PURGE_BATCH if store.purge_due() else 0
        args = (store.class_id, a.key, a.job_id, a.ttl_ms, a.grace_ms, a.record_duplicate)
        return store.sql.acquire, (*args, a.task, wait, sync, purge, False), acquired
    if joined:
        return None  # (a claim or a finish never runs in a caller's transaction)
    if kind is Claim:
        c = cast(Claim, op)
        if c.latest or c.run_lock:
            return None
        args = (store.class_id, c.key, c.job_id, c.owner, c.lease_ms, c.memory_ms, c.attempt)
        handoff = c.handoff_job_id is not None
        return (
            store.sql.claim,
            (*args, c.nonce, c.lock, wait, sync, store.history, handoff),
            claimed,
        )
    if kind is Confirm:
        if cast(Confirm, op).duplicates:
            return None  # (duplicates counted with it: the general way)
        items = cast(Confirm, op).items
        keys, jobs = [k for k, _ in items], [j for _, j in items]
        return store.sql.confirm, (store.class_id, keys, jobs, wait, sync), lambda row: row[0]
    if kind is Finish:
        f = cast(Finish, op)
        if f.handoff_job_id is not None:
            return None  # (reschedule_once: a run may be owed; the general way, two trips)
        args = (store.class_id, f.key, f.job_id, f.throttle, f.memory_ms, f.attempt, wait, sync)
        return store.sql.finish, (*args, store.history, f.handoff_job_id is not None), finished
    return None


def acquired(row: Any) -> AcquireReply | None:
    """The acquire function's row as the reply (none: a peek found the key free)."""
    if row is None:
        return None
    return AcquireReply(row[0], row[1], int(row[2]), int(row[3]), row[4], row[5])


def claimed(row: Any) -> ClaimReply | Fallback:
    if row[0] == "fallback":
        return Fallback(int(row[1]), row[2], row[3])
    return ClaimReply("run", int(row[1]), 1, "")  # (the owner is filled in by the caller)


def finished(row: Any) -> FinishReply | Fallback:
    if row[0] == "fallback":
        return Fallback(int(row[1]), row[2], row[3])
    return FinishReply(row[0] == "released")


def run_own(store: PostgresStore, op: Op[R]) -> R:
    """``op`` in a transaction of the store's own: one statement on its ordinary path, else
    two (see the module's docstring); retried on a deadlock or a serialization failure, and
    once on a new connection when a pooled one the server had closed (a restart) fails
    before anything was written."""
    extra: list[tuple[str, str]] = []
    reconnects, slow = 1, False
    with _answering():
        for attempt in range(8):
            call: _Call | None = None
            try:
                pool = store._ready_pool()
                fast = None if slow else one_statement(store, op, False)
                if fast is not None:  # one round trip: its own transaction (autocommit)
                    with pool.connection() as conn:
                        answer = fast[2](conn.execute(fast[0], fast[1]).fetchone())
                    if not isinstance(answer, Fallback):
                        return cast(R, _owned(op, answer))
                    slow = True  # (the open/save way, if the second statement cannot write)
                    call = _Call(store, op, extra)
                    save = call.closing_if(answer)
                    if save is None:
                        return cast(R, call.answer)
                    with pool.connection() as conn:
                        if conn.execute(*save).fetchone()[0]:
                            return cast(R, call.answer)
                    continue  # the rows changed in between
                call = _Call(store, op, extra)
                with pool.connection() as conn, _rolled_back(conn), conn.pipeline():
                    rows = [conn.execute(q, a) for q, a in call.opening()][1].fetchall()
                    for q, a in call.closing(rows):
                        conn.execute(q, a)
                    conn.execute("COMMIT")
                return cast(R, call.answer)
            except Miss as miss:
                extra.append((miss.tag, miss.part))
            except _AGAIN:
                time.sleep(random.uniform(0, 0.002 * 2**attempt))
            except psycopg.OperationalError:
                if (call is not None and call.wrote) or not reconnects:
                    raise  # the writes may have been committed: not ours to send twice
                reconnects -= 1
                store._pool().check()  # the server restarted: drop every dead connection
    raise StoreUnavailable(f"PostgreSQL: {type(op).__name__} kept meeting conflicts")


async def arun_own(store: PostgresStore, op: Op[R]) -> R:
    """:func:`run_own` on the store's asyncio pool of the running event loop."""
    extra: list[tuple[str, str]] = []
    reconnects, slow = 1, False
    with _answering():
        for attempt in range(8):
            call: _Call | None = None
            try:
                async with (await store._apool()).connection() as conn:
                    fast = None if slow else one_statement(store, op, False)
                    if fast is not None:
                        row = await (await conn.execute(fast[0], fast[1])).fetchone()
                        if not isinstance(answer := fast[2](row), Fallback):
                            return cast(R, _owned(op, answer))
                        slow = True
                        call = _Call(store, op, extra)
                        save = call.closing_if(answer)
                        if save is None:
                            return cast(R, call.answer)
                        if (await (await conn.execute(*save)).fetchone())[0]:
                            return cast(R, call.answer)
                        continue
                    call = _Call(store, op, extra)
                    try:
                        async with conn.pipeline():
                            opened = [await conn.execute(q, a) for q, a in call.opening()]
                            for q, a in call.closing(await opened[1].fetchall()):
                                await conn.execute(q, a)
                            await conn.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(psycopg.Error):
                            await conn.execute("ROLLBACK")
                        raise
                return cast(R, call.answer)
            except Miss as miss:
                extra.append((miss.tag, miss.part))
            except _AGAIN:
                await asyncio.sleep(random.uniform(0, 0.002 * 2**attempt))
            except psycopg.OperationalError:
                if (call is not None and call.wrote) or not reconnects:
                    raise
                reconnects -= 1
                await (await store._apool()).check()
    raise StoreUnavailable(f"PostgreSQL: {type(op).__name__} kept meeting conflicts")


def run_joined(store: PostgresStore, joined: transactions.Transaction, op: Op[R]) -> R:
    """``op`` in the caller's open transaction: its rows are written there, and committed or
    rolled back with it. A database error is the caller's transaction's: it is raised as it
    is (that transaction is aborted either way)."""
    store._ready_pool()  # (the schema is made on a connection of the store's own)
    fast = one_statement(store, op, True)
    if fast is not None:
        return cast(R, _ours(joined, fast[2](joined.conn.execute(fast[0], fast[1]).fetchone())))
    extra: list[tuple[str, str]] = []
    while True:
        call = _Call(store, op, extra, joined=True)
        try:
            rows = joined.conn.execute(*call.opening()[0]).fetchall()
            for q, a in call.closing(rows):
                joined.conn.execute(q, a)
            return cast(R, _ours(joined, call.answer))
        except Miss as miss:
            extra.append((miss.tag, miss.part))


async def arun_joined(store: PostgresStore, joined: transactions.Transaction, op: Op[R]) -> R:
    """:func:`run_joined` on an asyncio connection."""
    if not store._checked:
        await asyncio.to_thread(store._ready_pool)
    fast = one_statement(store, op, True)
    if fast is not None:
        row = await (await joined.conn.execute(fast[0], fast[1])).fetchone()
        return cast(R, _ours(joined, fast[2](row)))
    extra: list[tuple[str, str]] = []
    while True:
        call = _Call(store, op, extra, joined=True)
        try:
            rows = await (await joined.conn.execute(*call.opening()[0])).fetchall()
            for q, a in call.closing(rows):
                await joined.conn.execute(q, a)
            return cast(R, _ours(joined, call.answer))
        except Miss as miss:
            extra.append((miss.tag, miss.part))


def _owned(op: Op[Any], answer: Any) -> Any:
    """A claim's reply names the owner the claim gave (the function does not echo it)."""
    if isinstance(answer, ClaimReply):
        return dataclasses.replace(answer, holder=cast(Claim, op).owner)
    return answer


def _ours(joined: transactions.Transaction, reply: Any) -> Any:
    """A lock this transaction took is unconfirmed until its commit publishes the job; to a
    duplicate in the same transaction it is no pending holder: its job is the answer."""
    if isinstance(reply, AcquireReply):
        if reply.acquired:
            joined.taken.add(reply.holder)
        elif reply.pending and reply.holder in joined.taken:
            return dataclasses.replace(reply, pending=False)
    return reply


@contextlib.contextmanager
def _rolled_back(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Roll back the transaction an operation left open (its statement failed, or the
    transition asked for a row it had not read), before the connection goes back."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def _answering() -> Iterator[None]:
    """Raise StoreUnavailable for a database that cannot answer now (G5); a bug raises as is."""
    try:
        yield
    except StoreUnavailable:
        raise  # (already said: not wrapped again)
    except _AGAIN:
        raise
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(f"PostgreSQL did not answer: {exc}") from exc
