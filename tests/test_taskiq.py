"""taskiq on InMemoryBroker: the producer and worker sides in one process, no Redis needed.

InMemoryBroker's kick hands the message to its receiver, so every test goes through taskiq's
real path: kicker, middlewares' pre_send, broker.kick, receiver (pre_execute, the task, on_error,
post_execute). Each test runs its own event loop with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
from taskiq import (
    Context,
    InMemoryBroker,
    ScheduledTask,
    SimpleRetryMiddleware,
    SmartRetryMiddleware,
    TaskiqDepends,
    TaskiqScheduler,
)
from taskiq.abc.middleware import TaskiqMiddleware
from taskiq.exceptions import SendTaskError
from taskiq.kicker import AsyncKicker
from taskiq.message import BrokerMessage

from taskdedup import ConfigError, DuplicateJob, MemoryStore
from taskdedup.taskiq import FENCE_LABEL, KEY_LABEL, DedupKicker, DedupMiddleware, deduplicate

T = TypeVar("T")
CONTEXT = TaskiqDepends()


@pytest.fixture(autouse=True)
def _info_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="taskdedup")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "it") -> Any:
    """Poll ``predicate`` on the event loop until it is truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


class Deliveries(TaskiqMiddleware):
    """Counts the messages the broker delivered to the receiver (sent, not deduplicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []

    def pre_execute(self, message: Any) -> Any:
        self.ids.append(message.task_id)
        return message


def make_broker(*middlewares: TaskiqMiddleware, **settings: Any) -> tuple[InMemoryBroker, Any]:
    store = MemoryStore()
    dedup = DedupMiddleware(store, **settings)
    broker = InMemoryBroker().with_middlewares(*middlewares or (dedup, Deliveries()))
    return broker, store


def delivered(broker: InMemoryBroker) -> list[str]:
    counter = next(m for m in broker.middlewares if isinstance(m, Deliveries))
    return counter.ids


async def started(broker: InMemoryBroker, body: Callable[[], Awaitable[T]]) -> T:
    await broker.startup()
    try:
        return await body()
    finally:
        await broker.wait_all()
        await broker.shutdown()


def test_a_duplicate_kiq_returns_the_holders_handle_and_runs_nothing() -> None:
    broker, _ = make_broker()
    runs: list[int] = []
    gate = asyncio.Event()

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def build(x: int) -> int:
        runs.append(x)
        await gate.wait()
        return x

    async def body() -> None:
        first = await build.kiq(1)
        again = await build.kiq(x=1)  # f(1) and f(x=1) share a key
        other = await build.kiq(2)
        assert first.deduplicated is False and other.deduplicated is False
        assert again.deduplicated is True and again.task_id == first.task_id
        await until(lambda: sorted(runs) == [1, 2], what="both jobs to start")
        running = await build.kiq(1)  # still held while it runs (until_executed)
        assert running.deduplicated and running.task_id == first.task_id
        gate.set()
        assert (await again.wait_result(timeout=10)).return_value == 1
        await broker.wait_all()
        after = await build.kiq(1)  # released when it ended
        assert not after.deduplicated and after.task_id != first.task_id
        await after.wait_result(timeout=10)

    run(started(broker, body))
    assert runs == [1, 2, 1]
    assert len(delivered(broker)) == 3  # the duplicates were never sent


def test_on_conflict_raise_carries_the_holders_id() -> None:
    broker, _ = make_broker()

    @broker.task(deduplicate={"strategy": "until_executed", "on_conflict": "raise"})
    async def charge(order: int) -> None:
        await asyncio.sleep(0.2)

    async def body() -> None:
        first = await charge.kiq(7)
        with pytest.raises(DuplicateJob) as err:
            await charge.kiq(7)
        assert err.value.job_id == first.task_id

    run(started(broker, body))


def test_kicks_by_name_are_deduplicated_and_dedup_kicker_marks_them() -> None:
    broker, _ = make_broker()
    runs: list[str] = []

    @broker.task(task_name="reports:nightly", deduplicate="until_executed")
    async def nightly(report: str) -> None:
        runs.append(report)
        await asyncio.sleep(0.3)

    async def body() -> None:
        first = await AsyncKicker("reports:nightly", broker, {}).kiq("sales")
        plain = await AsyncKicker("reports:nightly", broker, {}).kiq("sales")
        marked = await DedupKicker("reports:nightly", broker, {}).kiq(report="sales")
        assert plain.task_id == first.task_id  # nothing sent: the holder's id
        assert marked.deduplicated and marked.task_id == first.task_id

    run(started(broker, body))
    assert runs == ["sales"]


def test_32_concurrent_kiqs_of_one_call_send_one_job() -> None:
    broker, _ = make_broker()
    runs: list[str] = []

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def build(sha: str) -> str:
        runs.append(sha)
        await asyncio.sleep(0.2)
        return sha

    async def body() -> None:
        handles = await asyncio.gather(*(build.kiq("abc123") for _ in range(32)))
        assert len({h.task_id for h in handles}) == 1
        assert sum(not h.deduplicated for h in handles) == 1

    run(started(broker, body))
    assert runs == ["abc123"]
    assert len(delivered(broker)) == 1


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_sync_and_async_tasks_hold_the_lock_while_running(kind: str) -> None:
    broker, _ = make_broker()
    runs: list[int] = []

    if kind == "async":

        @broker.task(deduplicate={"strategy": "until_executed"})
        async def job(n: int) -> int:
            runs.append(n)
            await asyncio.sleep(0.5)
            return n

    else:

        @broker.task(deduplicate={"strategy": "until_executed"})
        def job(n: int) -> int:
            runs.append(n)
            time.sleep(0.5)
            return n

    async def body() -> None:
        first = await job.kiq(3)
        await until(lambda: runs, what="the job to start")
        during = await job.kiq(3)
        assert during.deduplicated and during.task_id == first.task_id
        assert (await first.wait_result(timeout=10)).return_value == 3
        await until(lambda: not broker._running_tasks, what="the receiver to finish")
        assert not (await job.kiq(3)).deduplicated

    run(started(broker, body))
    assert runs == [3, 3]


def test_until_executing_frees_the_key_when_the_job_starts() -> None:
    broker, _ = make_broker()
    started_jobs: list[int] = []
    gate = asyncio.Event()

    @broker.task(deduplicate="until_executing")
    async def sync(account: int) -> None:
        started_jobs.append(account)
        await gate.wait()

    async def body() -> None:
        first = await sync.kiq(1)
        await until(lambda: started_jobs, what="the job to start")
        second = await sync.kiq(1)  # running: a new job is accepted
        assert not second.deduplicated and second.task_id != first.task_id
        gate.set()

    run(started(broker, body))
    assert started_jobs == [1, 1]


def test_the_job_reads_its_key_and_fencing_token() -> None:
    broker, _ = make_broker()
    seen: list[tuple[str, int]] = []

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def report(day: str, context: Context = CONTEXT) -> None:
        labels = context.message.labels
        seen.append((labels[KEY_LABEL], labels[FENCE_LABEL]))

    async def body() -> None:
        await (await report.kiq("mon")).wait_result(timeout=10)
        await broker.wait_all()
        await (await report.kiq("mon")).wait_result(timeout=10)

    run(started(broker, body))
    (key, fence), (key2, fence2) = seen
    assert key == key2 and len(key) == 32 and fence2 > fence > 0


def test_per_call_labels_switch_dedup_off_or_change_the_policy() -> None:
    broker, _ = make_broker()

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def job(n: int) -> None:
        await asyncio.sleep(0.3)

    @broker.task
    async def plain(n: int) -> None:
        await asyncio.sleep(0.3)

    async def body() -> None:
        first = await job.kiq(1)
        off = await job.kicker().with_labels(deduplicate=False).kiq(1)
        assert not off.deduplicated and off.task_id != first.task_id
        with pytest.raises(DuplicateJob):
            await job.kicker().with_labels(deduplicate_on_conflict="raise").kiq(1)
        on = await plain.kicker().with_labels(deduplicate="until_executed").kiq(5)
        again = await plain.kicker().with_labels(deduplicate="until_executed").kiq(5)
        assert again.deduplicated and again.task_id == on.task_id
        assert not (await plain.kiq(5)).deduplicated  # the task itself declares nothing

    run(started(broker, body))


def test_the_decorator_on_either_side_of_broker_task() -> None:
    broker, _ = make_broker()

    @deduplicate("until_executed", keys=["user"])
    @broker.task
    async def above(user: int, note: str) -> None:
        await asyncio.sleep(0.3)

    @broker.task
    @deduplicate("until_executed", keys=["user"])
    async def below(user: int, note: str) -> None:
        await asyncio.sleep(0.3)

    async def body() -> None:
        for task in (above, below):
            first = await task.kiq(1, "a")
            again = await task.kiq(1, note="b")  # keys=["user"]: same key
            assert again.deduplicated and again.task_id == first.task_id

    run(started(broker, body))


def test_a_bad_policy_fails_when_the_task_is_defined() -> None:
    broker, _ = make_broker()
    with pytest.raises(ConfigError, match="nope"):

        @broker.task(deduplicate={"keys": ["nope"]})
        async def labelled(user: int) -> None: ...

    with pytest.raises(ConfigError, match="nope"):

        @deduplicate(keys=["nope"])
        @broker.task
        async def decorated(user: int) -> None: ...

    with pytest.raises(ConfigError, match="strategy"):
        deduplicate("sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("retry", ["simple", "smart"])
@pytest.mark.parametrize("order", ["dedup first", "retry first"])
def test_a_retrying_task_holds_its_lock_throughout(retry: str, order: str) -> None:
    retrier: TaskiqMiddleware
    if retry == "simple":  # keeps the failed attempt's result: the retry's send must be seen
        retrier = SimpleRetryMiddleware(default_retry_count=5, no_result_on_retry=False)
    else:
        retrier = SmartRetryMiddleware(default_retry_count=5, default_delay=0.05)
    store = MemoryStore()
    dedup = DedupMiddleware(store)
    chain = (dedup, retrier) if order == "dedup first" else (retrier, dedup)
    broker = InMemoryBroker().with_middlewares(*chain)
    attempts: list[int] = []
    running = [0, 0]  # now, most at once

    @broker.task(deduplicate={"strategy": "until_executed", "lease": 5}, retry_on_error=True)
    async def flaky(n: int, context: Context = CONTEXT) -> str:
        attempts.append(int(context.message.labels.get("_retries", 0)))
        running[0] += 1
        running[1] = max(running)
        try:
            await asyncio.sleep(0.1)
        finally:
            running[0] -= 1
        if len(attempts) < 3:
            raise RuntimeError("not yet")
        return "ok"

    async def body() -> None:
        first = await flaky.kiq(1)
        while len(attempts) < 3 or broker._running_tasks:
            dup = await flaky.kiq(1)
            if not dup.deduplicated and len(attempts) >= 3:
                # the last attempt succeeded and freed the key between the check and the kiq
                await dup.wait_result(timeout=10)
                break
            assert dup.deduplicated and dup.task_id == first.task_id, "the retry lost its lock"
            await asyncio.sleep(0.02)
        assert running[1] == 1, "a submission ran beside an attempt"
        result = await first.wait_result(timeout=10)
        assert result.return_value == "ok"
        assert not (await flaky.kiq(1)).deduplicated  # released after the success

    run(started(broker, body))
    assert attempts[:3] == [0, 1, 2]


def test_a_final_failure_releases_the_lock() -> None:
    broker, _ = make_broker(
        DedupMiddleware(MemoryStore()), SimpleRetryMiddleware(default_retry_count=2)
    )
    attempts: list[int] = []

    @broker.task(deduplicate={"strategy": "until_executed"}, retry_on_error=True)
    async def doomed(n: int) -> None:
        attempts.append(n)
        raise RuntimeError("always")

    async def body() -> None:
        first = await doomed.kiq(1)
        result = await first.wait_result(timeout=10)
        assert result.is_err
        await broker.wait_all()
        assert not (await doomed.kiq(1)).deduplicated

    run(started(broker, body))
    assert len(attempts) >= 2


def test_reschedule_once_runs_once_more_with_the_latest_arguments() -> None:
    broker, _ = make_broker()
    runs: list[str] = []
    gate = asyncio.Event()

    @broker.task(
        deduplicate={
            "strategy": "until_executed",
            "keys": ["user"],
            "on_conflict": "reschedule_once",
        }
    )
    async def sync_user(user: int, note: str) -> str:
        runs.append(note)
        if note == "first":
            await gate.wait()
        return note

    async def body() -> None:
        first = await sync_user.kiq(1, "first")
        await until(lambda: runs, what="the first run")
        assert (await sync_user.kiq(1, "second")).task_id == first.task_id
        assert (await sync_user.kiq(1, "third")).task_id == first.task_id
        gate.set()
        await until(lambda: len(runs) == 2, what="the rescheduled run")
        await broker.wait_all()
        await asyncio.sleep(0.3)  # a wrong implementation would run a third time here
        await broker.wait_all()

    run(started(broker, body))
    assert runs == ["first", "third"]


def test_while_executing_never_runs_two_jobs_of_a_key_at_once() -> None:
    broker, _ = make_broker()
    spans: list[tuple[str, float]] = []

    @broker.task(deduplicate={"strategy": "while_executing", "lease": 5})
    async def import_feed(feed: str) -> None:
        spans.append(("start", time.monotonic()))
        await asyncio.sleep(0.3)
        spans.append(("end", time.monotonic()))

    async def body() -> None:
        handles = [await import_feed.kiq("f") for _ in range(3)]
        assert len({h.task_id for h in handles}) == 3  # no enqueue lock: none is dropped
        for handle in handles:
            await handle.wait_result(timeout=30)

    run(started(broker, body))
    kinds = [kind for kind, _ in sorted(spans, key=lambda s: s[1])]
    assert kinds == ["start", "end"] * 3


def test_a_redelivered_copy_does_not_run_beside_or_after_the_holder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, _ = make_broker()
    runs: list[int] = []
    gate = asyncio.Event()

    @broker.task(deduplicate={"strategy": "until_executed", "lease": 1})
    async def once(n: int) -> int:
        runs.append(n)
        await gate.wait()
        return n

    async def body() -> None:
        first = await once.kiq(1)
        await until(lambda: runs, what="the holder to start")
        # the broker delivers the same message again while the holder runs
        copy = AsyncKicker(once.task_name, broker, {"_": "copy"}).with_task_id(first.task_id)
        await broker.kick(broker.formatter.dumps(copy._prepare_message(1)))
        await asyncio.sleep(0.3)
        assert runs == [1]  # not beside it
        gate.set()
        assert (await first.wait_result(timeout=10)).return_value == 1
        # the copy is sent again after the lease (1 s + 1 s), and then dropped: the job is done
        await until(lambda: "done (holder" in caplog.text, what="the copy to come back")
        await broker.wait_all()

    run(started(broker, body))
    assert runs == [1]  # ... and does not run after it either


class FlakyBroker(InMemoryBroker):
    """An InMemoryBroker whose kick fails while ``failing`` is set."""

    failing = True

    async def kick(self, message: BrokerMessage) -> None:
        if self.failing:
            raise ConnectionError("broker down")
        await super().kick(message)


def test_a_failed_publish_releases_the_lock_before_the_error_reaches_the_caller() -> None:
    broker = FlakyBroker().with_middlewares(DedupMiddleware(MemoryStore()))

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def job(n: int) -> None: ...

    async def body() -> None:
        with pytest.raises(SendTaskError):
            await job.kiq(1)
        broker.failing = False
        assert not (await job.kiq(1)).deduplicated  # the failed send left no lock behind

    run(started(broker, body))


class NoSchedules:
    """A schedule source with no schedules of its own: the tests fire its ticks by hand."""

    async def get_schedules(self) -> list[ScheduledTask]:
        return []

    def pre_send(self, task: ScheduledTask) -> None: ...

    def post_send(self, task: ScheduledTask) -> None: ...


def ticker(
    broker: InMemoryBroker, task: Any
) -> tuple[Callable[[], Awaitable[None]], ScheduledTask]:
    """One schedule entry of ``task`` (arguments ``["core"]``), and what fires one tick of it as
    taskiq's scheduler does."""
    scheduler = TaskiqScheduler(broker, [])
    tick = ScheduledTask(
        task_name=task.task_name,
        labels={},
        args=["core"],
        kwargs={},
        time=datetime.now(timezone.utc),
    )

    fired = itertools.count()

    async def fire() -> None:  # each fire the entry's next tick (a second later)
        due = tick.time + timedelta(seconds=next(fired))  # type: ignore[operator]
        this = tick.model_copy(update={"time": due})
        await scheduler.on_ready(NoSchedules(), this)  # type: ignore[arg-type]

    return fire, tick


def test_a_duplicate_scheduled_kick_is_skipped_quietly() -> None:
    broker, _ = make_broker()
    runs: list[str] = []

    @broker.task(deduplicate={"strategy": "until_executed", "on_conflict": "raise"})
    async def digest(team: str) -> None:
        runs.append(team)
        await asyncio.sleep(0.5)

    fire, _ = ticker(broker, digest)

    async def body() -> None:
        await fire()
        await fire()  # the same tick again: no DuplicateJob
        await fire()

    run(started(broker, body))
    assert runs == ["core"]


def test_a_skipped_scheduler_tick_is_said_once_per_entry_as_under_celery_beat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same rule as Celery beat's (tests/test_config_errors.py): while an entry's last run
    holds its key, each tick is skipped, counted in stats["beat.skipped"], and said at INFO
    once (not once per tick), whatever on_conflict says."""
    broker, _ = make_broker()
    dedup = next(m for m in broker.middlewares if isinstance(m, DedupMiddleware))

    @broker.task(deduplicate={"strategy": "until_executed", "on_conflict": "drop"})
    async def nightly_digest(team: str) -> None:
        await asyncio.sleep(0.5)

    fire, tick = ticker(broker, nightly_digest)

    async def body() -> None:
        await fire()
        for _ in range(3):  # the first run still holds the key
            await fire()

    caplog.set_level(logging.INFO, logger="taskdedup")
    run(started(broker, body))
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "taskdedup"
        and r.levelno >= logging.INFO
        and "nightly_digest" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith("beat skipped "), said
    assert f"entry={tick.schedule_id}" in said[0]
    assert dedup.dedup.stats["beat.skipped"] == 3


def test_a_dry_run_still_says_which_scheduler_ticks_it_would_skip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, _ = make_broker(dry_run=True)
    runs: list[str] = []

    @broker.task(deduplicate={"strategy": "until_executed"})
    async def nightly_export(team: str) -> None:
        runs.append(team)
        await asyncio.sleep(0.5)

    fire, _ = ticker(broker, nightly_export)

    async def body() -> None:
        for _ in range(2):
            await fire()
        await until(lambda: len(runs) == 2, what="both ticks to run (a dry run drops nothing)")

    caplog.set_level(logging.INFO, logger="taskdedup")
    run(started(broker, body))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith("enqueue would_deduplicate") for m in said), said


def test_dry_run_and_the_kill_switch_drop_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for settings, env in (({"dry_run": True}, None), ({}, "false")):
        if env is not None:
            monkeypatch.setenv("TASKDEDUP_ENABLED", env)
        broker, _ = make_broker(DedupMiddleware(MemoryStore(), **settings))
        runs: list[int] = []

        @broker.task(deduplicate={"strategy": "until_executed"})
        async def job(n: int, runs: list[int] = runs) -> None:
            runs.append(n)
            await asyncio.sleep(0.2)

        async def body() -> None:
            handles = [await job.kiq(1), await job.kiq(1)]
            assert not any(h.deduplicated for h in handles)

        run(started(broker, body))
        assert runs == [1, 1], settings
