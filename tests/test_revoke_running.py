"""A plain revoke does not stop a running job, so it must not free that job's key (G12, G13).

Celery's ``revoke()`` without ``terminate`` only flags the id: a job already running goes on.
Every worker then discards any *copy* of that job it receives (an acks_late redelivery, a copy
sent again while the key was busy) and reports it with ``task_revoked``. Freeing the key or the
slot there would let a new job of the key, or one over the scope's cap, run beside the one
still running. A discarded or expired job frees only a lock still QUEUED, and its slot only
when its job is not running; ``terminate=True`` frees everything (the job is killed).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup import QuotaExceeded
from taskdedup.celery import deduplicate, install, reserve
from taskdedup.celery.messages import KEY_HEADER, RESEND_OPTION, SCOPE_HEADER
from test_celery import make_app
from test_celery_revoke import accepted, revoke


@pytest.mark.parametrize("capped", [False, True], ids=["lock", "lock-and-slot"])
def test_a_copy_of_a_running_job_discarded_after_a_plain_revoke_frees_nothing(
    redis_url: str, key_prefix: str, capped: bool
) -> None:
    app: Celery = make_app(redis_url, key_prefix)
    install(app)
    started, finish = threading.Event(), threading.Event()
    headers: dict[str, Any] = {}

    def body(self: Any, day: str, part: str) -> str:
        for name in (KEY_HEADER, SCOPE_HEADER):  # what a redelivered copy would carry
            value = getattr(self.request, name, None) or (self.request.headers or {}).get(name)
            if value:
                headers[name] = value
        started.set()
        assert finish.wait(30)
        return day

    task = app.task(shared=False, bind=True, name=f"{key_prefix}.report")(body)
    if capped:
        task = reserve(1, scope="day")(task)
    report = deduplicate("until_executed", lease=5)(task)
    discarded: list[str] = []

    def on_revoked(request: Any = None, **_: Any) -> None:
        discarded.append(getattr(request, "id", "?"))

    signals.task_revoked.connect(on_revoked, weak=False)
    hostname = f"running@{key_prefix}"
    try:
        with start_worker(
            app, pool="threads", concurrency=2, perform_ping_check=False, hostname=hostname
        ):
            first = report.delay("mon", "a")
            assert started.wait(20), "the worker never ran the job"
            revoke(app, first.id, hostname)  # plain: the body goes on running
            # a copy of the running job reaches the worker (as a redelivery would): discarded
            report.apply_async(
                ("mon", "a"), task_id=first.id, headers=dict(headers), **{RESEND_OPTION: True}
            )
            wait_for(lambda: first.id in discarded, 20, "the worker to discard the copy")
            if capped:  # the running job still holds its slot: the scope is still full
                with pytest.raises(QuotaExceeded):
                    report.apply_async(("mon", "b"))
            else:  # and its key: a duplicate is still answered with the running job
                during = report.apply_async(("mon", "a"))
                assert during.deduplicated and during.id == first.id
            finish.set()
            wait_for(lambda: accepted(report, "mon", "a"), 20, "the key to be free after the run")
    finally:
        finish.set()
        signals.task_revoked.disconnect(on_revoked)
