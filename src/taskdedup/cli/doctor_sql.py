"""``taskdedup doctor`` on the SQL stores: the schema's version, the database's clock, and how
the store connects (prepared statements and PgBouncer, connections per process)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from ..stores.sql import SCHEMA_VERSION

#: (level, check, message), as doctor's Finding takes them
Finding = tuple[str, str, str]
CLOCK_SKEW = 2.0  # seconds (as doctor's)


def sql_findings(store: Any) -> Iterator[Finding]:
    """The checks of a PostgresStore or SqliteStore (nothing for other stores)."""
    from ..stores.postgres import PostgresStore
    from ..stores.sqlite import SqliteStore

    if not isinstance(store, (PostgresStore, SqliteStore)):
        return
    found = store.schema_version()
    if found < SCHEMA_VERSION:
        yield (
            "error",
            "schema",
            f"the tables of key_prefix {store.prefix!r} are at schema version {found}, this "
            f"taskdedup needs {SCHEMA_VERSION}: run `taskdedup migrate --url ...`",
        )
    elif found > SCHEMA_VERSION:
        yield (
            "error",
            "schema",
            f"the tables are at schema version {found}, newer than this taskdedup knows "
            f"({SCHEMA_VERSION}): upgrade taskdedup on this host",
        )
    else:
        yield ("ok", "schema", f"{store.table} at schema version {found}")
    if isinstance(store, PostgresStore):
        yield from _postgres(store)


def _postgres(store: Any) -> Iterator[Finding]:
    with store._pool().connection() as conn:
        now, limit = conn.execute(
            "SELECT extract(epoch FROM clock_timestamp()), current_setting('max_connections')::int"
        ).fetchone()
    skew = time.time() - float(now)
    level = "warning" if abs(skew) > CLOCK_SKEW else "ok"
    yield (level, "clock", f"this host is {skew:+.3f} s from the database's clock")
    if store.connect_kwargs["prepare_threshold"] is None:
        yield (
            "ok",
            "pooling",
            "no prepared statements and no session state: safe behind PgBouncer in "
            f"transaction pooling; at most {store.pool_size} connection(s) per process "
            f"(the server allows {limit})",
        )
    else:
        yield (
            "warning",
            "pooling",
            "prepare=True: behind PgBouncer in transaction pooling this needs PgBouncer 1.21 "
            "or newer with max_prepared_statements set; otherwise drop prepare",
        )
