"""Test helpers: polling with a deadline, and the store harnesses (the package's, plus a small
SQLite store written on the record seam, as a user would write one)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from taskdedup.testing.clock import FakeClock
from taskdedup.testing.harness import (
    Harness,
    MemoryHarness,
    PostgresHarness,
    RedisHarness,
    SqliteHarness,
    race,
)

__all__ = [
    "Harness",
    "MemoryHarness",
    "PostgresHarness",
    "RedisHarness",
    "SeamHarness",
    "SqliteHarness",
    "race",
    "wait_for",
]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 15.0,
    what: str = "the condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), or fail at the deadline.

    Exceptions of the ``ignore`` types count as "not yet" (a server still starting, say).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignore:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class SeamHarness(MemoryHarness):
    """The contract on a store written on the record seam by a user (tests/sqlite_store.py)."""

    name = "seam"

    def __init__(self, prefix: str) -> None:
        from sqlite_store import SqliteStore

        self.clock = FakeClock()
        self.store = self.sqlite = SqliteStore(prefix, clock=self.clock)

    def record_ttls(self) -> dict[str, int | None]:
        return dict(self.sqlite.ttls())
