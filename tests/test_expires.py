"""Celery ``expires``: a job that expires unread does not hold its key for the whole ttl (G13).

A job whose ``expires`` passes before any worker starts it never runs; Celery's worker drops
it (and taskdedup then frees its key), but when no worker reads it in time, or the worker that
drops it cannot reach the store and is killed before it can tell it (the soak saw this), only
the lock's own life ends it. That life is capped at ``expires`` + ``grace`` for such jobs; a
job that starts in time takes the lock's life of a running job at its claim, so a duplicate
sent while it runs is still deduplicated.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup.celery import deduplicate, install
from test_celery import make_app

GRACE = 1.0


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Any:
    app = make_app(redis_url, key_prefix, taskdedup_grace=GRACE)
    install(app)
    return app


@pytest.mark.parametrize("strategy", ["until_executing", "until_executed"])
def test_a_job_that_expires_unread_frees_its_key_soon_after_its_expiry(
    app: Any, strategy: str
) -> None:
    @deduplicate(strategy, ttl=3600)
    @app.task(shared=False)
    def export(day: str) -> str:
        return day

    first = export.apply_async(("mon",), expires=1.0)
    again = export.delay("mon")
    assert again.deduplicated and again.id == first.id  # the key is held while it may run
    started = time.monotonic()
    # no worker reads the queue: the job expires there; its key is free again soon after
    fresh = wait_for(lambda: (r := export.delay("mon")) and not r.deduplicated and r, timeout=15)
    assert fresh.id != first.id
    assert time.monotonic() - started < 1.0 + GRACE + 5  # not the ttl (an hour)


def test_a_job_that_starts_before_its_expiry_keeps_its_key_while_it_runs(app: Any) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed", ttl=3600, lease=5)
    @app.task(shared=False)
    def export(day: str) -> str:
        started.set()
        assert release.wait(30)
        return day

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = export.apply_async(("tue",), expires=1.0)
        assert started.wait(20)
        time.sleep(1.0 + GRACE + 1.5)  # well past expires + grace, the body still running
        during = export.delay("tue")
        assert during.deduplicated and during.id == first.id
        release.set()
        assert first.get(timeout=20) == "tue"
