"""taskiq under faults, with real ``taskiq worker`` processes on taskiq-redis brokers: a worker
killed with kill -9 mid-job, then its job delivered again while a newer job of the same key
runs (G12); a store that stalls while a worker claims a job (G13, G14)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness import wait_for
from redis_server import PrivateRedis
from test_faults_celery import confirmed_locks, intervals, runs_of, stalled_store  # noqa: F401
from test_taskiq_workers import app_env, run, start, with_broker  # noqa: F401  (fixtures)
from worker_process import WorkerProcess


def test_a_copy_of_a_killed_job_never_runs_beside_the_newer_job_of_its_key(
    app_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    # until_executed on a stream broker with acknowledgements (idle timeout 1 s). Job A runs;
    # its worker is killed; A's lease lapses and a new job B of the key is accepted. A second
    # worker reads B and claims A's unacknowledged message again: A is stale and must not run
    # beside B; it runs after B, with a newer fencing token.
    env = {"TD_BROKER": "stream", "TD_IDLE_MS": "1000"}
    app = app_env(**env)
    first = start(**env)
    killed_at = 0.0

    async def body() -> tuple[Any, Any, WorkerProcess]:
        nonlocal killed_at
        a = await app.fenced.kiq("k", 60)
        await asyncio.to_thread(wait_for, lambda: first.mark("pid:k"), 30, "A to start")
        os.killpg(first.proc.pid, signal.SIGKILL)
        killed_at = time.time()
        first.proc.wait(10)
        first.client.set(f"{first.prefix}:mark:sleep:k", 3, ex=600)  # later runs take 3 s
        deadline = time.monotonic() + 15
        while (b := await app.fenced.kiq("k", 60)).deduplicated:
            assert time.monotonic() < deadline, "the key is still held after A's lease"
            await asyncio.sleep(0.05)
        second = await asyncio.to_thread(start, **env)
        b_result = await b.wait_result(timeout=60)
        a_result = await a.wait_result(timeout=60)  # A was not lost: it ran after B
        return a_result, b_result, second

    a_result, b_result, second = run(with_broker(app, body))
    assert not a_result.is_err and not b_result.is_err
    runs = intervals(runs_of(second, "k"), killed_at)
    assert [job for _, _, job, _ in runs].count(a_result.return_value) == 2, runs
    for (_, end, job, _), (start_next, _, job_next, _) in itertools.pairwise(runs):
        assert end <= start_next, f"{job} and {job_next} ran at once: {runs}"
    fences = [int(fence) for _, _, _, fence in runs]
    assert fences == sorted(fences) and len(set(fences)) == len(fences), runs


@pytest.mark.parametrize("broker", ["list", "stream"])
@pytest.mark.parametrize("on_store_error", ["enqueue", "raise"])
def test_a_job_whose_claim_meets_a_stalled_store_runs_once_it_answers_and_frees_its_key(
    broker: str,
    on_store_error: str,
    stalled_store: PrivateRedis,  # noqa: F811
    app_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    # A job is accepted (its lock is in the store); the store then stalls (SIGSTOP) while a
    # worker claims the job. The job must neither fail nor run unguarded: it is sent back to
    # the broker and runs, once, when the store answers again; then its key is free.
    env = {
        "TD_BROKER": broker,
        "TD_STORE_URL": stalled_store.url + "?socket_timeout=1",
        "TD_ON_STORE_ERROR": on_store_error,
    }
    app = app_env(**env)

    resumed_at = 0.0

    async def body() -> tuple[Any, WorkerProcess, Any]:
        nonlocal resumed_at
        job = await app.fenced.kiq("s", 0.2)
        await asyncio.to_thread(
            wait_for, lambda: confirmed_locks(stalled_store.url), 10, "the lock to be confirmed"
        )
        stalled_store.pause()
        worker = await asyncio.to_thread(start, **env)

        def met_the_stall() -> bool:
            text = worker.log_path.read_text()
            failed_twice = text.count("claim store_unavailable") >= 2
            return failed_twice or "finish store_unavailable" in text

        deadline = time.monotonic() + 60
        while not met_the_stall() and not await job.is_ready():
            assert time.monotonic() < deadline, "the worker never met the stalled store"
            await asyncio.sleep(0.05)
        resumed_at = time.time()
        stalled_store.resume()
        result = await job.wait_result(timeout=60)
        deadline = time.monotonic() + 2 + 5
        while (fresh := await app.fenced.kiq("s", 0)).deduplicated:
            assert time.monotonic() < deadline, "the key is still held after the job"
            await asyncio.sleep(0.05)
        assert fresh.task_id != job.task_id
        return job, worker, result

    job, worker, result = run(with_broker(app, body))
    assert not result.is_err, result.error
    runs = [entry for entry in runs_of(worker, "s") if entry[:2] == ("start", job.task_id)]
    assert len(runs) == 1, runs
    assert runs[0][3] >= resumed_at, "the job ran while the store could not guard it"


def test_a_deferred_copy_is_not_lost_when_its_worker_dies_before_sending_it(
    app_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    # A stream broker with acknowledgements (idle timeout 1 s). Job J runs on worker 1, which
    # is killed: J's lease (15 s) is still alive when worker 2 claims J's message again, so
    # worker 2 defers it (a copy in 16 s). Worker 2 is killed before it sends that copy. The
    # delivery must still be in the broker (not acknowledged before its copy was out), so
    # worker 3 gets it and J runs to the end.
    env = {"TD_BROKER": "stream", "TD_IDLE_MS": "1000"}
    app = app_env(**env)
    first = start(**env)

    async def body() -> Any:
        job = await app.held.kiq("h", 60)
        await asyncio.to_thread(wait_for, lambda: first.mark("pid:h"), 30, "J to start")
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        first.client.set(f"{first.prefix}:mark:sleep:h", 0.2, ex=600)  # later runs are short
        second = await asyncio.to_thread(start, **env)
        # taskiq-redis claims unacknowledged messages again only after a read that found new
        # ones: a new message now and then makes the worker look
        deferred = f"not running sub.held[{job.task_id}]: running"
        deadline = time.monotonic() + 30
        while deferred not in second.log_path.read_text():
            assert time.monotonic() < deadline, "worker 2 never deferred J"
            await app.held.kiq(f"nudge-2-{time.monotonic()}", 0)
            await asyncio.sleep(0.5)
        os.killpg(second.proc.pid, signal.SIGKILL)
        second.proc.wait(10)
        await asyncio.to_thread(start, **env)
        deadline = time.monotonic() + 60
        while first.client.get(f"{first.prefix}:mark:runs:h") != b"2":
            assert time.monotonic() < deadline, "J never ran again: its delivery was lost"
            await app.held.kiq(f"nudge-3-{time.monotonic()}", 0)  # make worker 3 look
            await asyncio.sleep(1)
        return await job.wait_result(timeout=60)

    result = run(with_broker(app, body))
    assert not result.is_err and result.return_value == "h"
