"""What the SQL stores share: the table, its migrations, and a transaction's view of its rows.

A record ``<prefix>:{<key>}:<part>`` is a row ``(tag=<key>, part=<part>, body, expires_at)``:
``body`` is the record's fields as JSON, ``expires_at`` the database clock's milliseconds. A
transaction reads the rows it needs first (:func:`wanted` says which, from the operation), runs
the shared transition on them (``transitions.py``, ``slots.py``) and writes back only the rows
it changed. Expired rows read as absent at once; a bounded purge removes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from .base import (
    Claim,
    Confirm,
    Consume,
    Finish,
    Heartbeat,
    JobState,
    ListScopes,
    ListSlots,
    MarkTick,
    Op,
    Pace,
    Release,
    Reserve,
    ReserveAll,
    Retry,
    Scan,
    UnmarkTick,
    Unreserve,
    scope_key,
)
from .records import Fields, Records

#: The schema version this code writes and reads; ``taskdedup migrate`` brings a database to it.
#: Bump it whenever a table or a PostgreSQL function changes. 2: the one-statement claim and
#: finish answer the rows they read when they fall back (``<prefix>_seen``, ``_save_if``).
SCHEMA_VERSION = 2

#: How many expired rows one purge step removes (a step rides along with normal writes).
PURGE_BATCH = 200

Row = tuple[str, str, str, int]  # tag, part, body (JSON), expires_at (ms)


def tables(key_prefix: str) -> tuple[str, str]:
    """The records table and the schema-version table of ``key_prefix``: the prefix, lower
    case, with anything but letters, digits and ``_`` made ``_`` (``taskdedup_records``)."""
    base = re.sub(r"[^a-z0-9_]", "_", key_prefix.lower())
    if not base or base[0].isdigit():
        base = "t_" + base
    return base + "_records", base + "_schema"


def schema(key_prefix: str, bigint: str = "BIGINT", where: str = "") -> list[str]:
    """The statements of schema version 1, each safe to run again; ``where`` qualifies the
    tables (``"public".``), for a database whose sessions may have other search paths."""
    records, version = tables(key_prefix)
    return [
        f"CREATE TABLE IF NOT EXISTS {where}{records} (tag TEXT NOT NULL, part TEXT NOT NULL, "
        f"body TEXT NOT NULL, expires_at {bigint} NOT NULL, PRIMARY KEY (tag, part))",
        f"CREATE INDEX IF NOT EXISTS {records}_expires ON {where}{records} (expires_at)",
        f"CREATE TABLE IF NOT EXISTS {where}{version} (version INTEGER NOT NULL)",
    ]


def split(prefix: str, name: str) -> tuple[str, str]:
    """A record's name as (tag, part): ``<prefix>:{<tag>}:<part>``."""
    tag, _, part = name[len(prefix) + 2 :].rpartition("}:")
    return tag, part


class Miss(Exception):
    """A transition read a row its transaction did not load (nor lock): load it and rerun."""

    def __init__(self, tag: str, part: str) -> None:
        super().__init__(tag, part)
        self.tag, self.part = tag, part


class Rows(Records):
    """One transaction's rows. ``loaded`` holds what the transaction read (None: no such row);
    a name outside it goes to ``load`` (which may raise :class:`Miss`). :meth:`changes` gives
    the rows to write and to delete."""

    def __init__(
        self,
        prefix: str,
        now_us: int,
        rows: Iterable[Row],
        load: Callable[[str, str], Row | None],
        everything: bool = False,
    ) -> None:
        super().__init__(prefix, now_us // 1000, now_us)
        self.load, self.everything = load, everything
        self.cache: dict[tuple[str, str], tuple[Fields, int] | None] = {}
        self.read: dict[tuple[str, str], tuple[str, int]] = {}
        for row in rows:
            self._keep(row)

    def _keep(self, row: Row) -> None:
        tag, part, body, expires = row
        self.cache[tag, part] = (json.loads(body), expires)
        self.read[tag, part] = (body, expires)

    def entry(self, name: str) -> tuple[Fields, int] | None:
        at = split(self.prefix, name)
        if at not in self.cache:
            row = None if self.everything else self.load(*at)
            if row is None:
                self.cache[at] = None
            else:
                self._keep(row)
        return self.cache[at]

    def expired(self, name: str) -> None:
        """An expired row reads as absent and is left to the purge (no delete for it)."""
        at = split(self.prefix, name)
        self.cache[at] = None
        self.read.pop(at, None)

    def write(self, name: str, fields: Fields, expires: int) -> None:
        self.cache[split(self.prefix, name)] = (fields, expires)

    def drop(self, name: str) -> None:
        self.cache[split(self.prefix, name)] = None

    def all_names(self) -> Iterable[str]:
        return [f"{self.prefix}:{{{t}}}:{p}" for (t, p), v in self.cache.items() if v]

    def changes(self) -> tuple[list[Row], list[tuple[str, str]]]:
        """The rows to write (changed or new) and the rows to delete (they were read)."""
        writes: list[Row] = []
        deletes: list[tuple[str, str]] = []
        for at, value in self.cache.items():
            before = self.read.get(at)
            if value is None:
                if before is not None:
                    deletes.append(at)
                continue
            body = json.dumps(value[0], separators=(",", ":"))
            if before != (body, value[1]):
                writes.append((*at, body, value[1]))
        return writes, deletes


def wanted(op: Op[Any]) -> tuple[list[str], list[tuple[str, str]]] | None:
    """The dedup keys whose rows ``op`` reads (all but their jobs' rows, and the lock holder's
    job row), and the job rows it reads besides; None: it reads every row (the tools' scans)."""
    if isinstance(op, (Scan, ListScopes)):
        return None
    if isinstance(op, Heartbeat):
        tags, jobs = [], []
        for lease in op.leases:
            tags.append(scope_key(lease.key) if lease.slot else lease.key)
            if not lease.slot:
                jobs.append((lease.key, "job:" + lease.job_id))
        return tags, jobs
    if isinstance(op, Confirm):
        return [k for k, _ in op.items], [(k, "job:" + j) for k, j in op.items]
    if isinstance(op, (Reserve, Consume, Unreserve, ListSlots)):
        return [scope_key(op.scope)], []
    if isinstance(op, ReserveAll):
        return [scope_key(scope) for scope, _ in op.parts], []
    if isinstance(op, Pace):
        return [scope_key(op.scope, "pace")], []
    if isinstance(op, (MarkTick, UnmarkTick)):
        return [scope_key(op.entry, "tick")], []
    key: str = op.key  # type: ignore[attr-defined]  # every other operation names one key
    if isinstance(op, (Claim, Finish, Retry, Release, JobState)):
        return [key], [(key, "job:" + op.job_id)]
    return [key], []
