"""``apply_async``: plain Celery, taskdedup, celery-once, celery-singleton and taskdedup's drop-ins
for the last two (``taskdedup.compat``: the peer's key plus taskdedup's lock), on each layout
users deploy: a RabbitMQ broker with a Redis store; a Redis broker with the store in another
database; a Redis broker whose server and database the store shares (fused: lock and message in
one script). The peers keep their locks on the same Redis as taskdedup's store; a drop-in is
configured as its original, with taskdedup's store as taskdedup's row has it. Then plain Celery
and taskdedup on a RabbitMQ broker with a PostgreSQL store and with a SQLite store (the peers
have no SQL backend), selected as users do, by ``app.conf.taskdedup_url``.

Each library deduplicates one task; every row makes ``n`` sequential calls from one client,
with unique arguments (every call publishes) and with one repeated argument (every call but the
first is a duplicate). Each library gets its own queue and key prefix, removed afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery

from benchmarks.common import Row, measure
from benchmarks.sql_stores import POSTGRESQL, SQLITE, SqlStores
from taskdedup import RedisStore
from taskdedup.celery import deduplicate, install, integration_for

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: layout -> the broker URL for a Redis URL (the store is always on that Redis URL).
LAYOUTS: dict[str, Callable[[str], str]] = {
    "RabbitMQ broker, Redis store": lambda url: AMQP_URL,
    "Redis broker, store apart": lambda url: other_db(url),
    "Redis broker, store fused": lambda url: url,
}
#: layout -> the SQL store of taskdedup's rows (the broker is RabbitMQ).
SQL_LAYOUTS = {
    "RabbitMQ broker, PostgreSQL store": POSTGRESQL,
    "RabbitMQ broker, SQLite store": SQLITE,
}


def other_db(url: str) -> str:
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 1) % 16}"))


def _app(url: str, prefix: str, broker: str | None = None) -> Celery:
    app = Celery(prefix, broker=broker or url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}-q",
        broker_transport_options={"global_keyprefix": f"{prefix}:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        task_ignore_result=True,
    )
    return app


def plain(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    app = _app(url, prefix, broker)

    @app.task(shared=False)
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


def _install(app: Celery, url: str, prefix: str, broker: str) -> None:
    """taskdedup on ``app``, its store on ``url`` under ``prefix``: fused with the broker when
    the broker is that Redis URL, apart otherwise. (A compat task installs taskdedup on its app
    when it is bound, unless the app has it already: called first, this is the install.)"""
    app.conf.taskdedup_key_prefix = prefix
    if broker == url:
        install(app)  # the store made from the broker's URL: fused
    else:
        install(app, store=RedisStore.from_url(url, key_prefix=prefix))


def taskdedup(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    app = _app(url, prefix, broker)
    _install(app, url, prefix, broker)

    @deduplicate("until_executed")
    @app.task(shared=False)
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


class OnSql:
    """taskdedup's sender on a SQL store (``app.conf.taskdedup_url``); :meth:`close` flushes
    its confirmations, drops its tables and closes the store."""

    def __init__(self, store_url: str, sql: SqlStores, url: str, prefix: str, broker: str):
        self.sql = sql
        self.app = app = _app(url, prefix, broker)
        app.conf.taskdedup_key_prefix = prefix
        app.conf.taskdedup_url = store_url
        install(app)

        @deduplicate("until_executed")
        @app.task(shared=False)
        def work(x: int) -> None: ...

        self.work = work

    def __call__(self, args: tuple[Any, ...]) -> Any:
        return self.work.apply_async(args)  # looked up per call, as user code does

    def close(self) -> None:
        integ = integration_for(self.app)
        if integ is not None:
            integ.dedup.close()
            self.sql.drop(integ.dedup.store)


def celery_once(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    from celery_once import AlreadyQueued, QueueOnce

    app = _app(url, prefix, broker)
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": url, "default_timeout": 3600},
    }

    @app.task(shared=False, base=QueueOnce, once={"graceful": False}, name=f"{prefix}.work")
    def work(x: int) -> None: ...

    def call(args: tuple[Any, ...]) -> Any:
        try:
            return work.apply_async(args)
        except AlreadyQueued:
            return None

    return call


def celery_singleton(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    from celery_singleton import Singleton

    app = _app(url, prefix, broker)
    app.conf.singleton_backend_url = url
    app.conf.singleton_key_prefix = f"{prefix}:singleton:"

    @app.task(shared=False, base=Singleton, name=f"{prefix}.work")
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


def celery_once_compat(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    """celery-once's drop-in, configured as :func:`celery_once`, taskdedup's store as
    :func:`taskdedup`'s."""
    from taskdedup.compat.celery_once import AlreadyQueued, QueueOnce

    app = _app(url, prefix, broker)
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": url, "default_timeout": 3600},
    }
    _install(app, url, prefix, broker)

    @app.task(shared=False, base=QueueOnce, once={"graceful": False}, name=f"{prefix}.work")
    def work(x: int) -> None: ...

    def call(args: tuple[Any, ...]) -> Any:
        try:
            return work.apply_async(args)
        except AlreadyQueued:
            return None

    return call


def celery_singleton_compat(url: str, prefix: str, broker: str) -> Callable[..., Any]:
    """celery-singleton's drop-in, configured as :func:`celery_singleton`, taskdedup's store
    as :func:`taskdedup`'s."""
    from taskdedup.compat.celery_singleton import Singleton

    app = _app(url, prefix, broker)
    app.conf.singleton_backend_url = url
    app.conf.singleton_key_prefix = f"{prefix}:singleton:"
    _install(app, url, prefix, broker)

    @app.task(shared=False, base=Singleton, name=f"{prefix}.work")
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


LIBRARIES: dict[str, Callable[[str, str, str], Callable[..., Any]]] = {
    "plain Celery": plain,
    "taskdedup": taskdedup,
    "celery-once": celery_once,
    "celery-once (taskdedup.compat)": celery_once_compat,
    "celery-singleton": celery_singleton,
    "celery-singleton (taskdedup.compat)": celery_singleton_compat,
}


def run(url: str, n: int = 4000, rounds: int = 20, sql: SqlStores | None = None) -> list[Row]:
    """Every layout, each library interleaved over ``rounds`` so machine noise falls on all of
    them alike; the SQL layouts after the Redis ones, for the SQL stores ``sql`` can measure. A
    layout whose broker (or store) does not answer is left out (and said so)."""
    rows: list[Row] = []
    for layout, broker_for in LAYOUTS.items():
        broker = broker_for(url)
        if broker.startswith("amqp") and not _answers(broker):
            print(f"(skipped: {layout}: no broker at {broker})")
            continue
        rows += _run_layout(layout, url, broker, n, rounds, LIBRARIES)
    for layout, kind in SQL_LAYOUTS.items():
        if sql is None or kind not in sql.kinds:
            continue  # (sql_stores said why)
        if not _answers(AMQP_URL):
            print(f"(skipped: {layout}: no broker at {AMQP_URL})")
            continue
        libraries: dict[str, Callable[[str, str, str], Callable[..., Any]]] = {
            "plain Celery": plain,
            "taskdedup": partial(OnSql, sql.url(kind), sql),
        }
        rows += _run_layout(layout, url, AMQP_URL, n, rounds, libraries)
    return rows


def _answers(broker: str) -> bool:
    from kombu import Connection

    try:
        with Connection(broker, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


def _run_layout(
    layout: str,
    url: str,
    broker: str,
    n: int,
    rounds: int,
    libraries: dict[str, Callable[[str, str, str], Callable[..., Any]]],
) -> list[Row]:
    group = f"Celery apply_async ({layout})"
    client = redis.Redis.from_url(url)
    prefixes = {name: "tdbench-" + uuid.uuid4().hex[:8] for name in libraries}
    senders: dict[str, Callable[..., Any]] = {}
    try:
        for name, make in libraries.items():
            senders[name] = make(url, prefixes[name], broker)
        samples: dict[str, list[int]] = {}
        counter = 0
        for _ in range(rounds):
            for name, send in senders.items():
                for label, args in (("unique args", None), ("repeated args", (-7,))):
                    start = counter
                    counter += n // rounds + 100
                    row = measure(
                        group,
                        label,
                        n // rounds,
                        lambda i, a=args, s=start, f=send: f(a or (s + i,)),
                    )
                    samples.setdefault(f"{name}, {label}", []).extend(row.samples_ns)
        return [Row(group, name, values) for name, values in samples.items()]
    finally:
        for send in senders.values():
            if isinstance(send, OnSql):
                send.close()
        _clean(url, broker, prefixes.values())
        client.close()


def _clean(url: str, broker: str, prefixes: Any) -> None:
    """Delete every queue and key the run made (RabbitMQ queues by name, Redis by prefix)."""
    for where in {url, broker}:
        if where.startswith("amqp"):
            from kombu import Connection

            with Connection(where) as conn:
                for prefix in prefixes:
                    conn.default_channel.queue_delete(f"{prefix}-q")
            continue
        client = redis.Redis.from_url(where)
        for prefix in prefixes:  # celery-once names its keys "qo_<task name>..."
            for pattern in (prefix + "*", "qo_" + prefix + "*"):
                for key in client.scan_iter(match=pattern, count=1000):
                    client.unlink(key)
        client.close()
