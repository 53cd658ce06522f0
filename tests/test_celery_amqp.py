"""Celery on RabbitMQ (amqp): the broker is not Redis, so the store URL is set explicitly.

Uses ``TASKDEDUP_TEST_AMQP_URL`` or amqp://guest:guest@127.0.0.1:5672//; skipped, with that
reason, when no broker answers. Each test declares its own queue and deletes it afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection

from harness import race
from taskdedup.celery import deduplicate, install

AMQP_URL = os.environ.get("TASKDEDUP_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def amqp_answers() -> bool:
    try:
        with Connection(AMQP_URL, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(
    not amqp_answers(), reason=f"no RabbitMQ answers at {AMQP_URL} (set TASKDEDUP_TEST_AMQP_URL)"
)


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    queue = f"{key_prefix}-q"
    app = Celery(key_prefix, broker=AMQP_URL, backend=redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:result:"},
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        taskdedup_url=redis_url,
        taskdedup_key_prefix=key_prefix,
        broker_heartbeat=0,
    )
    install(app)
    yield app
    with app.connection() as conn:
        conn.default_channel.queue_delete(queue)


def messages_in(app: Celery) -> int:
    with app.connection() as conn:
        declared = conn.default_channel.queue_declare(app.conf.task_default_queue, passive=True)
        return int(declared.message_count)


def test_32_threads_one_message_one_id_on_rabbitmq(app: Celery) -> None:
    runs: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> str:
        runs.append(sha)
        return sha

    results = race(32, lambda _: build.delay("abc"))
    assert len({r.id for r in results}) == 1
    deadline = time.monotonic() + 10
    while messages_in(app) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # RabbitMQ counts a published message a moment later
    assert messages_in(app) == 1
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert results[0].get(timeout=20) == "abc"
    assert runs == ["abc"]


def test_retries_hold_the_lock_on_rabbitmq(app: Celery) -> None:
    attempts: list[int] = []

    @deduplicate("until_executed", lease=5)
    @app.task(bind=True, shared=False, max_retries=5)
    def flaky(self: Any, n: int) -> str:
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.2)
        return "ok"

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        job = flaky.delay(1)
        while not job.ready():
            dup = flaky.delay(1)
            if dup.id != job.id:  # freed as its last attempt returned, before the result landed
                assert 2 in attempts, "the retrying job lost its lock"
                dup.get(timeout=20)
                break
            time.sleep(0.05)
        assert job.get(timeout=20) == "ok"
    assert attempts[:3] == [0, 1, 2]
    assert not flaky.delay(1).deduplicated
