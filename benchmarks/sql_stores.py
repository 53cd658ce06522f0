"""The SQL stores measured beside the Redis store: PostgreSQL and SQLite.

One run gets one :class:`SqlStores`: the PostgreSQL database of ``POSTGRES_URL`` (else
``127.0.0.1:5432/test`` as user ``postgres``) when it answers and psycopg is installed, and one
SQLite file in a temporary directory. Each library of a run keeps its tables under its own key
prefix (``<prefix>_records`` ...), dropped by :meth:`SqlStores.drop`; the SQLite file goes with
its directory at the end of the run. A store that cannot be measured is left out, and said so,
as a layout whose broker does not answer is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from typing import Any

from taskdedup.stores import Store
from taskdedup.stores.sql import tables
from taskdedup.stores.sqlite import SqliteStore

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
POSTGRESQL, SQLITE = "PostgreSQL", "SQLite"


class SqlStores:
    """Where this run's SQL stores live: :meth:`url` gives a store URL by kind, :attr:`kinds`
    the kinds that can be measured here (PostgreSQL only when a server answers)."""

    def __init__(self, directory: str, postgres: str | None) -> None:
        self.directory, self.postgres = directory, postgres
        self.sqlite = "sqlite:///" + os.path.join(directory, "taskdedup-bench.db")
        self.kinds = [kind for kind in (POSTGRESQL, SQLITE) if kind != POSTGRESQL or postgres]

    def url(self, kind: str) -> str:
        if kind == POSTGRESQL:
            assert self.postgres is not None
            return self.postgres
        return self.sqlite

    def drop(self, store: Store) -> None:
        """Drop the tables of ``store``'s key prefix, then close it (its pool or connections)."""
        if isinstance(store, SqliteStore):  # its file goes with the directory, its tables now
            conn = sqlite3.connect(store.path)
            for table in tables(store.prefix):
                conn.execute(f"DROP TABLE IF EXISTS {table}")
            conn.close()
        else:  # PostgreSQL: the tables and the functions of the prefix
            store.drop_tables()  # type: ignore[attr-defined]
        store.close()


def postgres_url() -> str | None:
    """``POSTGRES_URL`` (or the loopback default) if psycopg is installed and it answers."""
    try:
        import psycopg
    except ImportError:
        print("(skipped: PostgreSQL store: psycopg is not installed)")
        return None
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        print(f"(skipped: PostgreSQL store: no database at {POSTGRES_URL}: {exc})")
        return None
    return POSTGRES_URL


def postgres_version(url: str | None) -> str | None:
    """The server's version (``15.4``), None without a server."""
    if url is None:
        return None
    import psycopg

    with psycopg.connect(url, connect_timeout=2) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]).split()[0] if row else None


@contextlib.contextmanager
def sql_stores() -> Iterator[SqlStores]:
    """This run's SQL stores; the SQLite file's directory is removed afterwards."""
    directory = tempfile.mkdtemp(prefix="tdbench-sqlite-")
    try:
        yield SqlStores(directory, postgres_url())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def bare_write(kind: str, url: str, prefix: str) -> tuple[Any, str, str]:
    """A one-statement write on the store's database, the SQL stores' baseline row (as a
    bare ``SET NX PX`` is the Redis store's): an ``INSERT`` that does nothing on a conflict,
    autocommitted on one connection, with the store's own durability (PostgreSQL:
    ``synchronous_commit=off``; SQLite: WAL, ``synchronous=NORMAL``). Answers the
    connection, the statement (one parameter: the key) and the table to drop afterwards."""
    table = tables(prefix)[0].removesuffix("_records") + "_bare"
    create = f"CREATE TABLE IF NOT EXISTS {table} (k TEXT PRIMARY KEY)"
    if kind == POSTGRESQL:
        import psycopg

        conn: Any = psycopg.connect(url, autocommit=True)
        conn.execute("SET synchronous_commit = off")
        conn.execute(create)
        return conn, f"INSERT INTO {table} VALUES (%s) ON CONFLICT DO NOTHING", table
    conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(create)
    return conn, f"INSERT OR IGNORE INTO {table} VALUES (?)", table
