"""Debounce with real workers: a burst of submissions of one key runs once, ``delay`` after the
last (at most ``max_wait`` after the first), with the last submission's arguments; a key that
never goes quiet still runs every ``max_wait``, and two runs of one key never overlap."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from harness import wait_for
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from test_taskiq_workers import app_env as taskiq_app  # noqa: F401  (fixtures)
from test_taskiq_workers import start as taskiq_start  # noqa: F401
from worker_process import WorkerProcess


@pytest.fixture
def client(
    start: Callable[..., WorkerProcess],  # noqa: F811
    redis_url: str,
) -> Iterator[redis.Redis]:
    """A ready Celery prefork worker, and a client to read what its runs noted."""
    worker = start()
    wait_for(lambda: worker.mark("ready"), 60, "the prefork worker to start")
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def stays(check: Callable[[], bool], seconds: float = 3.0) -> None:
    """``check()`` holds the whole time (a run that must not come again)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check()
        time.sleep(0.2)


def runs(client: redis.Redis, prefix: str, name: str) -> list[tuple[int, float, int]]:
    """Each run of ``name``: its n, when it began (epoch s), how many runs were going on."""
    raw = client.lrange(f"{prefix}:mark:runs:{name}", 0, -1)
    return [tuple(json.loads(item)) for item in raw]  # type: ignore[misc]


def test_a_burst_of_50_submissions_runs_once_with_the_last_arguments(
    worker_env: Any,  # noqa: F811
    client: redis.Redis,
    key_prefix: str,
) -> None:
    first = time.time()
    handles = []
    for n in range(50):  # 50 submissions in 2 s; delay=1, max_wait=3
        handles.append(worker_env.debounced_job.delay("burst", n))
        time.sleep(0.04)
    assert len({h.id for h in handles}) == 1  # every caller holds the one run's handle
    assert sum(bool(getattr(h, "deduplicated", False)) for h in handles) == 49
    ran = wait_for(lambda: runs(client, key_prefix, "burst"), 15, "the burst's run")
    assert [n for n, _, _ in ran] == [49]  # once, with the last submission's arguments
    assert ran[0][1] - first <= 3 + 2  # within max_wait + 2 s of the first submission
    assert ran[0][1] - first >= 2.0  # not before the burst went quiet (its last was at ~2 s)
    stays(lambda: len(runs(client, key_prefix, "burst")) == 1)  # and no second run comes


def test_a_key_that_never_goes_quiet_runs_every_max_wait_and_never_twice_at_once(
    worker_env: Any,  # noqa: F811
    client: redis.Redis,
    key_prefix: str,
) -> None:
    first = time.time()
    n = 0
    while time.time() - first < 10:  # a submission every 100 ms for 10 s, each run 0.5 s
        worker_env.debounced_job.delay("stream", n, 0.5)
        n += 1
        time.sleep(0.1)
    wait_for(lambda: runs(client, key_prefix, "stream")[-1][0] == n - 1, 15, "the last burst")
    seen = runs(client, key_prefix, "stream")
    began = [first] + [at for _, at, _ in seen]
    gaps = [b - a for a, b in itertools.pairwise(began)]
    assert len(seen) >= 3, seen  # max_wait=3: a run at least every ~3 s of the 10
    assert max(gaps[:-1]) <= 3 + 1.5, gaps  # (the last burst ends when the stream stops)
    assert all(active == 1 for _, _, active in seen), seen  # never two runs at once
    numbers = [m for m, _, _ in seen]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)  # latest, once


def test_taskiq_a_burst_runs_once_with_the_last_arguments_and_a_stream_every_max_wait(
    taskiq_app: Any,  # noqa: F811
    taskiq_start: Callable[..., WorkerProcess],  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    import asyncio

    from test_taskiq_workers import run, with_broker

    app = taskiq_app(TD_BROKER="stream")
    taskiq_start("--workers", "1", TD_BROKER="stream")
    client = redis.Redis.from_url(redis_url)

    async def body() -> tuple[float, list[str], float, int]:
        first = time.time()
        ids = []
        for n in range(50):  # 50 submissions in 2 s; delay=1, max_wait=3
            ids.append((await app.debounced.kiq("burst", n)).task_id)
            await asyncio.sleep(0.04)
        stream_start = time.time()
        m = 0
        while time.time() - stream_start < 10:  # then a stream: one every 100 ms, runs of 0.5 s
            await app.debounced.kiq("stream", m, 0.5)
            m += 1
            await asyncio.sleep(0.1)
        return first, ids, stream_start, m

    first, ids, stream_start, m = run(with_broker(app, body))
    assert len(set(ids)) == 1  # every caller holds the one run's id
    burst = runs(client, key_prefix, "burst")
    assert [n for n, _, _ in burst] == [49] and 2.0 <= burst[0][1] - first <= 3 + 2
    wait_for(lambda: runs(client, key_prefix, "stream")[-1][0] == m - 1, 15, "the last burst")
    seen = runs(client, key_prefix, "stream")
    began = [stream_start] + [at for _, at, _ in seen]
    gaps = [b - a for a, b in itertools.pairwise(began)]
    assert len(seen) >= 3 and max(gaps[:-1]) <= 3 + 1.5, gaps
    assert all(active == 1 for _, _, active in seen), seen  # never two runs at once
    assert len(runs(client, key_prefix, "burst")) == 1  # and the burst ran once, still
    client.close()


def test_a_worker_killed_mid_run_of_a_debounced_job_lets_the_next_burst_run_once(
    worker_env: Any,  # noqa: F811
    client: redis.Redis,
    key_prefix: str,
) -> None:
    """kill -9 of the pool process running a burst's job: its run lock lapses after the lease
    (5 s), and the next burst, submitted meanwhile, runs once, with its last arguments."""
    import os
    import signal

    worker_env.debounced_job.delay("k9", 0, 60)
    pid_mark = f"{key_prefix}:mark:pid:k9"
    pid = int(wait_for(lambda: client.get(pid_mark), 15, "the first burst to run"))
    for n in range(1, 6):  # the next burst, while the first runs
        worker_env.debounced_job.delay("k9", n)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    wait_for(lambda: len(runs(client, key_prefix, "k9")) >= 2, 5 + 1 + 10, "the next burst")
    seen = runs(client, key_prefix, "k9")
    assert [n for n, _, _ in seen] == [0, 5]  # the killed run, then the next burst's last
    assert seen[1][1] - killed <= 5 + 1 + 5  # within lease + delay + a few seconds
    stays(lambda: len(runs(client, key_prefix, "k9")) == 2)  # and only once


def test_a_store_outage_during_a_burst_loses_no_submission_and_runs_nothing_twice(
    start: Callable[..., WorkerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    redis_url: str,
    key_prefix: str,
) -> None:
    """The store stalls (SIGSTOP) in the middle of a burst, with on_store_error="enqueue".
    The submissions it cannot answer are published as they are (G5: a missed fold, never lost
    work); the burst's job, due meanwhile, waits in the broker rather than run unguarded (G14).
    Once the store answers: the burst's job runs once, no job runs twice, the last
    submission's arguments run, every submission is covered by a run that began after it with
    its or later arguments, and no two runs of the key overlap. Only the arguments of a
    submission whose call timed out may run twice: the stalled store still applies the call
    when it wakes (folding them into the burst) while they also went out as a job of their
    own; that is the missed fold G5 allows, never at the same time."""
    from redis_server import PrivateRedis

    store = PrivateRedis().start()
    try:
        env = {"TD_STORE_URL": store.url + "?socket_timeout=1", "TD_ON_STORE_ERROR": "enqueue"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        app = request.getfixturevalue("worker_env")
        worker = start(**env)
        wait_for(lambda: worker.mark("ready"), 60, "the prefork worker to start")
        client = redis.Redis.from_url(redis_url)
        sent: list[tuple[int, float, Any]] = []

        def submit(n: int) -> None:
            sent.append((n, time.time(), app.debounced_job.delay("out", n)))
            time.sleep(0.05)

        for n in range(5):  # the burst begins: one job
            submit(n)
        store.pause()
        for n in range(5, 8):  # the store does not answer: published as they are
            submit(n)
        time.sleep(1.5)  # (the burst's job comes due meanwhile: it must wait for the store)
        resumed = time.time()
        store.resume()
        for n in range(8, 10):  # the store answers again
            submit(n)
        wait_for(lambda: 9 in [n for n, _, _ in runs(client, key_prefix, "out")], 30, "n=9")
        stays(lambda: len({h.id for _, _, h in sent}) >= len(runs(client, key_prefix, "out")))
        seen = runs(client, key_prefix, "out")
        jobs = [job.decode() for job in client.lrange(f"{key_prefix}:mark:jobs:out", 0, -1)]
        assert len(jobs) == len(set(jobs)) and sent[0][2].id in jobs, jobs  # each job once
        numbers = [n for n, _, _ in seen]
        twice = {n for n in numbers if numbers.count(n) > 1}
        assert twice <= {5, 6, 7}, seen  # only a timed-out call's arguments (see above)
        assert all(active == 1 for _, _, active in seen), seen  # never two runs at once
        assert all(began >= resumed for _, began, _ in seen), seen  # none ran unguarded
        for n, at, _ in sent:  # nothing lost: a run began after it, with its or later arguments
            assert any(m >= n and began >= at for m, began, _ in seen), (n, seen)
        unguarded = [h for n, _, h in sent if 5 <= n < 8]
        assert not any(getattr(h, "deduplicated", False) for h in unguarded)
        client.close()
    finally:
        store.resume()
        store.stop()
