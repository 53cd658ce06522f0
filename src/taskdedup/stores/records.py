"""The record seam: what a store must provide to run every operation on the lock diagram.

A record is a small dict of fields under a name, with an expiry (the store's own clock, in
milliseconds). ``Records`` is one atomic transaction's view of a store's records: a store gives
four primitives (read an entry, write one, drop one, list the names) and the clock; the helpers
here and the transitions in ``transitions.py`` and ``slots.py`` do the rest, so a new store on
this seam is those primitives and a way to run a transaction (see ``MemoryStore``). A store
with a faster native form of some operations (Redis runs each one as a Lua script) implements
``Store.run`` itself, and the contract suite holds both to the same answers.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

Fields = dict[str, Any]


class Records(abc.ABC):
    """One transaction's view of a store's records: ``now`` is the store's clock (ms) when
    the transaction began; ``prefix`` starts every record name."""

    #: Whether the key's decision history is written (the ``history`` setting).
    history = True

    def __init__(self, prefix: str, now_ms: int, now_us: int) -> None:
        self.prefix = prefix
        self.now = now_ms
        self.now_us = now_us  # seeds fencing tokens, which must keep increasing
        #: The last fencing token the store gave (kept by the store between transactions).
        self.issued = 0

    # -- the primitives a store provides

    @abc.abstractmethod
    def entry(self, name: str) -> tuple[Fields, int] | None:
        """The record's fields (mutable: changes are kept) and its expiry, expired or not."""

    @abc.abstractmethod
    def write(self, name: str, fields: Fields, expires: int) -> None:
        """Create or replace a record with ``fields``, living until ``expires`` (ms)."""

    @abc.abstractmethod
    def drop(self, name: str) -> None:
        """Remove a record, if present."""

    @abc.abstractmethod
    def all_names(self) -> Iterable[str]:
        """Every record's name, live or expired (for scans)."""

    # -- helpers the transitions use

    def next_fence(self, last: int | None) -> int:
        """A new fencing token: the clock in microseconds, past ``last`` (the key's live lock's
        token, if any) and past every token this store gave before (a clock that stands still,
        as a test's does, still gives rising tokens). No record is kept per key, as on Redis."""
        fence = max(self.now_us, (last or 0) + 1, self.issued + 1)
        self.issued = fence
        return fence

    def name(self, key: str, part: str) -> str:
        """The name of record ``part`` of dedup key ``key`` (Redis Cluster hash tag kept)."""
        return f"{self.prefix}:{{{key}}}:{part}"

    def get(self, name: str) -> Fields | None:
        """A live record's fields; an expired one reads as absent (see :meth:`expired`)."""
        found = self.entry(name)
        if found is None:
            return None
        if found[1] <= self.now:
            self.expired(name)
            return None
        return found[0]

    def expired(self, name: str) -> None:
        """What reading an expired record does: drop it. A store that purges expired records
        on its own (the SQL stores) forgets it instead, so that a read stays a read."""
        self.drop(name)

    def put(self, name: str, fields: Fields, expires: int) -> None:
        self.write(name, fields, expires)

    def expire(self, name: str, at: int) -> None:
        found = self.entry(name)
        if found is not None:
            self.write(name, found[0], at)

    def delete(self, name: str) -> None:
        self.drop(name)

    def ttl(self, name: str) -> int:
        """Milliseconds a live record has left."""
        found = self.entry(name)
        return 0 if found is None else found[1] - self.now

    def names(self) -> list[str]:
        return list(self.all_names())
