"""Supersede with real workers: a submission while the key's job waits in the queue replaces
that job's arguments, and the job keeps its place (a job queued behind it still runs after it);
a submission while it runs owes one more run after it, with its arguments."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup.celery import deduplicate, install, signals
from test_celery import make_app
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from test_taskiq_workers import app_env as taskiq_app  # noqa: F401  (fixtures)
from test_taskiq_workers import start as taskiq_start  # noqa: F401


def listen(*names: str) -> tuple[list[tuple[str, Any]], Any]:
    """Connect a receiver to each named taskdedup signal; returns what they saw and a
    function that disconnects them."""
    seen: list[tuple[str, Any]] = []
    connected = []
    for name in names:

        def got(sender: Any = None, name: str = name, **kw: Any) -> None:
            seen.append((name, kw["holder"]))

        getattr(signals, name).connect(got, weak=False)
        connected.append((name, got))

    def stop() -> None:
        for name, got in connected:
            getattr(signals, name).disconnect(got)

    return seen, stop


def test_celery_supersede_keeps_the_queue_position_and_runs_the_latest_arguments(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix, task_ignore_result=True)
    install(app)
    signalled, stop_listening = listen("task_superseded", "task_deduplicated")
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
    try:  # one job at a time: the queue's order is the run order
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            wait_for(running.is_set, 20, "the job to run")
            assert order[0] == ("render", 3)  # in its own place, with the latest arguments
            late = render.delay("d", 4)  # while it runs: one more run, after it
            assert late.deduplicated and late.id == first.id
            go_on.set()
            wait_for(lambda: ("render", 4) in order, 20, "the run owed after it")
    finally:
        stop_listening()
    # in its own place with the latest arguments, then the job queued behind it, then the run
    # owed to the submission made while it ran
    assert order == [("render", 3), ("other", 1), ("render", 4)]
    # each replacement was signalled as one (and as a duplicate); the late one only as a
    # duplicate: it replaced nothing, it owes a run
    assert signalled == [
        ("task_superseded", first.id),
        ("task_deduplicated", first.id),
        ("task_superseded", first.id),
        ("task_deduplicated", first.id),
        ("task_deduplicated", first.id),
    ]


def test_celery_cancel_in_progress_stops_a_cooperative_run_and_the_next_starts_after_it(
    redis_url: str, key_prefix: str
) -> None:
    """running="cancel": a submission while the job runs asks it to stop through its lease
    renewals (every lease/3); the task checks at its own checkpoints and stops; the
    submission's run starts only after it ended. Nothing is killed."""
    import time

    from taskdedup import raise_if_superseded

    app = make_app(redis_url, key_prefix, task_ignore_result=True)
    install(app)
    seen: list[tuple[str, int, float]] = []

    @deduplicate(
        "until_executed", on_conflict="supersede", running="cancel", keys=["doc"], lease=1.5
    )
    @app.task(name="docs.publish", shared=False)
    def publish(doc: str, version: int) -> None:
        seen.append(("start", version, time.monotonic()))
        try:
            deadline = time.monotonic() + (30 if version == 1 else 0)
            while time.monotonic() < deadline:
                raise_if_superseded()  # the task's own checkpoint
                time.sleep(0.05)
        finally:
            seen.append(("end", version, time.monotonic()))

    signalled, stop_listening = listen("cancel_requested")
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            first = publish.delay("d", 1)
            wait_for(lambda: any(e[:2] == ("start", 1) for e in seen), 20, "the first run")
            asked = time.monotonic()
            newer = publish.delay("d", 2)
            assert newer.deduplicated  # the caller holds the running job's handle
            wait_for(lambda: any(e[:2] == ("start", 2) for e in seen), 20, "the newer run")
    finally:
        stop_listening()
    assert signalled == [("cancel_requested", first.id)]
    ended = next(at for what, v, at in seen if (what, v) == ("end", 1))
    began = next(at for what, v, at in seen if (what, v) == ("start", 2))
    assert ended - asked <= 1.5 / 3 + 1.5  # within about one renewal of the request
    assert began >= ended  # never beside it
    assert [v for what, v, _ in seen if what == "start"] == [1, 2]


@pytest.mark.parametrize("task", ["exporting", "exporting_sync"])
def test_taskiq_cancel_in_progress_stops_a_cooperative_run_and_the_next_starts_after_it(
    task: str,
    taskiq_app: Any,  # noqa: F811
    taskiq_start: Any,  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    import asyncio
    import time

    import redis

    from test_taskiq_workers import run, with_broker

    app = taskiq_app(TD_BROKER="stream")
    taskiq_start(TD_BROKER="stream")
    client = redis.Redis.from_url(redis_url)

    def seen() -> list[tuple[str, int, float]]:
        raw = client.lrange(f"{key_prefix}:mark:seen:x", 0, -1)
        return [(w, int(v), float(t)) for w, v, t in (e.decode().split() for e in raw)]

    async def body() -> float:
        await getattr(app, task).kiq("x", 1)
        await asyncio.to_thread(wait_for, lambda: seen(), 20, "the first run")
        asked = time.time()
        newer = await getattr(app, task).kiq("x", 2)
        assert newer.deduplicated
        return asked

    asked = run(with_broker(app, body))
    wait_for(lambda: any(e[:2] == ("start", 2) for e in seen()), 20, "the newer run")
    events = seen()
    ended = next(at for what, v, at in events if (what, v) == ("end", 1))
    began = next(at for what, v, at in events if (what, v) == ("start", 2))
    assert ended - asked <= 1.5 / 3 + 1.5 and began >= ended
    client.close()


def test_taskiq_supersede_keeps_the_queue_position_and_runs_the_latest_arguments(
    taskiq_app: Any,  # noqa: F811
    taskiq_start: Any,  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    """The Celery scenario on a real taskiq worker (one job at a time, so the queue order is
    the run order): the queued job runs in its place with the newest arguments, the job
    behind it runs next, and the submission made while it ran gets one more run after."""
    import redis

    from test_taskiq_workers import run, with_broker

    app = taskiq_app()
    client = redis.Redis.from_url(redis_url)

    def order() -> list[str]:
        return [e.decode() for e in client.lrange(f"{key_prefix}:mark:order:d", 0, -1)]

    async def submit() -> list[Any]:
        first = await app.rendering.kiq("d", 1)
        await app.behind.kiq("d")
        return [first, await app.rendering.kiq("d", 2), await app.rendering.kiq("d", 3)]

    first, second, third = run(with_broker(app, submit))
    assert second.deduplicated and third.deduplicated
    assert first.task_id == second.task_id == third.task_id
    taskiq_start("--max-async-tasks", "1")
    wait_for(lambda: order() == ["render 3"], 30, "the job to run, with the latest arguments")
    late = run(with_broker(app, lambda: app.rendering.kiq("d", 4)))
    assert late.deduplicated and late.task_id == first.task_id  # the running job's handle
    client.set(f"{key_prefix}:mark:go:d", 1, ex=600)
    wait_for(lambda: len(order()) == 3, 30, "the job behind it, then the run owed")
    assert order() == ["render 3", "other", "render 4"]
    client.close()


def test_a_worker_killed_mid_run_of_a_superseded_job_still_runs_the_owed_run_once(
    worker_env: Any,  # noqa: F811
    start: Any,  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    """kill -9 of the pool process running a supersede job that owes a run (a submission came
    while it ran), acks late: the broker delivers the killed job again, its copy takes the run
    over once the lease lapsed, and runs the owed submission's arguments, once (the lock
    lapsed with the lease; the job's record kept the owed run). Before the fix the copy ran
    its own first arguments again and the owed run was lost."""
    import json
    import os
    import signal
    import time

    import redis

    worker = start()
    wait_for(lambda: worker.mark("ready"), 60, "the prefork worker to start")
    client = redis.Redis.from_url(redis_url)

    def runs() -> list[tuple[int, float, int]]:
        raw = client.lrange(f"{key_prefix}:mark:runs:k9", 0, -1)
        return [tuple(json.loads(item)) for item in raw]  # type: ignore[misc]

    job = worker_env.superseding_late_job
    first = job.delay("k9", 1, 60)
    pid = int(wait_for(lambda: client.get(f"{key_prefix}:mark:pid:k9"), 20, "the first run"))
    owed = job.delay("k9", 2)  # while it runs: one more run is owed, with n=2
    assert owed.deduplicated and owed.id == first.id
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    wait_for(lambda: len(runs()) >= 2, 3 + 15, "the owed run")
    seen = runs()
    assert [n for n, _, _ in seen] == [1, 2], seen  # the killed run, then the owed one
    assert killed <= seen[1][1] <= killed + 3 + 10, seen  # after the kill, within the lease+
    assert first.get(timeout=20) == 2  # the job's handle resolves to the run that happened
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # and only once
        assert len(runs()) == 2, runs()
        time.sleep(0.2)
    client.close()
