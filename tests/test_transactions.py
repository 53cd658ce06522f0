"""Enqueue inside the caller's transaction, on the PostgreSQL store in that database: the lock
row is written in the transaction and the message published after its commit. A rollback
leaves neither a lock nor a job; a commit runs the job once; a concurrent enqueue of the key
waits for the transaction and then gets its job; a process killed between the commit and the
publish leaves a key that is free again within the grace. Real workers, real databases."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

import taskdedup
from harness import wait_for
from taskdedup.celery import deduplicate, install
from taskdedup.errors import ConfigError
from taskdedup.stores.base import Inspect, Scan
from taskdedup.stores.postgres import PostgresStore
from test_celery import make_app

HERE = Path(__file__).resolve().parent


@pytest.fixture
def orders(postgres_url: str, key_prefix: str) -> Iterator[str]:
    """An orders table of the test's own, in the store's database."""
    table = key_prefix.replace("-", "_") + "_orders"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id text PRIMARY KEY)")
    yield table
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


@pytest.fixture
def app(redis_url: str, key_prefix: str, postgres_url: str) -> Celery:
    app = make_app(redis_url, key_prefix, taskdedup_url=postgres_url, taskdedup_grace=1.0)
    install(app)
    return app


def held(app: Celery, task: Any, *args: Any) -> bool:
    """Whether a new submission of the key is answered with an existing job."""
    return bool(task.delay(*args).deduplicated)


def test_a_rollback_leaves_no_lock_and_no_job_and_a_commit_runs_once(
    app: Celery, postgres_url: str, orders: str
) -> None:
    ran: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False)
    def send_invoice(order: str) -> str:
        ran.append(order)
        return order

    with start_worker(app, pool="solo", perform_ping_check=False):
        with psycopg.connect(postgres_url) as conn:
            with pytest.raises(RuntimeError), taskdedup.transaction(conn):
                conn.execute(f"INSERT INTO {orders} VALUES ('o1')")
                lost = send_invoice.delay("o1")
                assert lost.id and not lost.deduplicated  # its id at once
                raise RuntimeError("the request failed")
            fresh = send_invoice.delay("o1")  # no lock was left: a new job of its own
            assert not fresh.deduplicated and fresh.id != lost.id
            assert fresh.get(timeout=30) == "o1"
            with taskdedup.transaction(conn):
                conn.execute(f"INSERT INTO {orders} VALUES ('o2')")
                kept = send_invoice.delay("o2")
                assert not kept.deduplicated
            assert kept.get(timeout=30) == "o2"
        count = psycopg.connect(postgres_url).execute(f"SELECT count(*) FROM {orders}")
        assert count.fetchone() == (1,)  # o1 was rolled back, o2 committed
    assert sorted(ran) == ["o1", "o2"]  # the rolled-back job never ran


def test_a_concurrent_enqueue_waits_for_the_transaction_and_gets_its_job(
    app: Celery, postgres_url: str
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def rebuild(name: str) -> str:
        return name

    inside, answered = threading.Event(), threading.Event()
    other: list[Any] = []

    def concurrent() -> None:
        assert inside.wait(10)
        other.append(rebuild.delay("site"))  # waits for the transaction's key
        answered.set()

    thread = threading.Thread(target=concurrent)
    thread.start()
    with psycopg.connect(postgres_url) as conn, taskdedup.transaction(conn):
        first = rebuild.delay("site")
        inside.set()
        assert not answered.wait(0.5), "the concurrent enqueue did not wait for the commit"
    thread.join(10)
    assert other and other[0].deduplicated and other[0].id == first.id


def test_a_rolled_back_transaction_lets_the_waiting_enqueue_take_the_key(
    app: Celery, postgres_url: str
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def rebuild(name: str) -> str:
        return name

    inside = threading.Event()
    other: list[Any] = []
    thread = threading.Thread(target=lambda: inside.wait(10) and other.append(rebuild.delay("x")))
    thread.start()
    with (
        psycopg.connect(postgres_url) as conn,
        pytest.raises(RuntimeError),
        taskdedup.transaction(conn),
    ):
        lost = rebuild.delay("x")
        inside.set()
        raise RuntimeError
    thread.join(10)
    assert other and not other[0].deduplicated and other[0].id != lost.id


def test_a_sqlalchemy_session_publishes_on_commit_and_drops_on_rollback(
    app: Celery, postgres_url: str, orders: str
) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    ran: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False)
    def ship(order: str) -> str:
        ran.append(order)
        return order

    engine = create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with start_worker(app, pool="solo", perform_ping_check=False):
        with Session(engine) as session:
            with taskdedup.transaction(session):
                session.execute(text(f"INSERT INTO {orders} VALUES ('s1')"))
                lost = ship.delay("s1")
            session.rollback()
            with taskdedup.transaction(session):
                session.execute(text(f"INSERT INTO {orders} VALUES ('s2')"))
                kept = ship.delay("s2")
            session.commit()
        assert kept.get(timeout=30) == "s2"
        again = ship.delay("s1")
        assert not again.deduplicated and again.id != lost.id  # no lock was left
        assert again.get(timeout=30) == "s1"
    engine.dispose()
    assert sorted(ran) == ["s1", "s2"]


def test_taskiq_kicks_after_the_commit_of_an_async_session(
    postgres_url: str, key_prefix: str, orders: str
) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from taskiq import InMemoryBroker

    from taskdedup.taskiq import DedupMiddleware

    ran: list[str] = []
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(postgres_url, key_prefix=key_prefix))

    @broker.task(deduplicate="until_executed")
    async def welcome(user: str) -> None:
        ran.append(user)

    async def main() -> None:
        await broker.startup()
        engine = create_async_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(RuntimeError):
                    async with taskdedup.atransaction(session):
                        await session.execute(text(f"INSERT INTO {orders} VALUES ('u1')"))
                        lost = await welcome.kiq("u1")
                        assert not lost.deduplicated
                        raise RuntimeError
                async with taskdedup.atransaction(session):
                    await session.execute(text(f"INSERT INTO {orders} VALUES ('u2')"))
                    await welcome.kiq("u2")
                    assert ran == []  # not before the commit
            await broker.wait_all()
            assert ran == ["u2"]
            fresh = await welcome.kiq("u1")  # the rolled-back one left no lock
            assert not fresh.deduplicated and fresh.task_id != lost.task_id
        finally:
            await engine.dispose()
            await broker.shutdown()

    asyncio.run(main())


def test_django_atomic_is_joined_by_itself(
    app: Celery, postgres_url: str, orders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = psycopg.conninfo.conninfo_to_dict(postgres_url)
    django_settings(info)
    from django.db import connection, transaction

    ran: list[str] = []

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(order: str) -> str:
        ran.append(order)
        return order

    with start_worker(app, pool="solo", perform_ping_check=False):
        with pytest.raises(RuntimeError), transaction.atomic():
            connection.cursor().execute(f"INSERT INTO {orders} VALUES ('d1')")
            lost = notify.delay("d1")
            raise RuntimeError
        with transaction.atomic():
            connection.cursor().execute(f"INSERT INTO {orders} VALUES ('d2')")
            kept = notify.delay("d2")
            again = notify.delay("d2")  # in the same transaction: its job, at once
            assert again.deduplicated and again.id == kept.id
        assert kept.get(timeout=30) == "d2"
        fresh = notify.delay("d1")
        assert not fresh.deduplicated and fresh.id != lost.id
        assert fresh.get(timeout=30) == "d1"
    connection.close()
    assert sorted(ran) == ["d1", "d2"]


def django_settings(info: dict[str, Any]) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": info.get("dbname", "postgres"),
                    "USER": info.get("user", "postgres"),
                    "PASSWORD": info.get("password", ""),
                    "HOST": info.get("host", ""),
                    "PORT": info.get("port", ""),
                }
            },
            USE_TZ=True,
        )
        django.setup()


def test_a_transaction_already_open_is_refused_with_what_to_do(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        conn.execute("SELECT 1")  # (psycopg opened a transaction)
        with (
            pytest.raises(ConfigError, match="must open the transaction"),
            taskdedup.transaction(conn),
        ):
            pass


KILLED_AFTER_COMMIT = """
import os, signal, sys
import psycopg
import taskdedup
from celery import Celery
from taskdedup.celery import deduplicate, install
sys.path.insert(0, {here!r})
from test_celery import make_app
app = make_app({redis!r}, {prefix!r}, taskdedup_url={pg!r}, taskdedup_grace=1.0)
install(app)

@deduplicate("until_executed")
@app.task(shared=False)
def charge(order):
    return order

with psycopg.connect({pg!r}) as conn:
    with taskdedup.transaction(conn) as tx:
        job = charge.delay("k1")
        print(job.id, flush=True)
        tx.pending.insert(0, lambda: os.kill(os.getpid(), signal.SIGKILL))  # dies before it
"""


def test_a_process_killed_between_commit_and_publish_leaves_the_key_free_within_grace(
    app: Celery, redis_url: str, postgres_url: str, key_prefix: str
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def charge(order: str) -> str:
        return order

    script = KILLED_AFTER_COMMIT.format(
        here=str(HERE), redis=redis_url, prefix=key_prefix, pg=postgres_url
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    lost = done.stdout.strip()
    store = PostgresStore(postgres_url, key_prefix=key_prefix)
    try:
        (lock,) = store.run(Scan())  # committed, never published, never confirmed
        assert lock.job_id == lost and not lock.confirmed
        wait_for(lambda: store.run(Inspect(lock.key)) is None, 1.0 + 5, "the lock to lapse")
    finally:
        store.close()
    fresh = charge.delay("k1")  # the key is free: a job of its own, holding it
    assert not fresh.deduplicated and fresh.id != lost
    assert charge.delay("k1").id == fresh.id
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert fresh.get(timeout=30) == "k1"
