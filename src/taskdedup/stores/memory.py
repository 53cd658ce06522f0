"""MemoryStore: the store protocol in one process, for tests and single-process apps.

A :class:`RecordStore` over a dict: every record kept with an expiry, and an injectable clock
so tests can move time by hand. One lock guards all records; no operation awaits while
holding it, so it is safe from threads and from asyncio alike.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

from .record_store import RecordStore
from .records import Fields, Records

Clock = Callable[[], float]  # seconds
T = TypeVar("T")


class _DictRecords(Records):
    def __init__(self, data: dict[str, tuple[Fields, int]], prefix: str, clock: Clock) -> None:
        now = clock()
        super().__init__(prefix, int(now * 1000), int(now * 1_000_000))
        self.data = data

    def entry(self, name: str) -> tuple[Fields, int] | None:
        return self.data.get(name)

    def write(self, name: str, fields: Fields, expires: int) -> None:
        self.data[name] = (fields, expires)

    def drop(self, name: str) -> None:
        self.data.pop(name, None)

    def all_names(self) -> Iterable[str]:
        return list(self.data)


class MemoryStore(RecordStore):
    """An in-process store; ``key_prefix`` starts every record's name (``prefix=`` is its
    deprecated spelling), ``clock`` returns seconds (default: ``time.time``), ``history``
    False writes no decision history (the ``history`` setting)."""

    def __init__(
        self,
        key_prefix: str = "taskdedup",
        clock: Clock | None = None,
        *,
        history: bool = True,
        prefix: str | None = None,
    ) -> None:
        if prefix is not None:
            warnings.warn(
                "MemoryStore(prefix=...) is deprecated: use key_prefix=, as in the key_prefix "
                "setting",
                DeprecationWarning,
                stacklevel=2,
            )
            key_prefix = prefix
        self.prefix = key_prefix
        self.history = history
        self.clock = clock or time.time
        self._records: dict[str, tuple[Fields, int]] = {}  # name -> (fields, expires ms)
        self._mutex = threading.Lock()

    def transact(self, work: Callable[[Records], T]) -> T:
        with self._mutex:
            return work(_DictRecords(self._records, self.prefix, self.clock))

    def clear(self) -> None:
        """Forget every record (a test that keeps one store between tests starts empty)."""
        with self._mutex:
            self._records.clear()

    def ttl_ms(self, name: str) -> int | None:
        """Remaining life of a raw record (tests use it to check G9); None if absent."""
        return self.transact(lambda r: None if r.get(name) is None else r.ttl(name))

    def names(self) -> list[str]:
        """Names of all live records."""
        return self.transact(lambda r: [n for n in r.names() if r.get(n) is not None])
