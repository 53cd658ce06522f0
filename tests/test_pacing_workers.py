"""@pace with real workers (issue 27): submissions over the rate start later, never dropped.

Celery: two producer processes submit 100 jobs of a task paced at ``"10/s"`` (burst 1) in one
burst; a real prefork worker runs them. Each body notes when it started: none is dropped or
run twice, each producer's run in its order, never more than 10 (+1 at a window's edge) in
any second, the whole burst spread over ~10 s.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import redis

from harness import wait_for
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from test_taskiq_workers import start as taskiq_start  # noqa: F401
from worker_process import HERE, WorkerProcess

PRODUCER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import celery_worker_app as app
    first = int(sys.argv[2])
    for n in range(first, first + 50):
        assert not getattr(app.paced_job.delay(n), "deduplicated", False)
    """
)


def test_a_burst_from_two_producers_runs_paced_in_order_and_none_is_dropped(
    start: Callable[..., WorkerProcess],  # noqa: F811
    worker_env: Any,  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    worker = start()
    wait_for(lambda: worker.mark("ready"), 60, "the prefork worker to start")
    env = {**os.environ, "TD_REDIS_URL": redis_url, "TD_PREFIX": key_prefix}
    producers = [
        subprocess.Popen([sys.executable, "-c", PRODUCER, str(HERE), str(first)], env=env)
        for first in (0, 100)
    ]
    assert all(p.wait(timeout=60) == 0 for p in producers)
    check_paced_runs(redis_url, key_prefix)


def check_paced_runs(redis_url: str, key_prefix: str) -> None:
    """What the 100 bodies noted: none dropped or run twice, the rate kept, each producer's
    jobs in its order."""
    client = redis.Redis.from_url(redis_url)

    def starts() -> list[tuple[int, float, float | None]]:
        raw = client.lrange(f"{key_prefix}:mark:paced", 0, -1)
        return [tuple(json.loads(item)) for item in raw]  # type: ignore[misc]

    wait_for(lambda: len(starts()) >= 100, 10 + 20, "all 100 paced jobs to run")
    ran = [(n, at) for n, at, _ in starts()]
    assert sorted(n for n, _ in ran) == [*range(50), *range(100, 150)]  # none dropped, once
    # the starts the jobs were given (a countdown's ETA, or the label the taskiq worker holds a
    # delivery until): 100 ms apart, the first of the burst sent to start at once, and no body
    # started before its start
    given = sorted(due for _, _, due in starts() if due is not None)
    assert len(given) >= 99, len(given)
    given_gaps = [b - a for a, b in itertools.pairwise(given)]
    assert min(given_gaps) >= 0.09, [round(g, 3) for g in given_gaps if g < 0.09]
    assert all(at >= due - 0.02 for _, at, due in starts() if due is not None)
    times = sorted(at for _, at in ran)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # the starts given are exactly 100 ms apart (the store's contract cases and
    # test_pacing.py); a body starts when Celery's ETA timer hands it to a pool process, which
    # on this 2-core machine is up to ~45 ms late now and then (and a job given no countdown
    # starts when the worker receives it), so a single gap may shrink by that much
    assert min(gaps) >= 0.04, [(i, round(g, 3)) for i, g in enumerate(gaps) if g < 0.09]
    assert sorted(gaps)[len(gaps) // 2] >= 0.095  # the typical gap is the rate's
    for i, at in enumerate(times):  # never more than the rate in any second
        assert sum(1 for t in times[i:] if t < at + 1.0) <= 10 + 1
    assert times[-1] - times[0] >= 99 * 0.1 - 0.2  # spread over ~10 s, not run at once
    for first in (0, 100):  # each producer's jobs start in the order it submitted them
        mine = sorted((at, n) for n, at in ran if first <= n < first + 50)
        assert [n for _, n in mine] == list(range(first, first + 50))
    client.close()


TASKIQ_PRODUCER = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import taskiq_worker_app as app
    first = int(sys.argv[2])

    async def main():
        await app.broker.startup()
        for n in range(first, first + 50):
            await app.paced.kiq(n)
        await app.broker.shutdown()

    asyncio.run(main())
    """
)


def test_taskiq_a_burst_from_two_producers_runs_paced_in_order_and_none_is_dropped(
    taskiq_start: Callable[..., WorkerProcess],  # noqa: F811
    redis_url: str,
    key_prefix: str,
) -> None:
    """The same on a real taskiq worker (RedisStreamBroker): a kick over the rate is sent at
    once and held by the worker until its start."""
    taskiq_start(TD_BROKER="stream")
    env = {**os.environ, "TD_REDIS_URL": redis_url, "TD_PREFIX": key_prefix}
    env["TD_BROKER"] = "stream"
    producers = [
        subprocess.Popen([sys.executable, "-c", TASKIQ_PRODUCER, str(HERE), str(first)], env=env)
        for first in (0, 100)
    ]
    assert all(p.wait(timeout=60) == 0 for p in producers)
    check_paced_runs(redis_url, key_prefix)
