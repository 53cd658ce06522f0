"""A compat job's worker killed with kill -9 mid-job: the peer's key is free again within the
lease + 5 s (celery-once holds it for the whole timeout, celery-singleton forever), for new
producers and for old ones (the original package, which only asks ``SET NX``).

These need no original package: they run the drop-ins only, with a real prefork worker in a
subprocess, and kill the pool process that a mark written from inside the job names.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness import wait_for
from taskdedup.compat import celery_once as compat_once
from test_celery_prefork import celery_worker
from worker_process import HERE, WorkerProcess

CELERY_WORKER = celery_worker("compat_worker_app")


@pytest.fixture
def lease() -> float:
    return 2.0


@pytest.fixture
def worker_app(
    redis_url: str,
    key_prefix: str,
    lease: float,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Any]:
    """The compat app of ``compat_worker_app``, imported here for the producer's side."""
    monkeypatch.setenv("TD_REDIS_URL", redis_url)
    monkeypatch.setenv("TD_PREFIX", key_prefix)
    monkeypatch.setenv("TD_LEASE", str(lease))
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("compat_worker_app", None)
    import compat_worker_app

    yield compat_worker_app
    for key in redis_client.scan_iter(match=f"qo_{key_prefix}*"):  # celery-once's keys
        redis_client.delete(key)


def _started(worker_app: Any, peer: str, lease: float, tmp_path: Path) -> tuple[Any, Any, Any]:
    """A worker running a 60 s job of ``peer``'s task, the task, and the job."""
    conf = worker_app.app.conf
    worker = WorkerProcess(
        CELERY_WORKER,
        conf.broker_url,
        conf.taskdedup_key_prefix,
        tmp_path,
        lambda w: w.mark("ready"),
        TD_LEASE=str(lease),
    )
    task = worker_app.once_job if peer == "once" else worker_app.singleton_job
    job = task.delay("k9", 60)
    return worker, task, job


def _new_job(task: Any, job: Any) -> Any:
    """A new job's handle for the key, or None while it is still held."""
    try:
        result = task.delay("k9", 0)
    except compat_once.AlreadyQueued:
        return None
    return None if result.id == job.id else result


def _peer_key(task: Any) -> str:
    return str(task.peer_key(("k9", 0), {}))


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_kill_9_mid_job_frees_the_compat_key_within_lease_plus_5_seconds(
    peer: str, worker_app: Any, lease: float, tmp_path: Path
) -> None:
    worker, task, job = _started(worker_app, peer, lease, tmp_path)
    try:
        pid = int(wait_for(lambda: worker.mark("pid:k9"), 30, "the job to start"))
        assert _new_job(task, job) is None  # held while it runs
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        fresh = wait_for(lambda: _new_job(task, job), lease + 5, "the key to be free again")
        freed_after = time.monotonic() - killed_at
        print(f"{peer}: key free {freed_after:.2f}s after kill -9")
        assert freed_after <= lease + 5
        assert fresh.get(timeout=30) == "k9"  # the new job runs
    finally:
        worker.stop()


@pytest.mark.parametrize("lease", [10.0])
@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_a_key_taken_again_for_a_killed_holder_lapses_with_its_lock(
    peer: str, worker_app: Any, lease: float, tmp_path: Path, redis_client: redis.Redis
) -> None:
    """The peer's key went away while taskdedup's lock still names the running job (an old
    worker's clear, ``clear_locks``, an expiry): a new producer puts the key back for that job,
    for what is left of its lock's life, not a whole lease more. After kill -9 a new producer
    asking all along gets the key within lease + 5 s; it gets it by ``SET NX``, as an old
    producer asks, so an old one would have got it at the same moment."""
    worker, task, job = _started(worker_app, peer, lease, tmp_path)
    try:
        pid = int(wait_for(lambda: worker.mark("pid:k9"), 30, "the job to start"))
        key = _peer_key(task)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        redis_client.delete(key)  # the peer's side freed its key; taskdedup's lock holds
        assert _new_job(task, job) is None  # the lock's holder answers, and names the key
        assert redis_client.get(key) == job.id.encode()
        assert 0 < redis_client.pttl(key) <= lease * 1000
        # and again late in the lock's life (the lease was renewed at most a third of it
        # before the kill, so the lock still holds): a key put back now with a whole lease
        # would outlive the lock by most of a lease
        time.sleep(max(0.0, killed_at + 0.6 * lease - time.monotonic()))
        assert redis_client.delete(key) == 1
        assert _new_job(task, job) is None
        assert redis_client.get(key) == job.id.encode()
        fresh = wait_for(lambda: _new_job(task, job), lease + 5, "a new producer to get the key")
        freed_after = time.monotonic() - killed_at
        print(f"{peer}: key free {freed_after:.2f}s after kill -9, asked all along")
        assert freed_after <= lease + 5
        assert fresh.get(timeout=30) == "k9"
    finally:
        worker.stop()
