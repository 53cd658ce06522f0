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

from harness import wait_for
from taskdedup.celery import deduplicate, install
from taskdedup.celery import worker as celery_worker
from taskdedup.celery.messages import KEY_HEADER, RESEND_OPTION
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
            monkeypatch.setattr(celery_worker, "STAY_AT_MOST", 0.0)  # give up at once
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
