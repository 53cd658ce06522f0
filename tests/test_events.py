"""The decisions as users see them: Celery signals (real worker on Redis), taskiq middleware
callbacks, INFO log lines with structured fields, the startup line, and the counters of the
decisions a producer makes alone (quota rejections, idempotent hits)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from taskiq import InMemoryBroker

from harness import wait_for
from taskdedup import MemoryStore, QuotaExceeded
from taskdedup.celery import deduplicate, install, signals
from taskdedup.events import Decision
from taskdedup.taskiq import DedupMiddleware, reserve
from test_celery import make_app


def test_celery_signals_name_the_task_and_the_holder_and_logs_carry_them(
    redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="taskdedup")
    app = make_app(redis_url, key_prefix)
    install(app)
    started, go = threading.Event(), threading.Event()

    @deduplicate("until_executed", keys=["sha"])
    @app.task(name="events.build", shared=False)
    def build(sha: str) -> str:
        started.set()
        go.wait(20)
        return sha

    seen: list[tuple[str, Any, dict[str, Any]]] = []

    def receiver(name: str) -> Any:
        def got(sender: Any = None, **kw: Any) -> None:
            seen.append((name, sender, kw))

        return got

    receivers = {
        "deduplicated": receiver("deduplicated"),
        "released": receiver("released"),
        "any": receiver("any"),
    }
    signals.task_deduplicated.connect(receivers["deduplicated"], weak=False)
    signals.lock_released.connect(receivers["released"], weak=False)
    signals.decision_made.connect(receivers["any"], weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            first = build.delay("abc")
            assert started.wait(20), "the job never started"
            again = build.delay("abc")
            assert again.deduplicated and again.id == first.id
            go.set()
            assert first.get(timeout=20) == "abc"
            wait_for(lambda: any(s[0] == "released" for s in seen), 10, "lock_released")
    finally:
        go.set()
        signals.task_deduplicated.disconnect(receivers["deduplicated"])
        signals.lock_released.disconnect(receivers["released"])
        signals.decision_made.disconnect(receivers["any"])

    deduplicated = [s for s in seen if s[0] == "deduplicated"]
    assert len(deduplicated) == 1
    _, sender, kw = deduplicated[0]
    assert sender == "events.build" and kw["holder"] == first.id
    assert isinstance(kw["event"], Decision) and kw["event"].kind == "deduplicated"
    released = [s for s in seen if s[0] == "released"]
    assert [(s[1], s[2]["job_id"]) for s in released] == [("events.build", first.id)]
    outcomes = {(s[2]["event"].decision, s[2]["event"].outcome) for s in seen if s[0] == "any"}
    assert {("enqueue", "acquired"), ("enqueue", "duplicate"), ("claim", "run")} <= outcomes

    drop = [r for r in caplog.records if getattr(r, "outcome", None) == "duplicate"]
    assert len(drop) == 1 and drop[0].levelno == logging.INFO
    assert drop[0].task_name == "events.build"  # type: ignore[attr-defined]
    assert drop[0].holder_job_id == first.id  # type: ignore[attr-defined]
    startup = [r.getMessage() for r in caplog.records if r.getMessage().startswith("taskdedup ")]
    assert len(startup) == 1, startup
    assert "(prefix " + key_prefix + ")" in startup[0] and "deduplicated task" in startup[0]
    assert "until_executed" in startup[0]


def test_the_startup_line_hides_the_store_password() -> None:
    from taskdedup import Settings
    from taskdedup.startup import summary
    from taskdedup.stores.redis import RedisStore

    store = RedisStore.from_url("redis://app:s3cret@db.internal:6380/2")
    line = summary(Settings(dry_run=True), store, {})
    assert "s3cret" not in line and "redis://app:***@db.internal:6380/2" in line
    assert "DRY RUN" in line and "0 deduplicated tasks" in line
    query = RedisStore.from_url("redis://db.internal:6379/0?password=s3cret&socket_timeout=3")
    assert "s3cret" not in summary(Settings(), query, {})


class Recording(DedupMiddleware):
    """taskiq callbacks, one sync and one async, as a user would subclass them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, Decision]] = []

    def on_decision(self, event: Decision) -> None:
        self.seen.append(("decision", event))

    async def on_deduplicated(self, event: Decision) -> None:
        await asyncio.sleep(0)
        self.seen.append(("deduplicated", event))

    def on_quota_rejected(self, event: Decision) -> None:
        self.seen.append(("quota", event))


def test_taskiq_callbacks_and_counters_of_producer_decisions() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from taskdedup.metrics import install_metrics

    registry = prometheus_client.CollectorRegistry()
    metrics = install_metrics(registry)
    middleware = Recording(MemoryStore())
    broker = InMemoryBroker().with_middlewares(middleware)
    gate = asyncio.Event()

    @reserve(max_concurrent=1, scope="tenant")
    @broker.task(task_name="events.capped")
    async def capped(tenant: str, n: int) -> int:
        await gate.wait()
        return n

    @broker.task(task_name="events.build", deduplicate={"strategy": "until_executed"})
    async def build(sha: str) -> str:
        await gate.wait()
        return sha

    async def body() -> None:
        await broker.startup()
        first = await build.kiq("abc")
        again = await build.kiq("abc")
        assert again.deduplicated and again.task_id == first.task_id
        await capped.kiq("acme", 1)
        with pytest.raises(QuotaExceeded):
            await capped.kiq("acme", 2)
        kicker = build.kicker().with_labels(idempotency_key="build-17")
        original = await kicker.kiq("def")
        assert (await kicker.kiq("def")).task_id == original.task_id
        deadline = asyncio.get_running_loop().time() + 5
        while not any(kind == "deduplicated" for kind, _ in middleware.seen):
            assert asyncio.get_running_loop().time() < deadline, "on_deduplicated never ran"
            await asyncio.sleep(0.01)
        gate.set()
        await broker.wait_all()
        await broker.shutdown()

    try:
        asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        metrics.stop()
    kinds = [kind for kind, _ in middleware.seen]
    assert kinds.count("deduplicated") == 1 and kinds.count("quota") == 1
    dup = next(event for kind, event in middleware.seen if kind == "deduplicated")
    assert dup.task == "events.build" and dup.holder is not None
    decided = {(e.decision, e.outcome) for kind, e in middleware.seen if kind == "decision"}
    assert {("enqueue", "acquired"), ("idempotency", "hit"), ("finish", "released")} <= decided

    def count(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert count("taskdedup_quota_rejections_total", task="events.capped") == 1
    assert count("taskdedup_idempotent_hits_total", task="events.build") == 1
    assert count("taskdedup_deduplicated_total", task="events.build") == 1
    labels = {"task": "events.build", "decision": "enqueue", "outcome": "acquired"}
    assert count("taskdedup_decisions_total", **labels) == 2  # abc, then def


class NewestWins(DedupMiddleware):
    """The newest-wins callbacks, as a user would override them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str | None]] = []

    def on_deduplicated(self, event: Decision) -> None:
        self.seen.append(("deduplicated", event.holder))

    def on_debounced(self, event: Decision) -> None:
        self.seen.append(("debounced", event.holder))

    async def on_cancel_requested(self, event: Decision) -> None:
        self.seen.append(("cancel_requested", event.holder))


def test_taskiq_callbacks_and_counters_of_debounced_and_cancel_requesting_submissions() -> None:
    """A submission folded into a burst is told as ``debounced``, one that asks a running job
    to stop as ``cancel_requested``; each is a ``deduplicated`` one too, for listeners and for
    the counters, and ``taskdedup_newest_wins_total`` counts them by effect."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from taskdedup.metrics import install_metrics

    registry = prometheus_client.CollectorRegistry()
    metrics = install_metrics(registry)
    middleware = NewestWins(MemoryStore())
    broker = InMemoryBroker().with_middlewares(middleware)
    started, gate = asyncio.Event(), asyncio.Event()

    @broker.task(task_name="events.reindex", deduplicate={"strategy": "debounce", "delay": 30})
    async def reindex(doc: str) -> str:
        return doc

    @broker.task(
        task_name="events.export",
        deduplicate={"strategy": "until_executed", "on_conflict": "supersede", "running": "cancel"},
    )
    async def export(sheet: str) -> str:
        started.set()
        await gate.wait()
        return sheet

    async def body() -> tuple[str, str]:
        await broker.startup()
        burst = await reindex.kiq("d")
        assert (await reindex.kiq("d")).task_id == burst.task_id
        running = await export.kiq("s")
        await asyncio.wait_for(started.wait(), 10)
        assert (await export.kiq("s")).task_id == running.task_id
        deadline = asyncio.get_running_loop().time() + 5
        while len(middleware.seen) < 4:  # (the async callback runs on the loop)
            assert asyncio.get_running_loop().time() < deadline, middleware.seen
            await asyncio.sleep(0.01)
        gate.set()
        await broker.shutdown()
        return burst.task_id, running.task_id

    try:
        burst_id, running_id = asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        metrics.stop()
    assert sorted(middleware.seen) == sorted(
        [
            ("debounced", burst_id),
            ("deduplicated", burst_id),
            ("cancel_requested", running_id),
            ("deduplicated", running_id),
        ]
    )

    def count(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert count("taskdedup_newest_wins_total", task="events.reindex", effect="debounced") == 1
    assert count("taskdedup_deduplicated_total", task="events.reindex") == 1
    effect = {"task": "events.export", "effect": "cancel_requested"}
    assert count("taskdedup_newest_wins_total", **effect) == 1
    assert count("taskdedup_deduplicated_total", task="events.export") == 1
