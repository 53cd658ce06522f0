"""``kiq()`` on a taskiq-redis ListQueueBroker: plain taskiq, taskdedup, taskiq-deduplication.

Each library deduplicates one task; every row makes ``n`` sequential kicks from one client, with
unique arguments (every kick publishes) and with one repeated argument (every kick but the first
is a duplicate). Each library gets its own queue and key prefix, removed afterwards. The kicks
run on one event loop; the libraries are interleaved over ``rounds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from taskiq_redis import ListQueueBroker

from benchmarks.common import Row
from taskdedup.taskiq import DedupMiddleware

GROUP = "taskiq kiq() (ListQueueBroker)"
Kick = Callable[[int], Awaitable[Any]]


def plain(url: str, prefix: str) -> tuple[ListQueueBroker, Kick]:
    broker = ListQueueBroker(url, queue_name=f"{prefix}-q")

    @broker.task
    async def work(x: int) -> None: ...

    return broker, work.kiq


def taskdedup(url: str, prefix: str) -> tuple[ListQueueBroker, Kick]:
    broker = ListQueueBroker(url, queue_name=f"{prefix}-q").with_middlewares(
        DedupMiddleware(url, key_prefix=prefix)
    )

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def work(x: int) -> None: ...

    return broker, work.kiq


def taskiq_deduplication(url: str, prefix: str) -> tuple[ListQueueBroker, Kick]:
    from taskiq_deduplication import DuplicateTaskError, RedisDeduplicationMiddleware

    broker = ListQueueBroker(url, queue_name=f"{prefix}-q").with_middlewares(
        RedisDeduplicationMiddleware(url, key_prefix=f"{prefix}:dedup", default_ttl=3600)
    )

    @broker.task
    async def work(x: int) -> None: ...

    async def kick(x: int) -> Any:
        try:
            return await work.kiq(x)
        except DuplicateTaskError:
            return None

    return broker, kick


LIBRARIES: dict[str, Callable[[str, str], tuple[ListQueueBroker, Kick]]] = {
    "plain taskiq": plain,
    "taskdedup": taskdedup,
    "taskiq-deduplication": taskiq_deduplication,
}


async def _measure(n: int, kick: Kick, arg: Callable[[int], int]) -> list[int]:
    for i in range(min(50, n)):  # warm-up
        await kick(arg(-1 - i))
    samples = []
    clock = time.perf_counter_ns
    for i in range(n):
        start = clock()
        await kick(arg(i))
        samples.append(clock() - start)
    return samples


async def _run(url: str, n: int, rounds: int, prefixes: dict[str, str]) -> list[Row]:
    made = {name: make(url, prefixes[name]) for name, make in LIBRARIES.items()}
    for broker, _ in made.values():
        await broker.startup()
    try:
        samples: dict[str, list[int]] = {}
        counter = 0
        for _ in range(rounds):
            for name, (_, kick) in made.items():
                for label, repeated in (("unique args", False), ("repeated args", True)):
                    start = counter
                    counter += n // rounds + 100
                    values = await _measure(
                        n // rounds, kick, lambda i, s=start, r=repeated: -7 if r else s + i
                    )
                    samples.setdefault(f"{name}, {label}", []).extend(values)
        return [Row(GROUP, name, values) for name, values in samples.items()]
    finally:
        for broker, _ in made.values():
            await broker.shutdown()


def run(url: str, n: int = 4000, rounds: int = 20) -> list[Row]:
    """Interleave the libraries over ``rounds`` so machine noise falls on all of them alike."""
    logging.getLogger("taskiq_deduplication").setLevel(logging.ERROR)  # a warning per duplicate
    client = redis.Redis.from_url(url)
    prefixes = {name: "tdbench-" + uuid.uuid4().hex[:8] for name in LIBRARIES}
    try:
        return asyncio.run(_run(url, n, rounds, prefixes))
    finally:
        for prefix in prefixes.values():
            for key in client.scan_iter(match=prefix + "*", count=1000):
                client.unlink(key)
        client.close()


if __name__ == "__main__":
    from benchmarks.common import redis_url, table

    with redis_url() as url:
        print(table(run(url)))
