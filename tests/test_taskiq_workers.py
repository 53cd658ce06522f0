"""taskiq with real ``taskiq worker`` processes on taskiq-redis brokers (ListQueueBroker and
RedisStreamBroker): kill -9 mid-job, a redelivered copy, retries in both middleware orders, and
32 concurrent kicks on the fused acquire-and-push path.

The producer side runs in the test process (its own event loop per test, ``asyncio.run``); the
workers are subprocesses importing ``taskiq_worker_app`` with this test's key prefix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import redis

from harness import wait_for
from worker_process import HERE, WorkerProcess

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 120))


TASKIQ_WORKER = [
    "taskiq",
    "worker",
    "taskiq_worker_app:broker",
    "--workers",
    "1",
    "--log-level",
    "INFO",
    "--shutdown-timeout",
    "5",
]


def children_ready(worker: WorkerProcess) -> bool:
    return bool(list(worker.client.scan_iter(match=f"{worker.prefix}:mark:ready:*")))


@pytest.fixture
def app_env(redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Import the worker app in the test process too (the producer side), configured alike."""

    def load(**env: str) -> ModuleType:
        monkeypatch.setenv("TD_REDIS_URL", redis_url)
        monkeypatch.setenv("TD_PREFIX", key_prefix)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.syspath_prepend(str(HERE))
        sys.modules.pop("taskiq_worker_app", None)
        import taskiq_worker_app

        return taskiq_worker_app

    return load


@pytest.fixture
def start(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def launch(*options: str, **env: str) -> WorkerProcess:
        worker = WorkerProcess(
            [*TASKIQ_WORKER, *options], redis_url, key_prefix, tmp_path, children_ready, **env
        )
        started.append(worker)
        return worker

    yield launch
    for worker in started:
        worker.stop()
    client = redis.Redis.from_url(redis_url)  # the stream broker's claim lock is not prefixed
    client.delete(f"autoclaim:{key_prefix}-group:{key_prefix}-stream")
    client.close()


async def with_broker(app: ModuleType, body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    await app.broker.startup()
    try:
        return await body()
    finally:
        await app.broker.shutdown()


@pytest.mark.parametrize("broker", ["list", "stream"])
@pytest.mark.parametrize("task", ["long_job", "sync_job"])
def test_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
    broker: str, task: str, app_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    app = app_env(TD_BROKER=broker)
    worker = start(TD_BROKER=broker)
    job_task = getattr(app, task)
    lease = 2.0

    async def body() -> float:
        job = await job_task.kiq("k9", 60)
        pid = int(await asyncio.to_thread(wait_for, lambda: worker.mark("pid:k9"), 30, "start"))
        again = await job_task.kiq("k9", 60)
        assert again.deduplicated and again.task_id == job.task_id  # held while it runs
        os.kill(pid, signal.SIGKILL)  # the worker child dies mid-job
        killed_at = time.monotonic()
        while True:
            fresh = await job_task.kiq("k9", 0)
            if not fresh.deduplicated:
                assert fresh.task_id != job.task_id
                return time.monotonic() - killed_at
            assert time.monotonic() - killed_at < lease + 5, "the key is still held"
            await asyncio.sleep(0.05)

    freed_after = run(with_broker(app, body))
    print(f"key free {freed_after:.2f}s after kill -9")
    assert freed_after <= lease + 5


def test_a_sync_task_in_a_process_pool_holds_its_key_while_it_runs(
    app_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    """``taskiq worker --use-process-pool``: the sync task runs in a pool process (another
    pid than the worker's), its key is held meanwhile and free once it has finished."""
    app = app_env(TD_BROKER="list")
    worker = start("--use-process-pool", TD_BROKER="list")

    async def body() -> None:
        job = await app.sync_job.kiq("pool", -1)  # runs until released (past its 2 s lease)
        pid = int(await asyncio.to_thread(wait_for, lambda: worker.mark("pid:pool"), 30, "start"))
        receivers = worker.client.scan_iter(match=f"{worker.prefix}:mark:ready:*")
        assert pid not in {int(name.rsplit(b":", 1)[1]) for name in receivers}  # a pool process
        again = await app.sync_job.kiq("pool", 0)
        assert again.deduplicated and again.task_id == job.task_id
        await asyncio.sleep(3)  # past the 2 s lease: the worker renews it for the pool's job
        again = await app.sync_job.kiq("pool", 0)
        assert again.deduplicated and again.task_id == job.task_id
        worker.client.set(f"{worker.prefix}:mark:release:pool", 1, ex=600)
        result = await job.wait_result(timeout=60)
        assert result.return_value == "pool" and not result.is_err
        # the finished job sent again: skipped inside the pool, which must survive that
        await app.sync_job.kicker().with_task_id(job.task_id).kiq("pool", 0)
        skipped = f"{job.task_id}]: done"
        await asyncio.to_thread(
            wait_for, lambda: skipped in worker.log_path.read_text(), 30, "the copy to be skipped"
        )
        fresh = await app.sync_job.kiq("pool", 0)
        assert not fresh.deduplicated
        await fresh.wait_result(timeout=60)

    run(with_broker(app, body))
    assert worker.mark("runs:pool") == b"2"


def test_kill_9_while_a_job_waits_for_a_full_scope_loses_nothing(
    app_env: Any, start: Callable[..., WorkerProcess], key_prefix: str
) -> None:
    """A job whose reservation lapsed in the queue finds its scope full at start and waits
    to be sent again. The worker is killed in that wait: on a broker with acknowledgements
    the delivery was not acknowledged, so another worker gets it and runs it once."""
    from taskdedup import ReservationGuard

    env = {"TD_BROKER": "stream", "TD_IDLE_MS": "1000"}
    app = app_env(**env)
    guard = ReservationGuard(app.dedup.dedup.store)

    async def body() -> None:
        job = await app.capped.kiq("acme")
        await asyncio.to_thread(
            wait_for, lambda: not guard.active("tenant=acme"), 10, "the reservation to lapse"
        )
        outsider = guard.reserve("tenant=acme", 1, ttl=60)  # the scope is full again
        first = start(**env)
        await asyncio.to_thread(
            wait_for, lambda: "is full" in first.log_path.read_text(), 30, "the job to wait"
        )
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        outsider.release()
        second = start(**env)

        def ran() -> bool:
            # taskiq-redis looks for unacknowledged messages only after a read that returned
            # something: keep it reading
            asyncio.run_coroutine_threadsafe(app.capped.kiq(f"other-{time.monotonic()}"), loop)
            return second.mark("runs:acme") == b"1"

        loop = asyncio.get_running_loop()
        await asyncio.to_thread(wait_for, ran, 60, "the job to run on the other worker")
        assert (await job.wait_result(timeout=30)).return_value == "acme"

    run(with_broker(app, body))


def test_a_graceful_stop_does_not_wait_out_a_copy_of_a_running_job(
    app_env: Any, start: Callable[..., WorkerProcess], redis_client: redis.Redis, key_prefix: str
) -> None:
    """A second delivery of a running job comes back after the lease (here 21 s). A worker
    told to stop meanwhile sends that copy at once and exits, instead of holding it."""
    app = app_env(TD_BROKER="list")
    worker = start(TD_BROKER="list")

    async def body() -> float:
        job_id = uuid.uuid4().hex
        await app.leased.kicker().with_task_id(job_id).kiq("held", 2)
        await asyncio.to_thread(wait_for, lambda: worker.mark("runs:held"), 30, "the job")
        await app.leased.kicker().with_task_id(job_id).kiq("held", 2)  # a second delivery
        await asyncio.to_thread(
            wait_for, lambda: "running (holder" in worker.log_path.read_text(), 30, "the copy"
        )
        asked_at = time.monotonic()
        os.killpg(worker.proc.pid, signal.SIGTERM)
        await asyncio.to_thread(worker.proc.wait, 60)
        return time.monotonic() - asked_at

    stopped_after = run(with_broker(app, body))
    assert stopped_after < 15, f"the worker took {stopped_after:.1f}s to stop"
    assert worker.mark("runs:held") == b"1"
    assert redis_client.llen(f"{key_prefix}-q") == 1  # the copy, sent as the worker stopped


def test_list_queue_broker_32_concurrent_kiqs_push_one_message(
    app_env: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = app_env(TD_BROKER="list")

    async def body() -> list[Any]:
        return await asyncio.gather(*(app.long_job.kiq("same", 1) for _ in range(32)))

    handles = run(with_broker(app, body))
    assert len({h.task_id for h in handles}) == 1
    assert sum(not h.deduplicated for h in handles) == 1
    assert redis_client.llen(f"{key_prefix}-q") == 1


def test_stream_broker_redelivered_copy_is_skipped_and_acknowledged(
    app_env: Any, start: Callable[..., WorkerProcess], redis_client: redis.Redis, key_prefix: str
) -> None:
    # An unacked message older than 1 s is claimed again by the other worker process while
    # the first still runs it (6 s): the copy must not run, and must be acknowledged. (The
    # broker looks for stale messages only after a read that returned something, so the test
    # keeps sending small jobs until a copy shows up.)
    env = {"TD_BROKER": "stream", "TD_IDLE_MS": "1000"}
    app = app_env(**env)
    first = start(**env)
    second = start(**env)
    stream, group = f"{key_prefix}-stream", f"{key_prefix}-group"

    def logs() -> str:
        return first.log_path.read_text() + second.log_path.read_text()

    async def body() -> Any:
        job = await app.long_job.kiq("once", 6)
        poke = 0
        while "not running sub.long_job" not in logs() and not await job.is_ready():
            poke += 1
            await app.long_job.kiq(f"poke-{poke}", 0)
            await asyncio.sleep(0.3)
        return await job.wait_result(timeout=60)

    result = run(with_broker(app, body))
    assert result.return_value == "once"
    assert "not running sub.long_job" in logs(), "the broker never redelivered the message"
    assert int(first.mark("runs:once") or 0) == 1

    def all_acked() -> bool:
        return int(redis_client.xpending(stream, group)["pending"]) == 0

    wait_for(all_acked, 20, "every delivery to be acknowledged")
    # the copy sent again after the lease finds the job done: dropped, not run
    wait_for(
        lambda: "done (holder" in first.log_path.read_text() + second.log_path.read_text(),
        20,
        "the copy to come back and be dropped",
    )
    wait_for(all_acked, 20, "the copy's delivery to be acknowledged")
    assert int(first.mark("runs:once") or 0) == 1


@pytest.mark.parametrize("retry", ["simple", "smart"])
@pytest.mark.parametrize("order", ["dedup first", "retry first"])
def test_a_retrying_task_holds_its_lock_throughout_on_a_real_worker(
    retry: str, order: str, app_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    env = {"TD_BROKER": "list", "TD_ORDER": order, "TD_RETRY": retry}
    app = app_env(**env)
    worker = start(**env)

    async def body() -> Any:
        job = await app.flaky.kiq("r")
        while not await job.is_ready():
            dup = await app.flaky.kiq("r")
            if not dup.deduplicated:  # freed as the last attempt ended, before its result landed
                assert int(worker.mark("runs:r") or 0) >= 3, "the retry lost its lock"
                await dup.wait_result(timeout=60)
                break
            assert dup.task_id == job.task_id
            await asyncio.sleep(0.05)
        result = await job.wait_result(timeout=30)
        fresh = await app.flaky.kiq("r")  # released after the success
        assert not fresh.deduplicated
        return result

    result = run(with_broker(app, body))
    assert result.return_value == "r after 2 retries"
    assert int(worker.mark("runs:r") or 0) >= 3


def test_the_taskiq_example_runs(redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE.parent / "examples" / "taskiq_app.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "same job: True, deduplicated: True" in done.stdout
    assert "DuplicateJob" in done.stdout and "synced after 2 retries" in done.stdout
    assert "new job: True" in done.stdout
