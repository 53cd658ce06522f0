"""PostgresStore: the store protocol on PostgreSQL (psycopg 3, sync and asyncio, pooled).

Each operation is one transaction of two round trips, sent in psycopg's pipeline mode:

1. take the operation's keys' transaction-scoped advisory locks (sorted, so two transactions
   never wait on each other in a circle), read the database clock, then read the keys' rows;
2. write back what the shared transition changed, maybe purge a batch of expired rows, commit.

The database decides every race: a key's transactions queue on its advisory lock, and the
rows are written with ``INSERT … ON CONFLICT``. Nothing lives in the session (no ``SET``, no
session locks, no prepared statements unless ``prepare=True``), so the store works behind
PgBouncer in transaction pooling. The clock is the database's (``clock_timestamp()``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool

from .. import transactions
from ..errors import ConfigError
from .base import Op, R, Store
from .postgres_ops import (
    JOINS,
    PURGE_EVERY,
    _answering,
    arun_joined,
    arun_own,
    run_joined,
    run_own,
)
from .postgres_schema import Queries, functions, migration, qualifier
from .sql import SCHEMA_VERSION, tables


class PostgresStore(Store):
    """A store on a PostgreSQL database: ``conninfo`` is a libpq URL or DSN.

    ``key_prefix`` names the tables (``taskdedup_records``, ``taskdedup_schema``);
    ``migrate`` (default True) creates or upgrades them on first use, as ``taskdedup migrate``
    does (False: a missing or older schema is an error naming that command). ``pool_size``
    caps each process's connections; ``timeout`` (seconds) bounds the wait for a connection and
    each statement, after which the store counts as unavailable (G5). ``prepare=True`` lets
    psycopg prepare frequent statements on the server (not behind PgBouncer's transaction
    pooling before 1.21). ``history=False`` writes no decision history."""

    def __init__(
        self,
        conninfo: str,
        *,
        key_prefix: str = "taskdedup",
        history: bool = True,
        migrate: bool = True,
        pool_size: int = 10,
        timeout: float = 5.0,
        prepare: bool = False,
        synchronous_commit: str = "off",
        schema: str | None = None,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ConfigError(
                f"key_prefix must be non-empty and free of braces, not {key_prefix!r}"
            )
        self.conninfo, self.prefix, self.history = conninfo, key_prefix, history
        self.migrate_on_use, self.pool_size, self.timeout = migrate, pool_size, timeout
        self.timeout_ms = int(timeout * 1000)
        self.synchronous_commit = synchronous_commit
        self.connect_kwargs: dict[str, Any] = {
            # a peer that vanished (a partition, a dead host) is given up after ``timeout``;
            # a server that is up but never answers holds the call until it does (no deadline
            # of psycopg's own)
            "keepalives": 1,
            "keepalives_idle": max(1, int(timeout)),
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": self.timeout_ms,
            "prepare_threshold": 5 if prepare else None,
            "autocommit": True,  # each operation sends its own BEGIN and COMMIT (see _Call)
        }
        self.issued = 0  # the last fencing token given (see Records.next_fence)
        self.writes = 0
        self.table, self.version_table = tables(key_prefix)
        self.schema = schema  # (None: the connection's current schema, read on first use)
        self.where = ""  # the schema, quoted, as it starts every name: see _locate
        self._pools: dict[int, psycopg_pool.ConnectionPool[Any]] = {}
        self._apools: dict[int, psycopg_pool.AsyncConnectionPool[Any]] = {}
        self._checked = False
        self._checking = threading.RLock()
        self._where: tuple[Any, ...] | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        """``postgresql://user@host:5432/db?pool_size=10&timeout=5&migrate=1&prepare=0``: the
        store's own query options are taken out; the rest of the URL goes to libpq."""
        parts = urlsplit(url)
        ours: dict[str, Callable[[str], Any]] = {
            "pool_size": int,
            "timeout": float,
            "migrate": _flag,
            "prepare": _flag,
            "synchronous_commit": str,
            "schema": str,
        }
        libpq = []
        for name, value in parse_qsl(parts.query):
            if name in ours:
                options.setdefault(name, ours[name](value))
            else:
                libpq.append((name, value))
        scheme = "postgresql" if parts.scheme.startswith("postgres") else parts.scheme
        query = urlencode(libpq, quote_via=quote)  # (libpq reads %20, never +, as a space)
        return cls(urlunsplit(parts._replace(scheme=scheme, query=query)), **options)

    def purge_due(self) -> bool:
        self.writes += 1
        return self.writes % PURGE_EVERY == 0

    # -- connections: one pool per process (a forked worker makes its own), one per event loop

    def _pool(self) -> psycopg_pool.ConnectionPool[Any]:
        pool = self._pools.get(os.getpid())
        if pool is None:
            with self._checking:  # (threads racing to the first call make one pool)
                pool = self._pools.get(os.getpid()) or self._new_pool()
        if not self.where:  # (until it could be read: the database may be down at first)
            self._locate(pool)
        return pool

    def _new_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        self._pools.clear()  # the parent's, inherited through fork: not ours to close
        pool = psycopg_pool.ConnectionPool(
            self.conninfo,
            min_size=1,
            max_size=self.pool_size,
            kwargs=self.connect_kwargs,
            timeout=self.timeout,
            open=True,
        )
        self._pools[os.getpid()] = pool
        return pool

    def _locate(self, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        """Name our tables and functions with their schema (``schema``, else the one the
        store's connections create in), so any session finds them, whatever its path."""
        if self.schema is None:
            with pool.connection() as conn, _answering():
                row = conn.execute("SELECT current_schema()").fetchone()
            self.schema = str(row[0]) if row and row[0] else "public"
        self.where = qualifier(self.schema)
        self.class_id = zlib.crc32((self.where + self.table).encode()) - 2**31  # locks' space
        self.sql = Queries(self.prefix, self.where)

    def _ready_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        """The pool, once the schema was found current (or made so) in this process."""
        pool = self._pool()
        if not self._checked:
            with self._checking:
                if not self._checked:
                    self._ready(pool)
                    self._checked = True
        return pool

    async def _apool(self) -> psycopg_pool.AsyncConnectionPool[Any]:
        key = id(asyncio.get_running_loop()) ^ os.getpid()
        pool = self._apools.get(key)
        if pool is None:
            pool = psycopg_pool.AsyncConnectionPool(
                self.conninfo,
                min_size=1,
                max_size=self.pool_size,
                kwargs=self.connect_kwargs,
                timeout=self.timeout,
                open=False,
            )
            await pool.open()
            self._apools[key] = pool
        if not self._checked:
            await asyncio.to_thread(self._ready_pool)  # the schema check, once, off the loop
        return pool

    def _ready(self, pool: psycopg_pool.ConnectionPool[Any]) -> None:
        """The schema is there and current: made or upgraded (``migrate``), else an error."""
        found = self.schema_version(pool)
        if found == SCHEMA_VERSION:
            return
        if found > SCHEMA_VERSION:
            raise ConfigError(
                f"the taskdedup tables for key_prefix {self.prefix!r} are at schema version "
                f"{found}, newer than this taskdedup knows ({SCHEMA_VERSION}): upgrade "
                "taskdedup on this host"
            )
        if not self.migrate_on_use:
            raise ConfigError(
                f"the taskdedup tables for key_prefix {self.prefix!r} are at schema version "
                f"{found} (this taskdedup needs {SCHEMA_VERSION}): run `taskdedup migrate --url "
                "...`, or let the store do it (migrate=True)"
            )
        self.migrate(pool)

    def schema_version(self, pool: psycopg_pool.ConnectionPool[Any] | None = None) -> int:
        """The schema version of this prefix's tables (0: none)."""
        with (pool or self._pool()).connection() as conn, _answering():
            version = self.where + self.version_table
            found = conn.execute("SELECT to_regclass(%s)", (version,)).fetchone()
            if found is None or found[0] is None:
                return 0
            row = conn.execute(f"SELECT max(version) FROM {version}").fetchone()
            return int(row[0] or 0) if row else 0

    def migrate(self, pool: psycopg_pool.ConnectionPool[Any] | None = None) -> int:
        """Create or upgrade this prefix's tables (idempotent; concurrent callers wait for
        each other); answers the schema version now."""
        with (pool or self._pool()).connection() as conn, _answering(), conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (self.class_id,))
            assert self.schema is not None  # (located with the pool)
            for statement in migration(self.prefix, self.schema):
                conn.execute(statement)
        return SCHEMA_VERSION

    def purge(self, batch: int = 10_000) -> int:
        """Remove expired rows, ``batch`` at a time, until none is left; answers how many."""
        removed = 0
        while True:
            with self._pool().connection() as conn, _answering():
                cur = conn.execute(self.sql.purge, (batch,))
                conn.commit()
            removed += int(cur.rowcount)
            if cur.rowcount < batch:
                return removed

    def drop_tables(self) -> None:
        """Drop this prefix's tables (tests, and removing taskdedup)."""
        with self._pool().connection() as conn, _answering():
            tables_ = f"{self.where}{self.table}, {self.where}{self.version_table}"
            conn.execute(f"DROP TABLE IF EXISTS {tables_}")
            for function in functions(self.prefix, self.where):
                conn.execute(f"DROP FUNCTION IF EXISTS {function}")
            conn.commit()

    # -- the protocol

    def same_database(self, conn: Any) -> bool:
        """Whether psycopg connection ``conn`` is to this store's database (an enqueue in its
        open transaction then joins it: :mod:`taskdedup.transactions`)."""
        if self._where is None:
            with self._pool().connection() as mine:
                self._where = _where(mine)
        return _where(conn) == self._where

    def run(self, op: Op[R]) -> R:
        if type(op) in JOINS and (joined := transactions.current(self)) is not None:
            return run_joined(self, joined, op)
        return run_own(self, op)

    async def arun(self, op: Op[R]) -> R:
        if type(op) in JOINS and (joined := transactions.current(self)) is not None:
            if isinstance(joined.conn, psycopg.AsyncConnection):
                return await arun_joined(self, joined, op)
            return run_joined(self, joined, op)
        return await arun_own(self, op)

    def close(self) -> None:
        pool = self._pools.pop(os.getpid(), None)
        if pool is not None:
            pool.close()

    async def aclose(self) -> None:
        for key, pool in list(self._apools.items()):
            await pool.close()
            del self._apools[key]
        self.close()


#: The operations of an enqueue's decision: inside the caller's transaction, they join it.
def _where(conn: Any) -> tuple[Any, ...]:
    info = conn.info
    return (info.host, info.port, info.dbname)


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")
