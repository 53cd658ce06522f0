"""Celery: a revoked or expired job frees its lock and its reservation slot within seconds (G13).

Every scenario has a real worker that knows of the job when it is revoked or expires: a queued
job is revoked while a worker listens for control commands (but does not yet consume its queue),
then the worker consumes it and discards it; an ETA job is revoked once the worker reports it as
scheduled; a running job is terminated once its body has written a marker (prefork subprocess).
Without taskdedup's handling, each key would stay held for its ttl (6 h), or at least until the
ETA or the lease.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup import QuotaExceeded, ReservationGuard
from taskdedup.celery import deduplicate, install, reserve
from test_celery import make_app
from test_celery_prefork import CELERY_WORKER, celery_ready
from worker_process import HERE, WorkerProcess

FREED_WITHIN = 10.0  # seconds: "within a few seconds", generous for a busy 2-core machine
STRATEGIES = ["until_executing", "until_executed"]


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Celery:
    app = make_app(redis_url, key_prefix)
    install(app)
    return app


# ---------------------------------------------------------------- helpers


@contextmanager
def running_worker(app: Celery, *, consuming: bool = True) -> Iterator[str]:
    """An in-process worker; yields its hostname. ``consuming=False``: it listens for control
    commands but consumes only an idle queue, so the task queue's messages stay in the broker
    until ``consume_tasks``."""
    prefix = app.main
    hostname = f"revoke-{uuid.uuid4().hex[:8]}@{prefix}"
    queues = None if consuming else [f"{prefix}-idle"]
    with start_worker(app, pool="solo", perform_ping_check=False, hostname=hostname, queues=queues):
        yield hostname


def revoke(app: Celery, job_id: str, hostname: str, **options: Any) -> None:
    """Revoke like ``AsyncResult.revoke()``, and return once the worker has handled it."""
    wait_for(
        lambda: app.control.revoke(
            job_id, destination=[hostname], reply=True, limit=1, timeout=2, **options
        ),
        30,
        "the worker to answer the revoke",
    )


def consume_tasks(app: Celery, hostname: str) -> None:
    """Let the worker consume the task queue now."""
    queue = app.conf.task_default_queue
    wait_for(
        lambda: app.control.add_consumer(
            queue, destination=[hostname], reply=True, limit=1, timeout=2
        ),
        30,
        "the worker to consume the task queue",
    )


def scheduled_ids(app: Celery, hostname: str) -> set[str]:
    """The ids of the ETA/countdown jobs the worker holds, as ``inspect scheduled`` says."""
    replies = app.control.inspect([hostname], timeout=2).scheduled() or {}
    return {entry["request"]["id"] for entries in replies.values() for entry in entries}


def accepted(task: Any, *args: Any, **options: Any) -> Any:
    """A new submission of ``task(*args)``, or None while it is deduplicated onto a holder."""
    result = task.apply_async(args, **options)
    return None if result.deduplicated else result


def admitted(task: Any, *args: Any) -> Any:
    """A new submission of a capped task, or None while its scope is full."""
    try:
        return task.apply_async(args)
    except QuotaExceeded:
        return None


def held_then_freed(task: Any, job: Any, *args: Any) -> Any:
    """Wait until a new submission of the key is accepted: a new job, not ``job``."""
    began = time.monotonic()
    fresh = wait_for(lambda: accepted(task, *args), FREED_WITHIN, "the key to be free again")
    assert fresh.id != job.id
    print(f"key free {time.monotonic() - began:.2f}s after the revoke or expiry")
    return fresh


# ---------------------------------------------------------------- 1. a queued job


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_revoking_a_queued_job_frees_its_lock_when_the_worker_discards_it(
    app: Celery, strategy: str
) -> None:
    ran: list[str] = []

    @deduplicate(strategy)
    @app.task(shared=False)
    def build(sha: str) -> str:
        ran.append(sha)
        return sha

    with running_worker(app, consuming=False) as hostname:
        job = build.delay("abc")
        assert build.delay("abc").id == job.id  # held
        revoke(app, job.id, hostname)
        consume_tasks(app, hostname)  # the message reaches the worker, which discards it
        fresh = held_then_freed(build, job, "abc")
        assert fresh.get(timeout=30) == "abc"
    assert job.state == "REVOKED"
    assert ran == ["abc"]  # the fresh job only


def test_revoking_a_queued_capped_job_frees_its_slot(app: Celery) -> None:
    @reserve(max_concurrent=1, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str) -> str:
        return tenant

    guard = ReservationGuard(install(app).dedup.store)
    with running_worker(app, consuming=False) as hostname:
        job = sync.delay("acme")
        with pytest.raises(QuotaExceeded):
            sync.delay("acme")
        revoke(app, job.id, hostname)
        consume_tasks(app, hostname)
        wait_for(lambda: not guard.active("tenant=acme"), FREED_WITHIN, "the slot to be free")
        fresh = admitted(sync, "acme")
        assert fresh is not None and fresh.get(timeout=30) == "acme"
    assert job.state == "REVOKED"


# ---------------------------------------------------------------- 2. an ETA job a worker holds


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_revoking_an_eta_job_the_worker_holds_frees_its_lock_at_once(
    app: Celery, strategy: str
) -> None:
    ran: list[str] = []

    @deduplicate(strategy, including_scheduled=True)
    @app.task(shared=False)
    def report(day: str) -> str:
        ran.append(day)
        return day

    with running_worker(app) as hostname:
        job = report.apply_async(("monday",), countdown=120)
        wait_for(lambda: job.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
        assert report.delay("monday").id == job.id  # held
        revoke(app, job.id, hostname)
        fresh = held_then_freed(report, job, "monday")  # long before the ETA
        assert fresh.get(timeout=30) == "monday"
    assert ran == ["monday"]  # the fresh job only


def test_revoking_an_eta_capped_job_the_worker_holds_frees_its_slot_at_once(
    app: Celery,
) -> None:
    @reserve(max_concurrent=1, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str) -> str:
        return tenant

    guard = ReservationGuard(install(app).dedup.store)
    with running_worker(app) as hostname:
        job = sync.apply_async(("acme",), countdown=120)
        wait_for(lambda: job.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
        with pytest.raises(QuotaExceeded):
            sync.delay("acme")
        revoke(app, job.id, hostname)
        wait_for(lambda: not guard.active("tenant=acme"), FREED_WITHIN, "the slot to be free")
        fresh = admitted(sync, "acme")
        assert fresh is not None and fresh.get(timeout=30) == "acme"


def test_revoking_a_running_job_without_terminate_keeps_its_lock(app: Celery) -> None:
    """A plain revoke does not stop a job that runs: its key stays held until it ends."""
    import threading

    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> str:
        started.set()
        release.wait(30)
        return sha

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as w:
        job = build.delay("abc")
        assert started.wait(30)
        revoke(app, job.id, w.hostname)
        assert build.delay("abc").id == job.id  # still running: still held
        release.set()
        assert job.get(timeout=30) == "abc"
    assert accepted(build, "abc") is not None


# ---------------------------------------------------------------- 4. expiry


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_job_that_expired_in_the_queue_frees_its_lock_when_the_worker_drops_it(
    app: Celery, strategy: str
) -> None:
    ran: list[str] = []

    @deduplicate(strategy)
    @app.task(shared=False)
    def build(sha: str) -> str:
        ran.append(sha)
        return sha

    with running_worker(app, consuming=False) as hostname:
        job = build.apply_async(("abc",), expires=1)
        expired_at = time.time() + 1.5
        assert build.delay("abc").id == job.id  # held
        wait_for(lambda: time.time() > expired_at, 10, "the job to expire")
        consume_tasks(app, hostname)  # the worker gets it expired and drops it
        fresh = held_then_freed(build, job, "abc")
        assert fresh.get(timeout=30) == "abc"
    assert ran == ["abc"]


def test_an_expired_capped_job_frees_its_slot_when_the_worker_drops_it(app: Celery) -> None:
    @reserve(max_concurrent=1, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str) -> str:
        return tenant

    guard = ReservationGuard(install(app).dedup.store)
    with running_worker(app, consuming=False) as hostname:
        job = sync.apply_async(("acme",), expires=1)
        expired_at = time.time() + 1.5
        wait_for(lambda: time.time() > expired_at, 10, "the job to expire")
        assert [s.member for s in guard.active("tenant=acme")] == [job.id]
        consume_tasks(app, hostname)
        wait_for(lambda: not guard.active("tenant=acme"), FREED_WITHIN, "the slot to be free")
        fresh = admitted(sync, "acme")
        assert fresh is not None and fresh.get(timeout=30) == "acme"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_eta_job_that_will_expire_before_its_eta_frees_its_lock_early(
    app: Celery, strategy: str
) -> None:
    """countdown 120 s, expires 2 s: the worker holds it, then drops it as expired at its ETA;
    its key is free within seconds of the expiry, not at the ETA."""

    @deduplicate(strategy, including_scheduled=True)
    @app.task(shared=False)
    def report(day: str) -> str:
        return day

    with running_worker(app) as hostname:
        job = report.apply_async(("monday",), countdown=120, expires=2)
        wait_for(lambda: job.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
        fresh = held_then_freed(report, job, "monday")
        assert fresh.get(timeout=30) == "monday"


# ---------------------------------------------------------------- 3. terminate (prefork)


@pytest.fixture
def sub(redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/celery_worker_app.py, imported here for the producer side of the subprocess."""
    monkeypatch.setenv("TD_REDIS_URL", redis_url)
    monkeypatch.setenv("TD_PREFIX", key_prefix)
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("celery_worker_app", None)
    import celery_worker_app

    return celery_worker_app


@pytest.fixture
def prefork(redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A prefork worker (2 processes) in a subprocess, running tests/celery_worker_app.py."""
    worker = WorkerProcess(CELERY_WORKER, redis_url, key_prefix, tmp_path, celery_ready)
    yield worker
    worker.stop()


def terminate_frees(worker: WorkerProcess, task: Any, name: str, **revoke: Any) -> Any:
    """Start a long job, wait for its body's marker, terminate it: a new job of its key is
    accepted within seconds (the lease is 60 s) and runs."""
    job = task.delay(name, 120)
    wait_for(lambda: worker.mark(f"pid:{name}"), 30, "the body to start")
    assert task.delay(name, 0).id == job.id  # held while it runs
    job.revoke(terminate=True, **revoke)
    fresh = held_then_freed(task, job, name, 0)
    assert fresh.get(timeout=30) == name
    wait_for(lambda: job.state == "REVOKED", 10, "the job to be marked revoked")
    return job


# SIGTERM: billiard raises SystemExit in the body, so the worker's own finish frees the key;
# SIGKILL (what users pass for a job that ignores SIGTERM): only the revoke handling can.
SIGNALS = ["SIGTERM", "SIGKILL"]


@pytest.mark.parametrize("sig", SIGNALS)
def test_terminating_a_running_until_executed_job_frees_its_lock_before_its_lease(
    sub: Any, prefork: WorkerProcess, sig: str
) -> None:
    terminate_frees(prefork, sub.revoke_until_executed, "t1", signal=sig)


@pytest.mark.parametrize("sig", SIGNALS)
def test_terminating_a_running_job_lets_the_next_one_of_its_key_run_at_once(
    sub: Any, prefork: WorkerProcess, sig: str
) -> None:
    """until_and_while_executing: the next job is accepted while the first runs, and waits
    for the run lock (lease 60 s); terminating the first lets it run within seconds."""
    task = sub.revoke_until_and_while
    first = task.delay("t2", 120)
    wait_for(lambda: prefork.mark("pid:t2"), 30, "the body to start")
    second = task.delay("t2", 0)
    assert second.id != first.id
    wait_for(
        lambda: "not running sub.revoke_until_and_while" in prefork.log_path.read_text(),
        30,
        "the second job to wait for the run lock",
    )
    first.revoke(terminate=True, signal=sig)
    assert second.get(timeout=FREED_WITHIN) == "t2"


@pytest.mark.parametrize("sig", SIGNALS)
def test_terminating_a_running_capped_job_frees_its_slot_before_its_lease(
    sub: Any, prefork: WorkerProcess, sig: str
) -> None:
    task = sub.revoke_capped  # until_executing (no lock while it runs), slot lease 60 s
    job = task.delay("acme", 120)
    wait_for(lambda: prefork.mark("pid:acme"), 30, "the body to start")
    with pytest.raises(QuotaExceeded):
        task.delay("acme", 0)
    job.revoke(terminate=True, signal=sig)
    fresh = wait_for(lambda: admitted(task, "acme", 0), FREED_WITHIN, "the slot to be free")
    assert fresh.get(timeout=30) == "acme"


def test_a_terminated_job_that_survives_the_signal_cannot_keep_its_lock_by_heartbeat(
    sub: Any, prefork: WorkerProcess
) -> None:
    """The body ignores SIGUSR2 and runs on, and so does its heartbeat (lease 6 s, renewed
    every 2 s, which would keep the lock for ever). Celery reports the job terminated: its
    key is free within seconds and stays free while the heartbeat goes on."""
    task = sub.revoke_survivor
    terminate_frees(prefork, task, "s1", signal="SIGUSR2")
    pid = int(prefork.mark("pid:s1") or 0)
    ticks = int(prefork.mark("ticks:s1") or 0)
    wait_for(lambda: int(prefork.mark("ticks:s1") or 0) >= ticks + 10, 30, "5 s more of body")
    os.kill(pid, 0)  # the terminated body still runs (ProcessLookupError if it died)
    assert accepted(task, "s1", 0) is not None


# ---------------------------------------------------------------- 5. the store is down then


def test_a_revoke_while_the_store_stalls_frees_the_lock_once_it_answers(
    redis_url: str, key_prefix: str
) -> None:
    # The worker holds an ETA job; the store stalls (SIGSTOP) when the job is revoked, so the
    # release cannot be made then. It must be made once the store answers again, not leave
    # the key held for the ETA and the ttl (G13).
    from redis_server import PrivateRedis

    with PrivateRedis() as store:
        app = make_app(redis_url, key_prefix, taskdedup_url=store.url + "?socket_timeout=1")
        install(app)

        @deduplicate("until_executed", including_scheduled=True)
        @app.task(shared=False)
        def report(day: str) -> str:
            return day

        with running_worker(app) as hostname:
            job = report.apply_async(("monday",), countdown=120)
            wait_for(lambda: job.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
            assert report.delay("monday").id == job.id  # held
            store.pause()
            try:
                revoke(app, job.id, hostname)  # the worker's release meets the stall
            finally:
                store.resume()
            fresh = held_then_freed(report, job, "monday")
            assert fresh.get(timeout=30) == "monday"


def test_revoking_a_debounced_burst_held_back_by_the_worker_frees_its_key_at_once(
    app: Celery,
) -> None:
    """A burst's job comes before its run is due and the worker holds it back (a countdown);
    revoking it ends the burst: the key is free at once (not after max_wait), the revoked job
    never runs, and the next submission starts a burst of its own that runs."""
    ran: list[int] = []

    @deduplicate("debounce", delay=30, max_wait=120, keys=["doc"])
    @app.task(shared=False)
    def reindex(doc: str, n: int) -> int:
        ran.append(n)
        return n

    with running_worker(app) as hostname:
        burst = reindex.delay("d", 0)
        assert reindex.delay("d", 1).id == burst.id  # folded into the burst
        wait_for(lambda: burst.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
        revoke(app, burst.id, hostname)
        fresh = held_then_freed(reindex, burst, "d", 2)  # long before the 30 s delay
        wait_for(lambda: fresh.id in scheduled_ids(app, hostname), 30, "the next burst's job")
    assert ran == []  # the revoked burst never ran (the next one is due in 30 s)
