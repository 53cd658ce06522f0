"""The kill switch and dry run (G16), with real workers, on every path a user's job takes.

``enabled=False`` must make zero store commands: submissions, claims, retries, finishes,
reservations and idempotency keys all go by untouched (a store that is down or misbehaving can
be switched off this way). ``dry_run=True`` decides and logs as usual but refuses, drops and
defers nothing, for the reservation guard and idempotency keys too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from taskdedup import MemoryStore
from taskdedup.celery import deduplicate, install, reserve
from taskdedup.stores.base import Op
from test_celery import make_app


class CountingStore(MemoryStore):
    """A memory store that counts every command it is sent, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _count(self, op: Op[Any]) -> None:
        with self._count_lock:
            self.commands[type(op).__name__] += 1

    def run(self, op: Op[Any]) -> Any:
        self._count(op)
        return super().run(op)

    async def arun(self, op: Op[Any]) -> Any:
        self._count(op)
        return await super().arun(op)


def celery_app(redis_url: str, key_prefix: str, store: CountingStore, **settings: Any) -> Celery:
    app = make_app(redis_url, key_prefix)
    install(app, store=store, **settings)
    return app


def define(app: Celery, runs: list[Any]) -> tuple[Any, Any]:
    @deduplicate("until_executed")
    @reserve(1, scope="user")
    @app.task(shared=False, bind=True, max_retries=1, default_retry_delay=0)
    def build(self: Any, user: str, n: int) -> int:
        runs.append((n, self.request.retries))
        if self.request.retries == 0 and n == 1:
            raise self.retry()
        return n

    @deduplicate("until_executing", on_conflict="raise")
    @app.task(shared=False)
    def report(user: str) -> str:
        runs.append(("report", user))
        return user

    return build, report


def test_the_kill_switch_sends_no_store_command_on_any_path_of_a_job(
    redis_url: str, key_prefix: str
) -> None:
    store = CountingStore()
    app = celery_app(redis_url, key_prefix, store, enabled=False)
    runs: list[Any] = []
    build, report = define(app, runs)
    with start_worker(app, pool="solo", perform_ping_check=False):
        # the same key twice, over the reservation cap, a retry, an idempotency key twice
        handles = [build.delay("ann", 1), build.delay("ann", 1), build.delay("ann", 2)]
        keyed = [report.apply_async(("bob",), idempotency_key="sha-1") for _ in range(2)]
        assert len({h.id for h in handles + keyed}) == 5  # nothing deduplicated, nothing refused
        assert [h.get(timeout=30) for h in handles] == [1, 1, 2]
        assert [h.get(timeout=30) for h in keyed] == ["bob", "bob"]
    assert sorted(r for r in runs if r[0] == 1) == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert store.commands == Counter()


def test_dry_run_refuses_nothing_and_logs_what_it_would_have_done(
    redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CountingStore()
    app = celery_app(redis_url, key_prefix, store, dry_run=True)
    runs: list[Any] = []
    build, report = define(app, runs)
    caplog.set_level(logging.INFO, logger="taskdedup")
    # sent before a worker can run the first: the second is over the cap (a worker that had
    # already run the first would have freed its slot: this test failed so once in CI)
    over = [build.delay("cid", 3), build.delay("cid", 4)]
    with start_worker(app, pool="solo", perform_ping_check=False):
        first = report.apply_async(("bob",), idempotency_key="sha-2")
        assert first.get(timeout=30) == "bob"
        again = report.apply_async(("bob",), idempotency_key="sha-2")  # would be a hit
        dup = report.delay("bob")  # on_conflict="raise" would raise if bob's key were held
        assert again.id != first.id and again.get(timeout=30) == "bob"
        assert [h.get(timeout=30) for h in over] == [3, 4]
        assert dup.get(timeout=30) == "bob"
    text = caplog.text
    assert "would_refuse" in text and "scope user=cid is full" in text
    would_hit = [r for r in caplog.records if "would_hit" in r.getMessage()]
    assert would_hit and first.id in would_hit[0].getMessage()  # names the original job


def test_the_kill_switch_sends_no_store_command_from_taskiq(key_prefix: str) -> None:
    from taskiq import InMemoryBroker

    from taskdedup.taskiq import DedupMiddleware

    store = CountingStore()
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(store, enabled=False))
    runs: list[int] = []

    @broker.task(deduplicate="until_executed", reserve={"max_concurrent": 1, "scope": "user"})
    async def build(user: str, n: int) -> int:
        runs.append(n)
        return n

    async def main() -> None:
        await broker.startup()
        try:
            handles = [await build.kiq("ann", 1) for _ in range(3)]
            kicker = build.kicker().with_labels(idempotency_key="k")
            keyed = [await kicker.kiq("ann", 2) for _ in range(2)]
            for handle in handles + keyed:
                await handle.wait_result(timeout=10)
        finally:
            await broker.shutdown()

    asyncio.run(main())
    assert sorted(runs) == [1, 1, 1, 2, 2]
    assert store.commands == Counter()


def test_a_dry_run_publishes_a_call_whose_key_is_held_on_a_redis_store(
    redis_url: str, key_prefix: str
) -> None:
    """A dry run drops nothing. On a Redis store the acquire is written before Celery builds the
    message and read just before its publish; a held key found there must still be published
    in a dry run (it was once answered with the call's own id, and never sent)."""
    from taskdedup import RedisStore

    app = make_app(redis_url, key_prefix)
    integ = install(app, store=RedisStore.from_url(redis_url, key_prefix=key_prefix), dry_run=True)
    assert integ.publisher is not None  # the second call comes later, or from another process:
    integ.publisher.recent.seconds = 0.0  # type: ignore[attr-defined]  # not remembered here

    @deduplicate("until_executed")
    @app.task(shared=False)
    def export(user: str) -> str:
        return user

    first = export.delay("ann")  # holds the key: no worker runs it yet
    second = export.delay("ann")  # would be a duplicate
    assert second.id != first.id and not second.deduplicated
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert first.get(timeout=30) == "ann"
        assert second.get(timeout=30) == "ann"  # it was published, so it ran
