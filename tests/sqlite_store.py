"""A third store, written the way a user would write one: SQLite on the record seam.

About seventy lines: a table of records (name, fields as JSON, expiry in ms) and a transaction per
operation. Every transition of the lock diagram comes from taskdedup's shared transitions;
the whole store contract suite runs on it (the ``h`` fixture's "sqlite" harness).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from taskdedup.stores.record_store import RecordStore
from taskdedup.stores.records import Fields, Records

T = TypeVar("T")


class _Rows(Records):
    def __init__(self, db: sqlite3.Connection, prefix: str, now: float) -> None:
        super().__init__(prefix, int(now * 1000), int(now * 1_000_000))
        self.db, self.cache = db, {}  # type: dict[str, tuple[Fields, int]]

    def entry(self, name: str) -> tuple[Fields, int] | None:
        if name not in self.cache:
            row = self.db.execute("SELECT body, exp FROM rec WHERE name = ?", (name,)).fetchone()
            if row is None:
                return None
            self.cache[name] = (json.loads(row[0]), row[1])
        return self.cache[name]

    def write(self, name: str, fields: Fields, expires: int) -> None:
        self.cache[name] = (fields, expires)

    def drop(self, name: str) -> None:
        self.cache.pop(name, None)
        self.db.execute("DELETE FROM rec WHERE name = ?", (name,))

    def all_names(self) -> Iterable[str]:
        return [row[0] for row in self.db.execute("SELECT name FROM rec")] + list(self.cache)

    def save(self) -> None:
        for name, (fields, exp) in self.cache.items():
            body = json.dumps(fields)
            self.db.execute("INSERT OR REPLACE INTO rec VALUES (?, ?, ?)", (name, body, exp))


class SqliteStore(RecordStore):
    def __init__(self, key_prefix: str, clock: Callable[[], float] = time.time) -> None:
        self.prefix, self.clock = key_prefix, clock
        self.db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE rec (name TEXT PRIMARY KEY, body TEXT, exp INTEGER)")
        self.mutex = threading.Lock()

    def transact(self, work: Callable[[Records], T]) -> T:
        with self.mutex:
            self.db.execute("BEGIN IMMEDIATE")
            rows = _Rows(self.db, self.prefix, self.clock())
            try:
                answer = work(rows)
                rows.save()
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return answer

    def ttls(self) -> dict[str, Any]:
        now = int(self.clock() * 1000)
        rows = self.db.execute("SELECT name, exp FROM rec WHERE exp > ?", (now,))
        return {name: exp - now for name, exp in rows}
