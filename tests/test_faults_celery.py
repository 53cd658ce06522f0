"""Celery under faults, with real prefork workers in subprocesses: a worker killed with
kill -9 mid-job, then its job delivered again while a newer job of the same key runs (G12); a
store that stalls while a worker claims a job (G13, G14)."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from harness import wait_for
from redis_server import PrivateRedis
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from worker_process import WorkerProcess


def runs_of(worker: WorkerProcess, name: str) -> list[tuple[str, str, str, float]]:
    """The run log of ``name``: (event, job id, fence, time), in the order written."""
    raw = worker.client.lrange(f"{worker.prefix}:mark:log:{name}", 0, -1)
    out = []
    for line in raw:
        event, job, fence, at, _pid = line.decode().split()
        out.append((event, job, fence, float(at)))
    return out


def intervals(
    log: list[tuple[str, str, str, float]], killed_at: float
) -> list[tuple[float, float, str, str]]:
    """One (start, end, job, fence) per run; a run with no end ended when its worker died."""
    started: dict[tuple[str, str], float] = {}
    out = []
    for event, job, fence, at in log:
        if event == "start":
            started[(job, fence)] = at
        else:
            out.append((started.pop((job, fence)), at, job, fence))
    out.extend((at, killed_at, job, fence) for (job, fence), at in started.items())
    return sorted(out)


def kill_whole_worker(worker: WorkerProcess) -> float:
    """kill -9 the worker and its pool: nothing acknowledges its jobs."""
    os.killpg(worker.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    worker.proc.wait(10)
    worker.client.delete(f"{worker.prefix}:mark:ready")
    return killed_at


def test_a_copy_of_a_killed_job_never_runs_beside_the_newer_job_of_its_key(
    worker_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    # until_executed, acks_late. Job A runs; its whole worker is killed; A's lease lapses and a
    # new submission B of the same key is accepted. A second worker then gets B from the queue
    # and A again from the broker (the visibility timeout passed). A is stale: its key passed
    # to B. It must not run while B runs; it runs after B, with a newer fencing token.
    first = start(TD_VISIBILITY_TIMEOUT="1")
    a = worker_env.fenced_job.delay("k", 60)
    wait_for(lambda: first.mark("pid:k"), 30, "A to start")
    killed_at = kill_whole_worker(first)
    first.client.set(f"{first.prefix}:mark:sleep:k", 3, ex=600)  # later runs take 3 s

    def submit_b() -> Any:
        result = worker_env.fenced_job.delay("k", 60)
        return None if result.deduplicated else result

    b = wait_for(submit_b, 15, "the key to be free after A's lease")
    assert b.id != a.id
    second = start(TD_VISIBILITY_TIMEOUT="1")
    assert b.get(timeout=60) == b.id
    assert a.get(timeout=60) == a.id  # A was not lost: it ran once B was done
    runs = intervals(runs_of(second, "k"), killed_at)
    assert [job for _, _, job, _ in runs].count(a.id) == 2, runs  # killed, then again
    for (_, end, job, _), (start_next, _, job_next, _) in itertools.pairwise(runs):
        assert end <= start_next, f"{job} and {job_next} ran at once: {runs}"
    fences = [int(fence) for _, _, _, fence in runs]
    assert fences == sorted(fences) and len(set(fences)) == len(fences), runs


@pytest.fixture
def stalled_store() -> Any:
    """A private store Redis (1 s socket timeout) that the test may pause; resumed at the end."""
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.resume()
        server.stop()


def confirmed_locks(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return sum(client.hget(k, "c") == b"1" for k in client.scan_iter(match="*:lock"))
    finally:
        client.close()


@pytest.mark.parametrize("on_store_error", ["enqueue", "raise"])
def test_a_job_whose_claim_meets_a_stalled_store_runs_once_it_answers_and_frees_its_key(
    on_store_error: str,
    stalled_store: PrivateRedis,
    start: Callable[..., WorkerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    # A job is accepted (its lock is in the store); the store then stalls (SIGSTOP) while a
    # worker claims the job. The job must neither fail nor run unguarded: it goes back to the
    # broker and runs, once, when the store answers again; then its key is free.
    store_url = stalled_store.url + "?socket_timeout=1"
    env = {"TD_STORE_URL": store_url, "TD_ON_STORE_ERROR": on_store_error}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = request.getfixturevalue("worker_env")
    job = app.fenced_job.delay("s", 0.2)
    wait_for(lambda: confirmed_locks(stalled_store.url), 10, "the lock to be confirmed")
    stalled_store.pause()
    worker = start(**env)
    log = worker.log_path

    def claim_failed_twice_or_finish_failed() -> bool:
        text = log.read_text()
        failed_twice = text.count("claim store_unavailable") >= 2
        return failed_twice or "finish store_unavailable" in text or job.ready()

    wait_for(claim_failed_twice_or_finish_failed, 60, "the worker to meet the stalled store")
    resumed_at = time.time()
    stalled_store.resume()
    assert job.get(timeout=60) == job.id
    runs = [entry for entry in runs_of(worker, "s") if entry[:2] == ("start", job.id)]
    assert len(runs) == 1, runs
    assert runs[0][3] >= resumed_at, "the job ran while the store could not guard it"

    def submit_fresh() -> Any:
        fresh = app.fenced_job.delay("s", 0)
        return None if fresh.deduplicated else fresh

    fresh = wait_for(submit_fresh, 2 + 5, "the key to be free after the job")
    assert fresh.id != job.id
