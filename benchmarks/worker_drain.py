"""The worker side: a solo-pool Celery worker draining ``n`` queued no-op jobs.

Plain Celery, taskdedup (until_executing and until_executed: a claim and a finish per job),
celery-once and celery-singleton, and taskdedup's drop-ins for them (``taskdedup.compat``: on
the worker, taskdedup's claim and finish, and the peer's key adopted on the job's lease and
released at its end), on a Redis broker with taskdedup's store apart and fused; then plain
Celery and taskdedup on the same broker as "store apart" with a PostgreSQL store and with a
SQLite store (``app.conf.taskdedup_url``; the peers have no SQL backend). Each run enqueues its
jobs first, then starts an in-process worker (``celery.contrib.testing.worker``) and times from
the first job's start to the last job's end; every layout's libraries take turns within each of
``rounds``, so machine noise falls on all of them alike.

A RabbitMQ broker is not measured here: an in-process worker without heartbeats holds its
acks on RabbitMQ (Celery 5.x), which would measure that stall, not the libraries.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from benchmarks.celery_publish import other_db
from benchmarks.common import Row
from benchmarks.sql_stores import POSTGRESQL, SQLITE, SqlStores
from taskdedup import RedisStore
from taskdedup.celery import deduplicate, install, integration_for

GROUP = "Celery worker drain, solo pool"


class Drain:
    """One library's app and task, counting the jobs its worker ran. ``sql``: taskdedup's
    store is this SQL store (its URL and the run's :class:`SqlStores`), not the Redis one."""

    def __init__(
        self, url: str, broker: str, library: str, sql: tuple[str, SqlStores] | None = None
    ) -> None:
        self.prefix = "tdbench-" + uuid.uuid4().hex[:8]
        self.url, self.broker, self.sql = url, broker, sql
        self.app = app = Celery(self.prefix, broker=broker, set_as_current=False)
        app.conf.update(
            task_default_queue=f"{self.prefix}-q",
            task_ignore_result=True,
            worker_hijack_root_logger=False,
            broker_transport_options={"global_keyprefix": f"{self.prefix}:"},
            taskdedup_key_prefix=self.prefix,
        )
        self.ran = 0
        self.first = self.last = 0.0
        self.done = threading.Event()
        self.target = 0
        self.task = self._task(library)

    def _task(self, library: str) -> Any:
        def body(x: int) -> None:
            now = time.perf_counter()
            self.first = self.first or now
            self.ran += 1
            self.last = now
            if self.ran >= self.target:
                self.done.set()

        app = self.app
        if library == "plain Celery":
            return app.task(shared=False, name="drain")(body)
        compat = library.endswith(COMPAT)
        if compat:  # taskdedup's store as taskdedup's rows have it (the task's bind keeps it)
            self._install()
        if library.startswith("celery-once"):
            if compat:
                from taskdedup.compat.celery_once import QueueOnce
            else:
                from celery_once import QueueOnce

            app.conf.ONCE = {
                "backend": "celery_once.backends.Redis",
                "settings": {"url": self.url, "default_timeout": 3600},
            }
            return app.task(shared=False, base=QueueOnce, once={"graceful": True}, name="drain")(
                body
            )
        if library.startswith("celery-singleton"):
            if compat:
                from taskdedup.compat.celery_singleton import Singleton
            else:
                from celery_singleton import Singleton

            app.conf.singleton_backend_url = self.url
            app.conf.singleton_key_prefix = f"{self.prefix}:singleton:"
            return app.task(shared=False, base=Singleton, name="drain")(body)
        strategy = library.split(", ")[1]
        self._install()
        return deduplicate(strategy)(app.task(shared=False, name="drain")(body))

    def _install(self) -> None:
        """taskdedup on the app: its SQL store, else the store fused with the broker when the
        broker is the store's Redis URL, else the store apart."""
        if self.sql is not None:
            self.app.conf.taskdedup_url = self.sql[0]
            install(self.app)
        elif self.broker == self.url:
            install(self.app)
        else:
            install(self.app, store=RedisStore.from_url(self.url, key_prefix=self.prefix))

    def jobs_per_second(self, n: int) -> float:
        self.ran, self.first, self.last, self.target = 0, 0.0, 0.0, n
        self.done.clear()
        start = uuid.uuid4().int % 1_000_000_000
        for i in range(n):
            self.task.delay(start + i)
        with start_worker(self.app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            if not self.done.wait(300):
                raise RuntimeError(f"the worker ran {self.ran} of {n} jobs in 300 s")
        return (n - 1) / (self.last - self.first)

    def clean(self) -> None:
        integ = integration_for(self.app)
        if self.sql is not None and integ is not None:
            integ.dedup.close()
            self.sql[1].drop(integ.dedup.store)
        for where in {self.url, self.broker}:
            client = redis.Redis.from_url(where)
            for pattern in (self.prefix + "*", "qo_*" + self.prefix + "*"):
                for key in client.scan_iter(match=pattern, count=1000):
                    client.unlink(key)
            client.close()


#: a drop-in's name: its original's, then this
COMPAT = " (taskdedup.compat)"
LIBRARIES = (
    "plain Celery",
    "taskdedup, until_executing",
    "taskdedup, until_executed",
    "celery-once",
    "celery-once" + COMPAT,
    "celery-singleton",
    "celery-singleton" + COMPAT,
)
LAYOUTS: dict[str, Callable[[str], str]] = {
    "Redis broker, store apart": other_db,
    "Redis broker, store fused": lambda url: url,
}
#: layout -> the SQL store of taskdedup's rows (the broker is "store apart"'s).
SQL_LAYOUTS = {
    "Redis broker, PostgreSQL store": POSTGRESQL,
    "Redis broker, SQLite store": SQLITE,
}
SQL_LIBRARIES = LIBRARIES[:3]  # plain Celery and taskdedup's two strategies


def run(url: str, n: int = 1000, rounds: int = 3, sql: SqlStores | None = None) -> list[Row]:
    """Rows whose samples are the time per job (ns) of each round's drain: the Redis layouts,
    then the SQL ones for the stores ``sql`` can measure."""
    layouts: dict[str, dict[str, Drain]] = {}
    try:
        for layout, broker_for in LAYOUTS.items():
            layouts[layout] = {name: Drain(url, broker_for(url), name) for name in LIBRARIES}
        for layout, kind in SQL_LAYOUTS.items():
            if sql is not None and kind in sql.kinds:
                store = (sql.url(kind), sql)
                layouts[layout] = {
                    name: Drain(url, other_db(url), name, store) for name in SQL_LIBRARIES
                }
        rates: dict[str, dict[str, list[float]]] = {
            layout: {name: [] for name in drains} for layout, drains in layouts.items()
        }
        for _ in range(rounds):
            for layout, drains in layouts.items():
                for name, drain in drains.items():
                    rates[layout][name].append(drain.jobs_per_second(n))
    finally:
        for drains in layouts.values():
            for drain in drains.values():
                drain.clean()
    rows = []
    for layout, found in rates.items():
        for name, values in found.items():
            per_job = [round(1e9 / rate) for rate in values]
            rows.append(Row(f"{GROUP} ({layout})", f"{name}, {n} jobs", per_job))
        print(
            f"{layout}: " + ", ".join(f"{k} {statistics.median(v):.0f}/s" for k, v in found.items())
        )
    return rows
