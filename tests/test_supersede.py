"""Supersede with real workers: a submission while the key's job waits in the queue replaces
that job's arguments, and the job keeps its place (a job queued behind it still runs after it);
a submission while it runs owes one more run after it, with its arguments."""

from __future__ import annotations

import threading
from typing import Any

from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup.celery import deduplicate, install
from test_celery import make_app


def test_celery_supersede_keeps_the_queue_position_and_runs_the_latest_arguments(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix, task_ignore_result=True)
    install(app)
    order: list[tuple[str, Any]] = []
    running = threading.Event()
    go_on = threading.Event()

    @deduplicate("until_executed", on_conflict="supersede", keys=["doc"])
    @app.task(name="docs.render", shared=False)
    def render(doc: str, version: int) -> None:
        order.append(("render", version))
        if version == 3:
            running.set()
            go_on.wait(30)

    @app.task(name="docs.other", shared=False)
    def other(n: int) -> None:
        order.append(("other", n))

    first = render.delay("d", 1)  # queued first...
    other.delay(1)  # ...then another job behind it
    second = render.delay("d", 2)
    third = render.delay("d", 3)
    assert second.deduplicated and third.deduplicated and second.id == third.id == first.id
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        wait_for(running.is_set, 20, "the job to run")
        assert order[0] == ("render", 3)  # in its own place, with the latest arguments
        late = render.delay("d", 4)  # while it runs: one more run, after it
        assert late.deduplicated and late.id == first.id
        go_on.set()
        wait_for(lambda: ("render", 4) in order, 20, "the run owed after it")
    assert order.index(("other", 1)) > 0  # the job behind it ran after it
    assert [entry for entry in order if entry[0] == "render"] == [("render", 3), ("render", 4)]
