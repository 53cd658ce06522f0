"""taskiq edge cases a review found: each failed before its fix (InMemoryBroker, no Redis)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from taskiq import InMemoryBroker, SimpleRetryMiddleware
from taskiq.abc.middleware import TaskiqMiddleware

from taskdedup import MemoryStore
from taskdedup.taskiq import DedupMiddleware
from test_taskiq import run, until


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="taskiq")


def test_a_kiq_nested_in_another_middlewares_pre_send_keeps_the_decisions_apart() -> None:
    sent: list[tuple[str, Any]] = []

    class Audit(TaskiqMiddleware):  # records each send by kicking an audit task
        async def pre_send(self, message: Any) -> Any:
            if not message.task_name.endswith("audit"):
                await self.broker.find_task(audit.task_name).kiq(message.task_name)
            return message

    class Deliveries(TaskiqMiddleware):
        def pre_execute(self, message: Any) -> Any:
            sent.append((message.task_name.split(":")[-1], message.args))
            return message

    broker = InMemoryBroker().with_middlewares(
        DedupMiddleware(MemoryStore(), grace=0.5), Audit(), Deliveries()
    )
    gate = asyncio.Event()

    @broker.task
    async def audit(name: str) -> None: ...

    @broker.task(deduplicate={"strategy": "until_executed", "keys": ["x"]})
    async def build(x: int, note: str = "") -> None:
        await gate.wait()

    async def body() -> None:
        await broker.startup()
        first = await build.kiq(1, "first")
        second = await build.kicker().with_labels(deduplicate_on_conflict="drop").kiq(1, "dup")
        assert second.deduplicated and second.task_id == first.task_id
        await asyncio.sleep(0.8)  # past the grace: the lock was confirmed, not left to lapse
        assert (await build.kiq(1, "third")).deduplicated
        await until(lambda: any(name == "build" for name, _ in sent), 5, "the first build")
        assert [args for name, args in sent if name == "build"] == [[1, "first"]]
        gate.set()
        await broker.wait_all()
        await broker.shutdown()

    run(body())


def test_a_retry_keeps_its_lease_when_the_attempt_before_it_ends_late() -> None:
    class SlowPost(TaskiqMiddleware):  # the failed attempt's post_execute ends after the retry
        async def post_execute(self, message: Any, result: Any) -> None:  # started
            await asyncio.sleep(0.2)

    dedup = DedupMiddleware(MemoryStore(), default_lease=0.6)
    broker = InMemoryBroker().with_middlewares(
        SimpleRetryMiddleware(default_retry_count=3), dedup, SlowPost()
    )
    attempts: list[int] = []

    @broker.task(deduplicate="until_executed", retry_on_error=True)
    async def job(x: int) -> int:
        attempts.append(x)
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")
        await asyncio.sleep(3)  # the retry runs for five leases
        return x

    async def body() -> None:
        await broker.startup()
        first = await job.kiq(1)
        await until(lambda: len(attempts) == 2, 5, "the retry to start")
        await asyncio.sleep(1.5)
        again = await job.kicker().with_labels(deduplicate_ttl=21600).kiq(1)
        assert again.deduplicated and again.task_id == first.task_id
        await broker.wait_all()
        await broker.shutdown()

    run(body())


def test_a_lock_lapses_within_its_lease_when_post_execute_never_runs() -> None:
    class Metrics(TaskiqMiddleware):  # its post_execute runs before ours, and raises
        def post_execute(self, message: Any, result: Any) -> None:
            raise RuntimeError("metrics backend down")

    dedup = DedupMiddleware(MemoryStore(), default_lease=0.6)
    broker = InMemoryBroker().with_middlewares(dedup, Metrics())
    done: list[int] = []

    @broker.task(deduplicate="until_executed")
    async def job(x: int) -> int:
        done.append(x)
        return x

    async def body() -> None:
        await broker.startup()
        await job.kiq(1)
        await until(lambda: done, 5, "the job to run")

        async def free() -> bool:
            again = await job.kicker().with_labels(deduplicate_ttl=21600).kiq(1)
            return not again.deduplicated

        deadline = asyncio.get_running_loop().time() + 0.6 + 5
        while not await free():
            assert asyncio.get_running_loop().time() < deadline, "the lock outlived its lease"
            await asyncio.sleep(0.05)
        assert not dedup.worker.runs
        await broker.shutdown()

    run(body())


def test_a_failed_retry_send_gives_the_lock_back() -> None:
    dedup = DedupMiddleware(MemoryStore(), default_lease=0.6)
    broker = InMemoryBroker().with_middlewares(dedup, SimpleRetryMiddleware(default_retry_count=3))
    runs: list[int] = []

    @broker.task(deduplicate={"strategy": "until_executed", "ttl": 3600}, retry_on_error=True)
    async def flaky(x: int) -> None:
        runs.append(x)
        raise RuntimeError("boom")

    async def body() -> None:
        await broker.startup()
        original = dedup.producer.original_kick
        assert original is not None

        async def kick(message: Any) -> None:
            if "_retries" in message.labels:
                raise ConnectionError("the broker blinked on the retry's send")
            await original(message)

        dedup.producer.original_kick = kick
        first = await flaky.kiq(1)
        await until(lambda: runs, 5, "the first attempt")
        await asyncio.sleep(0.5)
        dedup.producer.original_kick = original
        again = await flaky.kicker().with_labels(deduplicate_ttl=3600).kiq(1)
        assert not again.deduplicated and again.task_id != first.task_id
        await broker.wait_all()
        await broker.shutdown()

    run(body())


def test_kicks_from_inside_a_resent_copy_are_deduplicated() -> None:
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()))
    seen: list[tuple[bool, bool]] = []

    @broker.task(deduplicate="until_executed")
    async def child(x: int) -> None:
        await asyncio.sleep(1)

    @broker.task(deduplicate="while_executing")
    async def parent(n: int) -> None:
        a = await child.kicker().with_labels(deduplicate_ttl=600).kiq(n)
        b = await child.kicker().with_labels(deduplicate_ttl=600).kiq(n)
        seen.append((a.deduplicated, b.deduplicated))
        await asyncio.sleep(0.5)

    async def body() -> None:
        await broker.startup()
        await parent.kiq(1)
        await parent.kicker().with_labels(deduplicate_ttl=601).kiq(1)  # busy: sent again later
        await until(lambda: len(seen) == 2, 10, "both runs of parent")
        assert all(b for _, b in seen)  # the second kick of each run is a duplicate
        await broker.wait_all()
        await broker.shutdown()

    run(body())


def test_a_sync_task_cut_by_its_timeout_keeps_its_lock_and_slot_until_its_thread_ends() -> None:
    import threading
    import time

    from taskdedup import QuotaExceeded
    from taskdedup.taskiq import reserve

    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()))
    running: list[int] = []
    peak: list[int] = []
    lock = threading.Lock()

    @reserve(max_concurrent=1, scope="tenant")
    @broker.task(deduplicate={"strategy": "until_executed", "keys": ["x"]}, timeout=0.3)
    def job(x: int, tenant: str = "acme") -> int:
        with lock:
            running.append(x)
            peak.append(len(running))
        time.sleep(1.5)  # runs on in its thread after taskiq stopped waiting at 0.3 s
        with lock:
            running.remove(x)
        return x

    async def body() -> None:
        await broker.startup()
        first = await job.kiq(1)
        await until(lambda: running, 5, "the job to start")
        await asyncio.sleep(0.6)  # past the timeout: taskiq has given up on it
        again = await job.kiq(1)
        assert again.deduplicated and again.task_id == first.task_id
        with pytest.raises(QuotaExceeded):
            await job.kiq(2)  # its slot is still held too
        await until(lambda: not running, 5, "the thread to end")

        async def free() -> bool:
            try:
                return not (await job.kiq(1)).deduplicated
            except QuotaExceeded:
                return False

        deadline = asyncio.get_running_loop().time() + 5
        while not await free():
            assert asyncio.get_running_loop().time() < deadline, "the lock or slot stayed"
            await asyncio.sleep(0.05)
        await broker.wait_all()
        await broker.shutdown()

    run(body())
    assert max(peak) == 1
