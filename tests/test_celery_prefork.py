"""Celery with a real prefork worker in a subprocess: kill -9 and acks_late redelivery."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import wait_for
from worker_process import HERE, WorkerProcess


def delete_queue(app: Any, queue: str) -> None:
    with app.connection() as conn:
        conn.default_channel.queue_delete(queue)


def celery_worker(app_module: str) -> list[str]:
    """The prefork worker command line for the app in ``app_module`` (beside this file)."""
    return ["celery", "-A", app_module, *WORKER_ARGS]


WORKER_ARGS = [
    "worker",
    "--pool",
    "prefork",
    "--concurrency",
    "2",
    "--loglevel",
    "INFO",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
]
CELERY_WORKER = celery_worker("celery_worker_app")


def celery_ready(worker: WorkerProcess) -> bool:
    return worker.mark("ready") is not None


@pytest.fixture
def worker_env(redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TD_REDIS_URL", redis_url)
    monkeypatch.setenv("TD_PREFIX", key_prefix)
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("celery_worker_app", None)
    import celery_worker_app

    return celery_worker_app


@pytest.fixture
def start(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def launch(**env: str) -> WorkerProcess:
        worker = WorkerProcess(CELERY_WORKER, redis_url, key_prefix, tmp_path, celery_ready, **env)
        started.append(worker)
        return worker

    yield launch
    for worker in started:
        worker.stop()


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
    broker: str,
    start: Callable[..., WorkerProcess],
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    env = {}
    if broker == "amqp":
        from test_celery_amqp import AMQP_URL, amqp_answers

        if not amqp_answers():
            pytest.skip(f"no RabbitMQ answers at {AMQP_URL} (set TASKDEDUP_TEST_AMQP_URL)")
        env["TD_BROKER_URL"] = AMQP_URL
        monkeypatch.setenv("TD_BROKER_URL", AMQP_URL)
    worker_env = request.getfixturevalue("worker_env")
    worker = start(**env)
    if broker == "amqp":
        request.addfinalizer(lambda: delete_queue(worker_env.app, f"{key_prefix}-q"))
    job = worker_env.long_job.delay("k9", 60)
    pid = int(wait_for(lambda: worker.mark("pid:k9"), 30, "the job to start"))
    assert worker_env.long_job.delay("k9", 60).id == job.id  # held while it runs
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lease = 2.0

    def enqueue_fresh() -> Any:
        result = worker_env.long_job.delay("k9", 0)
        return None if result.deduplicated else result

    fresh = wait_for(enqueue_fresh, lease + 5, "the key to be free again")
    assert fresh.id != job.id
    freed_after = time.monotonic() - killed_at
    print(f"key free {freed_after:.2f}s after kill -9")
    assert freed_after <= lease + 5


def test_acks_late_redelivery_runs_the_body_once(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    # The broker hands an unacked message out again once it is older than the visibility
    # timeout (1 s here, checked every second); the job takes 6 s, so a second copy is
    # delivered to the other pool process while the first still runs.
    worker = start(TD_VISIBILITY_TIMEOUT="1")
    job = worker_env.late_job.delay("once", 6)
    assert job.get(timeout=60) == "once"
    log = worker.log_path
    assert "not running sub.late_job" in log.read_text(), "the broker never redelivered"
    assert int(worker.mark("runs:once") or 0) == 1
    # a copy of the finished job delivered again (same id) does not run again either
    worker_env.late_job.apply_async(("once", 6), task_id=job.id)
    wait_for(lambda: log.read_text().count("not running sub.late_job") >= 2, 30, "the refusal")
    assert int(worker.mark("runs:once") or 0) == 1


def test_a_redelivered_copy_of_an_attempt_that_was_retried_does_not_run_beside_the_retry(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    """Found by the soak. Attempt 0 runs longer than the visibility timeout, so the broker
    hands its message out again; the copy is sent back (its job runs). Attempt 0 then fails
    and is retried in 3 s. The copy, back meanwhile, used to run attempt 0 a second time,
    beside the retry. Each attempt must run once, never two at once."""
    worker = start(TD_VISIBILITY_TIMEOUT="1")
    job = worker_env.retried_late_job.delay("twice", 4)
    assert job.get(timeout=90) == "twice"
    assert "not running sub.retried_late_job" in worker.log_path.read_text(), "no redelivery"
    log = [
        line.decode().split()
        for line in worker.client.lrange(f"{worker.prefix}:mark:log:twice", 0, -1)
    ]
    starts = [entry[1] for entry in log if entry[0] == "start"]
    assert starts == [f"{job.id}/0", f"{job.id}/1"], log
    events = [entry[0] for entry in log]
    assert events == ["start", "end", "start", "end"], log  # never two at once


def test_a_later_attempt_waits_while_a_worker_runs_an_earlier_one(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    """Found by the soak: a retry whose bookkeeping never reached the store (it was down when
    attempt 0 asked for the retry) arrives while the job's record still says attempt 0 runs.
    It used to overtake that live run, being a later attempt, and run beside it. Here a real
    worker runs attempt 0 (6 s) when a delivery of attempt 1 of the same job, sent as it is
    (no store command, as such a retry was), reaches the other pool process: it must wait."""
    worker = start()
    job = worker_env.retried_late_job.delay("overtaken", 6)
    log_key = f"{worker.prefix}:mark:log:overtaken"
    wait_for(lambda: worker.client.llen(log_key) >= 1, 30, "attempt 0 to start")
    worker_env.retried_late_job.apply_async(
        ("overtaken", 6), task_id=job.id, retries=1, taskdedup_resend=True
    )
    assert job.get(timeout=90) == "overtaken"
    assert "not running sub.retried_late_job" in worker.log_path.read_text(), "never waited"
    log = [line.decode().split() for line in worker.client.lrange(log_key, 0, -1)]
    starts = [entry[1] for entry in log if entry[0] == "start"]
    assert starts == [f"{job.id}/0", f"{job.id}/1"], log  # attempt 1 runs once, after 0
    assert [entry[0] for entry in log] == ["start", "end", "start", "end"], log


def test_a_worker_killed_while_sending_a_retry_loses_no_job_and_strands_no_key(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    """kill -9 between the store's answer to the retry (the lock kept for it) and its publish:
    the broker delivers attempt 0 again (reject_on_worker_lost). That retry never went out, so
    once its grace passed unconfirmed the copy runs: the job ends, and is not stuck behind a
    retry that does not exist for the whole ttl."""
    worker = start(TD_GRACE="3")
    job = worker_env.killed_at_retry.delay("lost-retry")
    assert job.get(timeout=60) == "lost-retry"
    assert worker.mark("killed_at_retry"), "the pool process was not killed at the retry"
    log = worker.client.lrange(f"{worker.prefix}:mark:log:lost-retry", 0, -1)
    starts = [line.decode().split()[1] for line in log]
    assert starts.count(f"{job.id}/0") == 2 and starts[-1].endswith("/1"), starts


def test_acks_late_copy_takes_over_after_the_lease_when_the_holder_died(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    first = start(TD_VISIBILITY_TIMEOUT="1")
    job = worker_env.late_job.delay("orphan", 60)
    wait_for(lambda: first.mark("pid:orphan"), 30, "the job to start")
    os.killpg(first.proc.pid, signal.SIGKILL)  # the whole worker dies: nothing acks
    first.proc.wait(10)
    first.client.delete(f"{first.prefix}:mark:ready")
    second = start(TD_VISIBILITY_TIMEOUT="1")
    assert job.get(timeout=60) == "orphan"
    assert int(second.mark("runs:orphan") or 0) == 2  # the copy ran once the lease lapsed


def test_kill_9_of_the_worker_holding_a_slot_frees_it_within_lease_plus_5_seconds(
    worker_env: Any, start: Callable[..., WorkerProcess]
) -> None:
    from taskdedup import QuotaExceeded

    worker = start()
    worker_env.capped_job.delay("acme", 60)
    pid = int(wait_for(lambda: worker.mark("pid:acme"), 30, "the job to start"))
    with pytest.raises(QuotaExceeded, match="maximum 1 concurrent jobs for scope tenant=acme"):
        worker_env.capped_job.delay("acme", 0)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    lease = 2.0

    def submit() -> Any:
        try:
            return worker_env.capped_job.delay("acme", 0)
        except QuotaExceeded:
            return None

    wait_for(submit, lease + 5, "the slot to be free again")
    freed_after = time.monotonic() - killed_at
    print(f"slot free {freed_after:.2f}s after kill -9")
    assert freed_after <= lease + 5
