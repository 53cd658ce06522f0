"""The worker side: a solo-pool Celery worker draining ``n`` queued no-op jobs.

Plain Celery, taskdedup (until_executing and until_executed: a claim and a finish per job) and
celery-once, on a Redis broker with taskdedup's store apart and fused. Each run enqueues its
jobs first, then starts an in-process worker (``celery.contrib.testing.worker``) and times from
the first job's start to the last job's end; the libraries take turns over ``rounds``.

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
from taskdedup import RedisStore
from taskdedup.celery import deduplicate, install

GROUP = "Celery worker drain, solo pool"


class Drain:
    """One library's app and task, counting the jobs its worker ran."""

    def __init__(self, url: str, broker: str, library: str) -> None:
        self.prefix = "tdbench-" + uuid.uuid4().hex[:8]
        self.url, self.broker = url, broker
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
        if library == "celery-once":
            from celery_once import QueueOnce

            app.conf.ONCE = {
                "backend": "celery_once.backends.Redis",
                "settings": {"url": self.url, "default_timeout": 3600},
            }
            return app.task(shared=False, base=QueueOnce, once={"graceful": True}, name="drain")(
                body
            )
        strategy = library.split(", ")[1]
        if self.broker == self.url:
            install(app)
        else:
            install(app, store=RedisStore.from_url(self.url, key_prefix=self.prefix))
        return deduplicate(strategy)(app.task(shared=False, name="drain")(body))

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
        for where in {self.url, self.broker}:
            client = redis.Redis.from_url(where)
            for pattern in (self.prefix + "*", "qo_*" + self.prefix + "*"):
                for key in client.scan_iter(match=pattern, count=1000):
                    client.unlink(key)
            client.close()


LIBRARIES = (
    "plain Celery",
    "taskdedup, until_executing",
    "taskdedup, until_executed",
    "celery-once",
)
LAYOUTS: dict[str, Callable[[str], str]] = {
    "Redis broker, store apart": other_db,
    "Redis broker, store fused": lambda url: url,
}


def run(url: str, n: int = 1000, rounds: int = 3) -> list[Row]:
    """Rows whose samples are the time per job (ns) of each round's drain."""
    rows = []
    for layout, broker_for in LAYOUTS.items():
        drains = {name: Drain(url, broker_for(url), name) for name in LIBRARIES}
        rates: dict[str, list[float]] = {name: [] for name in LIBRARIES}
        try:
            for _ in range(rounds):
                for name, drain in drains.items():
                    rates[name].append(drain.jobs_per_second(n))
        finally:
            for drain in drains.values():
                drain.clean()
        for name, values in rates.items():
            per_job = [round(1e9 / rate) for rate in values]
            rows.append(Row(f"{GROUP} ({layout})", f"{name}, {n} jobs", per_job))
        print(
            f"{layout}: " + ", ".join(f"{k} {statistics.median(v):.0f}/s" for k, v in rates.items())
        )
    return rows
