"""Real workers on the PostgreSQL store: the fault scenarios the Redis store is held to
(kill -9 mid-job, redelivery of a killed job's copy, revoke, expiry), plus the database
restarted while a job runs and the database down when a worker claims. The broker stays
Redis (the worker apps' markers live there); every decision is the PostgreSQL store's.

Each scenario is the Redis suite's own test function, run here with ``TD_STORE_URL`` (the
subprocess apps) or ``taskdedup_url`` (in-process apps) pointing at PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

import test_celery_prefork
import test_celery_revoke
import test_expires
import test_faults_celery
import test_taskiq_workers
from harness import wait_for
from postgres_server import PrivatePostgres
from taskdedup.celery import install
from taskdedup.stores.base import Inspect
from taskdedup.stores.postgres import PostgresStore
from test_celery import make_app
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from test_celery_revoke import prefork, sub  # noqa: F401  (fixtures)
from test_taskiq_workers import app_env  # noqa: F401  (fixtures)
from test_taskiq_workers import start as taskiq_start  # noqa: F401  (fixtures)
from worker_process import WorkerProcess


@pytest.fixture(autouse=True)
def on_postgres(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every worker app of the test (subprocess or imported) takes PostgreSQL as its store."""
    monkeypatch.setenv("TD_STORE_URL", postgres_url)
    return postgres_url


def test_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
    start: Callable[..., WorkerProcess],  # noqa: F811
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    test_celery_prefork.test_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
        "redis", start, key_prefix, monkeypatch, request
    )


def test_acks_late_redelivery_runs_the_body_once(
    worker_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    test_celery_prefork.test_acks_late_redelivery_runs_the_body_once(worker_env, start)


def test_a_copy_of_a_killed_job_never_runs_beside_the_newer_job_of_its_key(
    worker_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    test_faults_celery.test_a_copy_of_a_killed_job_never_runs_beside_the_newer_job_of_its_key(
        worker_env, start
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_terminating_a_running_job_frees_its_lock_before_its_lease(
    sub: Any,  # noqa: F811
    prefork: WorkerProcess,  # noqa: F811
    sig: str,
) -> None:
    test_celery_revoke.terminate_frees(prefork, sub.revoke_until_executed, "t1", signal=sig)


@pytest.fixture
def app(redis_url: str, key_prefix: str, postgres_url: str) -> Celery:
    """An in-process app: Redis broker, PostgreSQL store."""
    app = make_app(
        redis_url, key_prefix, taskdedup_url=postgres_url, taskdedup_grace=test_expires.GRACE
    )
    install(app)
    return app


def test_revoking_a_queued_job_frees_its_lock_when_the_worker_discards_it(app: Celery) -> None:
    test_celery_revoke.test_revoking_a_queued_job_frees_its_lock_when_the_worker_discards_it(
        app, "until_executed"
    )


def test_a_job_that_expires_unread_frees_its_key_soon_after_its_expiry(app: Celery) -> None:
    test_expires.test_a_job_that_expires_unread_frees_its_key_soon_after_its_expiry(
        app, "until_executed"
    )


def test_taskiq_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
    app_env: Any,  # noqa: F811
    taskiq_start: Callable[..., WorkerProcess],  # noqa: F811
) -> None:
    test_taskiq_workers.test_kill_9_mid_job_frees_the_key_within_lease_plus_5_seconds(
        "list", "long_job", app_env, taskiq_start
    )


# ---------------------------------------------------------------- the database itself fails


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL of the test's own, which it may stop and start."""
    server = PrivatePostgres().start()
    try:
        yield server
    finally:
        server.stop()


def test_a_database_restarted_mid_run_keeps_the_lock_and_the_job_runs_once(
    private_pg: PrivatePostgres,
    start: Callable[..., WorkerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    key_prefix: str,
) -> None:
    # A job runs (lease 2 s, renewed every 2/3 s); PostgreSQL is stopped under it for 1 s,
    # then started. Committed locks survive a restart: the job holds its key before and after,
    # a duplicate gets its id, it runs once, and its key is then free. While the database is
    # down the worker's renewals fail; the next one, on a new connection, holds the lease.
    # (An outage longer than the lease lets the key go, as on Redis: that is the lease.)
    monkeypatch.setenv("TD_STORE_URL", private_pg.url)
    app = request.getfixturevalue("worker_env")
    worker = start(TD_STORE_URL=private_pg.url)
    job = app.fenced_job.delay("r", 8)
    wait_for(lambda: worker.mark("pid:r"), 30, "the job to start")
    assert app.fenced_job.delay("r", 0).id == job.id
    private_pg.down()
    time.sleep(1)  # the outage itself (what is tested is what follows it)
    private_pg.up()
    store = PostgresStore(private_pg.url, key_prefix=key_prefix)
    try:
        info = wait_for(lambda: store.run(Inspect(_key_of(store, job.id))), 10, "the lock")
        assert info.job_id == job.id and info.state == "running"
        assert app.fenced_job.delay("r", 0).id == job.id  # still held: no second run
        assert job.get(timeout=60) == job.id
        runs = [e for e in test_faults_celery.runs_of(worker, "r") if e[0] == "start"]
        assert [job_id for _, job_id, _, _ in runs] == [job.id], runs

        def accepted() -> Any:
            fresh = app.fenced_job.delay("r", 0)
            return None if fresh.deduplicated else fresh

        assert wait_for(accepted, 10, "the key to be free after the job").id != job.id
    finally:
        store.close()


def _key_of(store: PostgresStore, job_id: str) -> str:
    from taskdedup.stores.base import Scan

    return next(info.key for info in store.run(Scan()) if info.job_id == job_id)


def test_a_job_whose_claim_meets_a_stopped_database_runs_once_it_is_back(
    private_pg: PrivatePostgres,
    start: Callable[..., WorkerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    # A job is accepted (its lock is in the database); the database then stops, and a
    # worker claims the job. The job must neither fail nor run unguarded: it goes back to the
    # broker and runs, once, when the database is back; then its key is free.
    monkeypatch.setenv("TD_STORE_URL", private_pg.url)
    app = request.getfixturevalue("worker_env")
    job = app.fenced_job.delay("s", 0.2)
    assert app.fenced_job.delay("s", 0.2).id == job.id
    private_pg.down()
    worker = start(TD_STORE_URL=private_pg.url)
    log = worker.log_path
    wait_for(
        lambda: log.read_text().count("claim store_unavailable") >= 2 or job.ready(),
        60,
        "the worker to meet the stopped database",
    )
    assert not job.ready(), "the job ran while the database could not guard it"
    back_at = time.time()
    private_pg.up()
    assert job.get(timeout=60) == job.id
    runs = [e for e in test_faults_celery.runs_of(worker, "s") if e[:2] == ("start", job.id)]
    assert len(runs) == 1 and runs[0][3] >= back_at, runs

    def accepted() -> Any:
        fresh = app.fenced_job.delay("s", 0)
        return None if fresh.deduplicated else fresh

    assert wait_for(accepted, 10, "the key to be free after the job").id != job.id
