"""A duplicate that arrives while the holder is still being published (its lock not yet
confirmed) must not be answered with a job that may never exist: if the holder's publish fails,
the duplicate becomes the job (issue 11, item 7). The store is apart from the broker here, the
path of RabbitMQ and of every store that is not the broker's own Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.exceptions import OperationalError

from harness import wait_for
from taskdedup.celery import deduplicate, install
from test_celery import make_app


def locks(url: str, prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"{prefix}:*lock"))
    finally:
        client.close()


@pytest.fixture
def app_apart(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    store_url = redis_url.rsplit("/", 1)[0] + "/1"  # another database: not the broker's
    app = make_app(redis_url, key_prefix, taskdedup_url=store_url)
    install(app)
    yield app
    from redis_server import delete_prefixed

    delete_prefixed(store_url, key_prefix)


def test_a_duplicate_of_a_holder_whose_publish_fails_becomes_the_job(
    app_apart: Celery, redis_url: str, key_prefix: str
) -> None:
    app = app_apart
    runs: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False, bind=True)
    def build(self: Any, sha: str) -> str:
        runs.append(self.request.id)
        return sha

    go = threading.Event()
    send = app.amqp.send_task_message

    def broker_fails_for_the_first(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "first":
            assert go.wait(20)
            raise OperationalError("the broker went away")
        return send(*args, **kwargs)

    app.amqp.send_task_message = broker_fails_for_the_first
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            build.delay("abc")
        except OperationalError as exc:
            outcome["first"] = exc

    def second() -> None:
        outcome["second"] = build.delay("abc")

    one = threading.Thread(target=first, name="first")
    one.start()
    store_url = redis_url.rsplit("/", 1)[0] + "/1"
    wait_for(lambda: locks(store_url, key_prefix), 10, "the first call to take the lock")
    two = threading.Thread(target=second, name="second")
    two.start()

    def second_asked() -> bool:  # the second call met the first's lock (counted once)
        client = redis.Redis.from_url(store_url)
        try:
            return any(client.hget(k, "d") == b"1" for k in locks(store_url, key_prefix))
        finally:
            client.close()

    wait_for(second_asked, 10, "the second call to meet the first's lock")
    go.set()  # the first publish fails now: the second call must become the job
    one.join(20)
    two.join(20)
    assert isinstance(outcome["first"], OperationalError)
    result = outcome["second"]
    assert not result.deduplicated, "answered with the first call's job, which never existed"
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert result.get(timeout=20) == "abc"
    assert runs == [result.id]


def test_a_duplicate_of_a_holder_stuck_in_its_publish_is_published_itself(
    app_apart: Celery, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose producer hangs (or died) mid-publish past HOLDER_WAIT is no answer: the
    duplicate is published on its own (a missed dedup at worst), never handed a job id that
    may never exist."""
    import taskdedup.core

    monkeypatch.setattr(taskdedup.core, "HOLDER_WAIT", 0.5)
    app = app_apart
    runs: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False, bind=True)
    def build(self: Any, sha: str) -> str:
        runs.append(self.request.id)
        return sha

    go = threading.Event()
    send = app.amqp.send_task_message

    def first_publish_hangs(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "first":
            assert go.wait(20)
            raise OperationalError("the producer never got through")
        return send(*args, **kwargs)

    app.amqp.send_task_message = first_publish_hangs
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            outcome["first"] = build.delay("abc")
        except OperationalError as exc:
            outcome["first"] = exc

    one = threading.Thread(target=first, name="first")
    one.start()
    store_url = redis_url.rsplit("/", 1)[0] + "/1"
    wait_for(lambda: locks(store_url, key_prefix), 10, "the first call to take the lock")
    try:
        result = build.delay("abc")  # waits HOLDER_WAIT for the first publish, then gives up
    finally:
        go.set()
        one.join(20)
    assert isinstance(outcome["first"], OperationalError)
    assert not result.deduplicated, "answered with a job whose publish never completed"
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert result.get(timeout=20) == "abc"
    assert runs == [result.id]
