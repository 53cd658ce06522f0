"""taskdedup's guarantees, carried into the drop-ins where the peers leave room: a revoked or
expired job frees its key (the peers keep it until the timeout, or forever), a retry keeps
it, and the CLI and the metrics see compat jobs and their duplicates."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from harness import wait_for
from taskdedup.compat.celery_once import AlreadyQueued, QueueOnce
from taskdedup.compat.celery_singleton import Singleton
from taskdedup.metrics import install_metrics
from test_celery_revoke import revoke, running_worker, scheduled_ids
from test_cli import taskdedup


@pytest.fixture
def app(redis_url: str, key_prefix: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = Celery("guarantees", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:result:"},
        task_default_queue=f"{key_prefix}-q",
        taskdedup_key_prefix=key_prefix,
        taskdedup_default_lease=5,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_url, "default_timeout": 600},
        },
        singleton_key_prefix=f"{key_prefix}:SINGLETONLOCK_",
        worker_hijack_root_logger=False,
    )
    yield app
    for key in redis_client.scan_iter(match=f"qo_{key_prefix}*"):
        redis_client.delete(key)


def peer_keys(client: redis.Redis, key_prefix: str) -> list[bytes]:
    found = [*client.scan_iter(match=f"qo_{key_prefix}*")]
    return [*found, *client.scan_iter(match=f"{key_prefix}:SINGLETONLOCK_*")]


def native_locks(client: redis.Redis, key_prefix: str) -> list[bytes]:
    return [k for k in client.scan_iter(match=f"{key_prefix}:{{*}}:lock")]


def declare(app: Celery, peer: str, key_prefix: str, **extra: Any) -> Any:
    name = f"{key_prefix}.{peer}"
    if peer == "once":
        options: dict[str, Any] = {"base": QueueOnce, "once": {"keys": ["item"]}}
    else:
        options = {"base": Singleton, "unique_on": ["item"]}
    return app.task(name=name, shared=False, **options, **extra)


def submit(task: Any, *args: Any, **options: Any) -> Any:
    """The call's result, or None when celery-once's AlreadyQueued answered it."""
    try:
        return task.apply_async(args, **options)
    except AlreadyQueued:
        return None


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_revoking_an_eta_job_the_worker_holds_frees_both_keys_at_once(
    app: Celery, peer: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    @declare(app, peer, key_prefix)
    def job(item: str) -> str:
        return item

    with running_worker(app) as hostname:
        held = job.apply_async(("r",), countdown=120)
        wait_for(lambda: held.id in scheduled_ids(app, hostname), 30, "the worker to hold it")
        assert peer_keys(redis_client, key_prefix) and native_locks(redis_client, key_prefix)
        duplicate = submit(job, "r")
        assert duplicate is None or duplicate.id == held.id  # held, countdown or not
        revoke(app, held.id, hostname)
        wait_for(
            lambda: (
                not peer_keys(redis_client, key_prefix)
                and not native_locks(redis_client, key_prefix)
            ),
            10,
            "the revoked job's keys to be freed (its ETA is two minutes away)",
        )
        again = submit(job, "r")
        assert again is not None and again.id != held.id
        assert again.get(timeout=20) == "r"


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_a_job_that_expired_in_the_queue_frees_both_keys(
    app: Celery, peer: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    @declare(app, peer, key_prefix)
    def job(item: str) -> str:
        return item

    stale_at = datetime.now(timezone.utc) + timedelta(seconds=0.6)
    stale = job.apply_async(("e",), expires=datetime.now(timezone.utc) + timedelta(seconds=0.5))
    assert peer_keys(redis_client, key_prefix)
    wait_for(lambda: datetime.now(timezone.utc) > stale_at, 5, "the job to expire")
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        wait_for(lambda: not peer_keys(redis_client, key_prefix), 20, "the key to be freed")
        fresh = submit(job, "e")
        assert fresh is not None and fresh.id != stale.id
        assert fresh.get(timeout=20) == "e"


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_a_retrying_job_keeps_its_key_until_its_last_attempt_ends(
    app: Celery, peer: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    attempts: list[int] = []
    last = threading.Event()

    @declare(app, peer, key_prefix, bind=True, max_retries=3)
    def job(self: Any, item: str) -> str:
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.3)
        assert last.wait(20)  # the last attempt ends when the test has seen it run
        return item

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        first = job.delay("t")
        wait_for(lambda: attempts, 20, "the first attempt")
        deadline = time.monotonic() + 20
        while len(attempts) < 3:  # between attempts the key stays held, for both sides
            assert time.monotonic() < deadline, f"only attempts {attempts} ran in 20 s"
            duplicate = submit(job, "t")
            assert duplicate is None or duplicate.id == first.id
            assert peer_keys(redis_client, key_prefix)
        duplicate = submit(job, "t")  # and while the last attempt runs
        assert duplicate is None or duplicate.id == first.id
        last.set()
        assert first.get(timeout=20) == "t"
        wait_for(lambda: not peer_keys(redis_client, key_prefix), 10, "the key to be freed")
    assert attempts == [0, 1, 2]


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_the_cli_lists_a_compat_job_and_the_metrics_count_its_duplicates(
    app: Celery, peer: str, key_prefix: str, redis_url: str
) -> None:
    registry = CollectorRegistry()
    install_metrics(registry)

    @declare(app, peer, key_prefix)
    def job(item: str) -> str:
        return item

    held = job.delay("m")
    submit(job, "m")  # a duplicate, answered by the peer's key
    shown = taskdedup("--url", redis_url, "--prefix", key_prefix, "locks", "--json")
    assert shown.returncode == 0, shown.stderr
    assert held.id in shown.stdout and job.name in shown.stdout
    record = next(json.loads(line) for line in shown.stdout.splitlines() if held.id in line)
    told = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", record["key"])
    assert f"accepted: {held.id} took the key ({job.name})" in told.stdout, told.stdout
    counted = registry.get_sample_value(
        "taskdedup_decisions_total",
        {"task": job.name, "decision": "enqueue", "outcome": "duplicate"},
    )
    assert counted == 1
