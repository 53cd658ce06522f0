"""Latency of the core decisions on each store, beside a bare write on the same database.

The Redis store is timed beside a bare ``SET NX PX`` on the same connection; the PostgreSQL and
SQLite stores (when they can be measured, see ``sql_stores.py``) beside a bare ``INSERT`` that
does nothing on a conflict, autocommitted on a connection of their own with the store's
durability settings. Each row is one client making one call at a time, so p50 is one round
trip (or, for SQLite, one local transaction) plus our work. The stores take turns over
``rounds``, each round timing every operation of one store in a row, so machine noise falls on
all of them alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from benchmarks.common import Row, measure
from benchmarks.sql_stores import POSTGRESQL, SQLITE, SqlStores, bare_write
from taskdedup import Deduplicator, Policy, RedisStore, Settings
from taskdedup.policy import TaskPolicy
from taskdedup.stores import from_url

#: The argument every "duplicate" call repeats: its job was enqueued and published first.
DUPLICATE = 0
#: Where the first round's indices start: the warm-up calls of a round take the 50 indices
#: below its start, so every index stays positive and apart from DUPLICATE.
FIRST = 100
#: The baseline row of each SQL store (see ``sql_stores.bare_write``).
BASELINES = {
    POSTGRESQL: "bare INSERT ON CONFLICT (baseline)",
    SQLITE: "bare INSERT OR IGNORE (baseline)",
}


def generate(customer_id: int, month: str = "2026-11") -> None: ...


@dataclass
class Subject:
    """One store's rows: each operation's name and step (called with a fresh index), and the
    cleanup that removes what the steps left."""

    group: str
    steps: list[tuple[str, Callable[[int], object]]]
    cleanups: list[Callable[[], object]] = field(default_factory=list)

    def clean(self) -> None:
        for cleanup in self.cleanups:
            cleanup()


def run(url: str, sql: SqlStores | None = None, n: int = 3000, rounds: int = 10) -> list[Row]:
    """Rows for the Redis store, then each SQL store of ``sql``; ``n`` calls per row, in
    ``rounds`` turns of ``n // rounds`` calls."""
    subjects: list[Subject] = []
    samples: dict[tuple[str, str], list[int]] = {}
    per_round = max(1, n // rounds)
    counter = FIRST
    try:
        subjects.append(_redis(url))
        for kind in sql.kinds if sql else []:
            assert sql is not None
            subjects.append(_sql(kind, sql))
        for _ in range(rounds):
            for subject in subjects:
                start = counter
                counter += per_round + FIRST
                for name, step in subject.steps:
                    row = measure(subject.group, name, per_round, _from(start, step))
                    samples.setdefault((subject.group, name), []).extend(row.samples_ns)
    finally:
        for subject in subjects:
            subject.clean()
    return [Row(group, name, values) for (group, name), values in samples.items()]


def _from(start: int, step: Callable[[int], object]) -> Callable[[int], object]:
    """``step`` on indices from ``start`` (the warm-up's negative ones fall just below it)."""
    return lambda i: step(start + i)


def _redis(url: str) -> Subject:
    prefix = "tdbench-" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(url)
    dedup = Deduplicator(RedisStore(client, prefix=prefix), Settings(key_prefix=prefix))

    def clean() -> None:
        dedup.close()
        for key in client.scan_iter(match=prefix + ":*", count=1000):
            client.unlink(key)
        client.close()

    bare = ("bare SET NX PX (baseline)", lambda i: _set_nx(client, prefix, i))
    subject = Subject("core (Redis)", [bare], [clean])
    subject.steps += _decisions(dedup)
    return subject


def _set_nx(client: redis.Redis, prefix: str, i: int) -> object:
    return client.set(f"{prefix}:bare:{i}", "1", nx=True, px=60_000)


def _sql(kind: str, sql: SqlStores) -> Subject:
    prefix = "tdbench-" + uuid.uuid4().hex[:8]
    store = from_url(sql.url(kind), key_prefix=prefix)
    dedup = Deduplicator(store, Settings(key_prefix=prefix))
    subject = Subject(f"core ({kind})", [], [dedup.close, lambda: sql.drop(store)])
    conn, statement, table = bare_write(kind, sql.url(kind), prefix)

    def drop_bare() -> None:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.close()

    subject.cleanups.append(drop_bare)
    subject.steps.append((BASELINES[kind], lambda i: conn.execute(statement, (str(i),))))
    subject.steps += _decisions(dedup)
    return subject


def _decisions(dedup: Deduplicator) -> list[tuple[str, Callable[[int], object]]]:
    """Enqueue a new key, a duplicate, claim and finish: the calls a job's life makes, with
    the job of index ``i`` enqueued (and published) by the first step, claimed by the third and
    finished by the fourth."""
    policy = Policy("until_executed").bind("bench.generate", generate)
    holder = dedup.enqueue(policy, (DUPLICATE,), job_id="job-duplicated")
    dedup.published(holder)  # every "duplicate" call finds this job queued
    tickets: dict[int, str] = {}
    return [
        ("enqueue, new key (acquire)", lambda i: _enqueue(dedup, policy, i, tickets)),
        ("enqueue, duplicate", lambda i: dedup.enqueue(policy, (DUPLICATE,))),
        ("claim", lambda i: dedup.claim(policy, f"job-{i}", key=tickets[i])),
        ("finish", lambda i: dedup.finish(policy, tickets[i], f"job-{i}")),
    ]


def _enqueue(dedup: Deduplicator, policy: TaskPolicy, i: int, tickets: dict[int, str]) -> None:
    ticket = dedup.enqueue(policy, (i,), job_id=f"job-{i}")
    assert ticket.key is not None
    dedup.published(ticket)  # as a caller does once the job is in the broker (G11)
    tickets[i] = ticket.key
