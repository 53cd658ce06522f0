"""A Celery delivery the broker will not take back, after STAY_AT_MOST: never the other run's key.

When a worker must send a delivery back (its key busy, or a copy of a job running elsewhere)
and the broker refuses for STAY_AT_MOST seconds, the delivery gives up. Only when the store
never answered is the lock its own to free (G5). A copy of a running job must neither free that
job's key (a new job would run beside it, G12) nor be lost: with acks_late it is rejected with
requeue, so the broker keeps it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun

from harness import wait_for
from taskdedup import RedisStore, delivery
from taskdedup.celery import deduplicate, install
from taskdedup.celery import worker as celery_worker
from taskdedup.celery.messages import KEY_HEADER, RESEND_OPTION
from taskdedup.stores.base import Inspect
from test_celery import make_app


def test_a_copy_of_a_running_job_that_cannot_be_sent_back_leaves_that_jobs_key_held(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app: Celery = make_app(redis_url, key_prefix)
    install(app)
    started, finish = threading.Event(), threading.Event()
    keys: dict[str, Any] = {}

    @deduplicate("until_executed", lease=5)
    @app.task(shared=False, bind=True, acks_late=True)
    def report(self: Any, day: str) -> str:
        keys[KEY_HEADER] = self.request.taskdedup_key
        started.set()
        assert finish.wait(30)
        return day

    sends: list[int] = []

    def broker_refuses(*_: Any, **__: Any) -> None:
        sends.append(1)
        raise ConnectionError("the broker refuses writes")

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            first = report.delay("mon")
            assert started.wait(20), "the worker never ran the job"
            monkeypatch.setattr(delivery, "STAY_AT_MOST", 0.0)  # give up at once
            monkeypatch.setattr(celery_worker, "resend", broker_refuses)
            # a copy of the running job arrives (a redelivery): it cannot be sent back
            report.apply_async(
                ("mon",), task_id=first.id, headers=dict(keys), **{RESEND_OPTION: True}
            )
            # it gave up and went back to the broker, which delivered it again: it tries again
            wait_for(lambda: len(sends) >= 2, 20, "the copy to come back from the broker")
            during = report.apply_async(("mon",))
            assert during.deduplicated and during.id == first.id, "the running job's key was freed"
            monkeypatch.undo()  # the broker takes writes again
            finish.set()
            assert first.get(timeout=30) == "mon"
    finally:
        finish.set()


def test_a_job_whose_key_is_busy_and_cannot_be_sent_back_goes_back_to_the_broker(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # while_executing: job A runs; job B of the same key finds it busy and must wait, but the
    # broker refuses to take B back. B gives up without touching A's run lock and, acks_late,
    # is rejected with requeue: not failed, not lost; it runs after A once the broker is back.
    app: Celery = make_app(redis_url, key_prefix)
    install(app)
    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    started, finish = threading.Event(), threading.Event()
    keys: list[str] = []
    spans: list[tuple[str, str]] = []  # (event, job id) in the order they happened

    @deduplicate("while_executing", lease=5)
    @app.task(shared=False, bind=True, acks_late=True)
    def report(self: Any, day: str) -> str:
        keys.append(self.request.taskdedup_key)
        spans.append(("start", self.request.id))
        if not started.is_set():
            started.set()
            assert finish.wait(30)
        spans.append(("end", self.request.id))
        return day

    sends: list[int] = []

    def broker_refuses(*_: Any, **__: Any) -> None:
        sends.append(1)
        raise ConnectionError("the broker refuses writes")

    def run_lock_holder() -> str | None:
        info = store.run(Inspect(keys[0]))
        return info.running_job if info is not None else None

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            a = report.delay("mon")
            assert started.wait(20), "the worker never ran A"
            monkeypatch.setattr(delivery, "STAY_AT_MOST", 0.0)  # give up at once
            monkeypatch.setattr(celery_worker, "resend", broker_refuses)
            b = report.delay("mon")
            assert b.id != a.id
            wait_for(lambda: len(sends) >= 2, 20, "B to come back from the broker")
            assert run_lock_holder() == a.id, "A's run lock was touched"
            assert b.state != "FAILURE"
            monkeypatch.undo()  # the broker takes writes again
            finish.set()
            assert a.get(timeout=30) == "mon"
            assert b.get(timeout=30) == "mon"  # B was not lost
    finally:
        finish.set()
        store.close()
    assert spans == [("start", a.id), ("end", a.id), ("start", b.id), ("end", b.id)]


def test_a_copy_of_a_running_job_acked_early_that_cannot_be_sent_back_fails_nothing(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without acks_late the copy's message is acknowledged already: nothing can keep it. It is
    # a copy of a job that runs (and renewed its lease the whole time the copy waited), so it
    # is rejected: no FAILURE written under the running job's id, whose caller waits for it.
    app: Celery = make_app(redis_url, key_prefix)
    install(app)
    started, finish = threading.Event(), threading.Event()
    keys: dict[str, Any] = {}
    ends: list[tuple[str, str]] = []  # (job id, state) of every delivery that ended

    @deduplicate("until_executed", lease=5)
    @app.task(shared=False, bind=True)
    def report(self: Any, day: str) -> str:
        keys[KEY_HEADER] = self.request.taskdedup_key
        started.set()
        assert finish.wait(30)
        return day

    def ended(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
        if getattr(sender, "app", None) is app:  # not another test's lingering run
            ends.append((task_id, state))

    def broker_refuses(*_: Any, **__: Any) -> None:
        raise ConnectionError("the broker refuses writes")

    task_postrun.connect(ended, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            first = report.delay("mon")
            assert started.wait(20), "the worker never ran the job"
            monkeypatch.setattr(delivery, "STAY_AT_MOST", 0.0)  # give up at once
            monkeypatch.setattr(celery_worker, "resend", broker_refuses)
            report.apply_async(
                ("mon",), task_id=first.id, headers=dict(keys), **{RESEND_OPTION: True}
            )
            wait_for(lambda: ends, 20, "the copy to give up")
            assert ends == [(first.id, "REJECTED")]
            assert first.state != "FAILURE", "a failure was written over the running job"
            during = report.apply_async(("mon",))
            assert during.deduplicated and during.id == first.id, "the running job's key was freed"
            monkeypatch.undo()
            finish.set()
            assert first.get(timeout=30) == "mon"
    finally:
        finish.set()
        task_postrun.disconnect(ended)
