"""Store harnesses for the contract suite: the same scenarios on MemoryStore and RedisStore.

Time moves differently in each: the memory harness advances a fake clock; the Redis harness
waits for the server's real clock, polling with a deadline (never a bare sleep).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from taskdedup.stores.base import Store
from taskdedup.stores.memory import MemoryStore
from taskdedup.testing import FakeClock

T = TypeVar("T")


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


class SqliteHarness(MemoryHarness):
    """The contract on a store written on the record seam by a user (tests/sqlite_store.py)."""

    name = "sqlite"

    def __init__(self, prefix: str) -> None:
        from sqlite_store import SqliteStore

        self.clock = FakeClock()
        self.store = self.sqlite = SqliteStore(prefix, clock=self.clock)

    def record_ttls(self) -> dict[str, int | None]:
        return dict(self.sqlite.ttls())


class RedisHarness(Harness):
    name = "redis"

    def __init__(self, url: str, prefix: str) -> None:
        import redis

        from taskdedup.stores.redis import RedisStore

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
