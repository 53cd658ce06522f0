"""Latency of the core decisions on Redis, beside a bare ``SET NX PX`` on the same connection.

Each row is one client making one call at a time, so p50 is one round trip plus our work.
"""

from __future__ import annotations

import uuid

import redis

from benchmarks.common import Row, measure
from taskdedup import Deduplicator, Policy, RedisStore, Settings


def generate(customer_id: int, month: str = "2026-11") -> None: ...


def run(url: str, n: int = 3000) -> list[Row]:
    prefix = "tdbench-" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(url)
    dedup = Deduplicator(RedisStore(client, prefix=prefix), Settings(key_prefix=prefix))
    policy = Policy("until_executed").bind("bench.generate", generate)
    tickets: dict[int, str] = {}
    group = "core (Redis)"
    try:
        rows = [
            measure(
                group,
                "bare SET NX PX (baseline)",
                n,
                lambda i: client.set(f"{prefix}:bare:{i}", "1", nx=True, px=60_000),
            ),
            measure(
                group,
                "enqueue, new key (acquire)",
                n,
                lambda i: _enqueue(dedup, policy, i, tickets),
            ),
            measure(group, "enqueue, duplicate", n, lambda i: dedup.enqueue(policy, (0,))),
            measure(
                group,
                "claim",
                n,
                lambda i: dedup.claim(policy, f"job-{i}", key=tickets[i]),
            ),
            measure(
                group,
                "finish",
                n,
                lambda i: dedup.finish(policy, tickets[i], f"job-{i}"),
            ),
        ]
    finally:
        for key in client.scan_iter(match=prefix + ":*", count=1000):
            client.unlink(key)
        client.close()
    return rows


def _enqueue(dedup: Deduplicator, policy: object, i: int, tickets: dict[int, str]) -> None:
    ticket = dedup.enqueue(policy, (i,), job_id=f"job-{i}")  # type: ignore[arg-type]
    assert ticket.key is not None
    dedup.published(ticket)  # as a caller does once the job is in the broker (G11)
    tickets[i] = ticket.key
