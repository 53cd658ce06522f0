"""SqliteStore: the store protocol on a SQLite file (the standard library's sqlite3, WAL).

For one machine: a single-host deployment, a Celery prefork worker and its producers on one
box, a development setup. Processes share the file; each operation is one ``BEGIN IMMEDIATE``
transaction, so SQLite's write lock decides every race (``busy_timeout`` bounds the wait).
The clock is the host's (all the file's users are on it); tests pass a clock of their own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from ..errors import ConfigError, StoreUnavailable
from .base import Op, R, Store
from .record_store import TRANSITIONS
from .sql import PURGE_BATCH, SCHEMA_VERSION, Row, Rows, schema, tables, wanted

T = TypeVar("T")
#: One write transaction in this many also purges a batch of expired rows.
PURGE_EVERY = 64


class SqliteStore(Store):
    """A store in the SQLite file ``path`` (``:memory:``: one process's, for tests).

    ``key_prefix`` names the tables; ``timeout`` (seconds) bounds the wait for the file's write
    lock, after which the store counts as unavailable (G5); ``clock`` returns seconds (default
    ``time.time``); ``history=False`` writes no decision history."""

    def __init__(
        self,
        path: str,
        *,
        key_prefix: str = "taskdedup",
        history: bool = True,
        timeout: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ConfigError(
                f"key_prefix must be non-empty and free of braces, not {key_prefix!r}"
            )
        self.path, self.prefix, self.history = path, key_prefix, history
        self.timeout, self.clock = timeout, clock or time.time
        self.table, self.version_table = tables(key_prefix)
        self.issued = 0  # the last fencing token given (see Records.next_fence)
        self.writes = 0
        self._local = threading.local()
        self._shared: sqlite3.Connection | None = None  # ":memory:": one connection for all
        self._mutex = threading.RLock()
        self._checked = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SqliteStore:
        """``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite://``
        (or ``sqlite:///:memory:``): one process's database in memory."""
        path = url.split("://", 1)[1]
        path = path[1:] if path.startswith("/") else path
        return cls(path or ":memory:", **options)

    def _connection(self) -> sqlite3.Connection:
        if self.path == ":memory:":
            with self._mutex:
                if self._shared is None:
                    self._shared = self._connect()
            return self._shared
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():  # a forked worker opens its own
            conn = self._local.conn = self._connect()
            self._local.pid = os.getpid()
        return conn

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        if self.path != ":memory:":
            self._wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
        if not self._checked:
            self.migrate(conn)  # (idempotent: threads that race here both run it)
            self._checked = True
        return conn

    def _wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL (readers never wait for the writer). Processes opening a
        new file together may find it locked while another one switches: they try again."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def migrate(self, conn: sqlite3.Connection | None = None) -> int:
        """Create or upgrade this prefix's tables (idempotent); answers the schema version."""
        conn = conn or self._connection()
        with self._mutex, _answering():
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in schema(self.prefix, bigint="INTEGER"):
                    conn.execute(statement)
                found = conn.execute(f"SELECT max(version) FROM {self.version_table}").fetchone()
                if not found or (found[0] or 0) < SCHEMA_VERSION:
                    conn.execute(f"INSERT INTO {self.version_table} VALUES (?)", (SCHEMA_VERSION,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return SCHEMA_VERSION

    def schema_version(self) -> int:
        """The schema version of this prefix's tables (0: none)."""
        row = self._connection().execute(f"SELECT max(version) FROM {self.version_table}")
        return int(row.fetchone()[0] or 0)

    def _transact(self, work: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        with self._mutex if self.path == ":memory:" else contextlib.nullcontext(), _answering():
            conn.execute("BEGIN IMMEDIATE")
            try:
                answer = work(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return answer

    def run(self, op: Op[R]) -> R:
        t = self.table

        def load(conn: sqlite3.Connection) -> Callable[[str, str], Row | None]:
            sql = f"SELECT tag, part, body, expires_at FROM {t} WHERE tag = ? AND part = ?"
            return lambda tag, part: conn.execute(sql, (tag, part)).fetchone()

        def work(conn: sqlite3.Connection) -> Any:
            now_us = int(self.clock() * 1_000_000)
            records = Rows(self.prefix, now_us, (), load(conn))
            records.history, records.issued = self.history, self.issued
            if wanted(op) is None:  # the tools' scans read every row
                every = conn.execute(f"SELECT tag, part, body, expires_at FROM {t}").fetchall()
                records = Rows(self.prefix, now_us, every, load(conn), everything=True)
            answer = TRANSITIONS[type(op)](op, records)
            self.issued = records.issued
            writes, deletes = records.changes()
            conn.executemany(f"INSERT OR REPLACE INTO {t} VALUES (?, ?, ?, ?)", writes)
            conn.executemany(f"DELETE FROM {t} WHERE tag = ? AND part = ?", deletes)
            if writes or deletes:
                self.writes += 1
                if self.writes % PURGE_EVERY == 0:
                    self._purge(conn, now_us // 1000, PURGE_BATCH)
            return answer

        return cast(R, self._transact(work))

    async def arun(self, op: Op[R]) -> R:
        return self.run(op)  # a local file: no network to wait on

    def _purge(self, conn: sqlite3.Connection, now_ms: int, batch: int) -> int:
        t = self.table
        cur = conn.execute(
            f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE expires_at <= ? LIMIT ?)",
            (now_ms, batch),
        )
        return cur.rowcount

    def purge(self, batch: int = 10_000) -> int:
        """Remove expired rows, ``batch`` at a time, until none is left; answers how many."""
        removed = 0
        while True:
            step = functools.partial(self._purge, now_ms=int(self.clock() * 1000), batch=batch)
            count = self._transact(step)
            removed += count
            if count < batch:
                return removed

    def ttls(self) -> dict[str, int]:
        """Every live record's name and remaining life in ms (tests check G9 with it)."""
        now = int(self.clock() * 1000)
        rows = self._connection().execute(
            f"SELECT tag, part, expires_at FROM {self.table} WHERE expires_at > ?", (now,)
        )
        return {f"{self.prefix}:{{{tag}}}:{part}": exp - now for tag, part, exp in rows}

    def close(self) -> None:
        conn = getattr(self._local, "conn", None) or self._shared
        if conn is not None:
            conn.close()
        self._local, self._shared = threading.local(), None


@contextlib.contextmanager
def _answering() -> Iterator[None]:
    """Raise StoreUnavailable for a file that stays locked or cannot be written (G5)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        raise StoreUnavailable(f"SQLite did not answer: {exc}") from exc
