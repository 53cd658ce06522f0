"""Store harnesses for the store contract (``taskdedup.testing.contract``): the same scenarios
on any store. A harness holds the store and moves its time: the memory harness advances a fake
clock; the Redis harness waits for the server's real clock, polling with a deadline (never a
bare sleep). A store of your own needs a harness of its own (subclass :class:`Harness`, or
:class:`MemoryHarness` for a store that takes a clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..stores.base import Store
from ..stores.memory import MemoryStore
from .clock import FakeClock

T = TypeVar("T")


def race(n: int, call: Callable[[int], T]) -> list[T]:
    """Run ``call(i)`` for i in range(n) on n threads released at the same instant."""
    barrier = threading.Barrier(n)

    def one(i: int) -> T:
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


class Harness:
    store: Store
    name: str

    def after(self, seconds: float, predicate: Callable[[], Any], *, slack: float = 5.0) -> Any:
        """Let ``seconds`` pass, then return the first truthy ``predicate()`` (or fail)."""
        raise NotImplementedError

    def hold_for(self, seconds: float) -> None:
        """Let ``seconds`` pass with nothing checked (for 'still held after X' claims)."""
        raise NotImplementedError

    def record_ttls(self) -> dict[str, int | None]:
        """Every record under the prefix and its remaining life in ms (None: no expiry)."""
        raise NotImplementedError


class MemoryHarness(Harness):
    name = "memory"

    def __init__(self, prefix: str) -> None:
        self.clock = FakeClock()
        self.store = self.memory = MemoryStore(key_prefix=prefix, clock=self.clock)

    def after(self, seconds: float, predicate: Callable[[], Any], *, slack: float = 5.0) -> Any:
        self.clock.advance(seconds + 0.001)
        value = predicate()
        assert value, f"condition not met after {seconds}s (fake clock)"
        return value

    def hold_for(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def record_ttls(self) -> dict[str, int | None]:
        return {name: self.memory.ttl_ms(name) for name in self.memory.names()}


class RedisHarness(Harness):
    name = "redis"

    def __init__(self, url: str, prefix: str) -> None:
        import redis

        from ..stores.redis import RedisStore

        self.client = redis.Redis.from_url(url)
        self.store = RedisStore(self.client, key_prefix=prefix, url=url)
        self.prefix = prefix

    def after(self, seconds: float, predicate: Callable[[], Any], *, slack: float = 5.0) -> Any:
        time.sleep(seconds)  # the minimum the claim is about; the deadline below is the test
        deadline = time.monotonic() + slack
        while True:
            value = predicate()
            if value or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert value, f"condition not met within {seconds}s + {slack}s"
        return value

    def hold_for(self, seconds: float) -> None:
        time.sleep(seconds)

    def record_ttls(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for raw in self.client.scan_iter(match=self.prefix + ":*", count=500):
            pttl = self.client.pttl(raw)
            if pttl == -2:
                continue
            out[raw.decode()] = None if pttl == -1 else pttl
        return out

    def close(self) -> None:
        self.client.close()


class SqliteHarness(MemoryHarness):
    """The contract on :class:`~taskdedup.stores.sqlite.SqliteStore`, in a file of
    ``folder`` (``:memory:`` by default), on a fake clock."""

    name = "sqlite"

    def __init__(self, prefix: str, path: str = ":memory:") -> None:
        from ..stores.sqlite import SqliteStore

        self.clock = FakeClock()
        self.store = self.sqlite = SqliteStore(path, key_prefix=prefix, clock=self.clock)

    def record_ttls(self) -> dict[str, int | None]:
        return dict(self.sqlite.ttls())


class PostgresHarness(RedisHarness):
    """The contract on :class:`~taskdedup.stores.postgres.PostgresStore`: the database's
    clock is real, so time passes as on Redis (polled with a deadline). :meth:`close` drops
    the prefix's tables."""

    name = "postgres"

    def __init__(self, url: str, prefix: str) -> None:
        from ..stores.postgres import PostgresStore

        self.store = self.postgres = PostgresStore(url, key_prefix=prefix)
        self.prefix = prefix

    def record_ttls(self) -> dict[str, int | None]:
        with self.postgres._pool().connection() as conn:
            rows = conn.execute(
                f"SELECT tag, part, expires_at - (extract(epoch FROM clock_timestamp()) * 1000)"
                f"::bigint FROM {self.postgres.where}{self.postgres.table}"
            ).fetchall()
        return {f"{self.prefix}:{{{t}}}:{p}": left for t, p, left in rows if left > 0}

    def close(self) -> None:
        self.postgres.drop_tables()
        self.postgres.close()


def assert_records_expire(harness: Harness) -> None:
    """G9, checked after a scenario: it wrote something, and every record it wrote expires."""
    ttls = harness.record_ttls()
    assert ttls, "the scenario wrote nothing?"
    forever = [name for name, ttl in ttls.items() if ttl is None]
    assert not forever, f"G9: records without expiry: {forever}"
