"""``apply_async`` on a Redis broker: plain Celery, taskdedup, celery-once, celery-singleton.

Each library deduplicates one task; every row makes ``n`` sequential calls from one client,
with unique arguments (every call publishes) and with one repeated argument (every call but the
first is a duplicate). Each library gets its own queue and key prefix, removed afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from benchmarks.common import Row, measure
from taskdedup.celery import deduplicate, install

GROUP = "Celery apply_async (Redis broker)"


def _app(url: str, prefix: str) -> Celery:
    app = Celery(prefix, broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}-q",
        broker_transport_options={"global_keyprefix": f"{prefix}:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        task_ignore_result=True,
    )
    return app


def plain(url: str, prefix: str) -> Callable[..., Any]:
    app = _app(url, prefix)

    @app.task(shared=False)
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


def taskdedup(url: str, prefix: str) -> Callable[..., Any]:
    app = _app(url, prefix)
    app.conf.taskdedup_key_prefix = prefix
    install(app)

    @deduplicate("until_executed")
    @app.task(shared=False)
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


def celery_once(url: str, prefix: str) -> Callable[..., Any]:
    from celery_once import AlreadyQueued, QueueOnce

    app = _app(url, prefix)
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


def celery_singleton(url: str, prefix: str) -> Callable[..., Any]:
    from celery_singleton import Singleton

    app = _app(url, prefix)
    app.conf.singleton_backend_url = url
    app.conf.singleton_key_prefix = f"{prefix}:singleton:"

    @app.task(shared=False, base=Singleton, name=f"{prefix}.work")
    def work(x: int) -> None: ...

    return lambda args: work.apply_async(args)  # looked up per call, as user code does


LIBRARIES: dict[str, Callable[[str, str], Callable[..., Any]]] = {
    "plain Celery": plain,
    "taskdedup": taskdedup,
    "celery-once": celery_once,
    "celery-singleton": celery_singleton,
}


def run(url: str, n: int = 4000, rounds: int = 20) -> list[Row]:
    """Interleave the libraries over ``rounds`` so machine noise falls on all of them alike."""
    client = redis.Redis.from_url(url)
    prefixes = {name: "tdbench-" + uuid.uuid4().hex[:8] for name in LIBRARIES}
    try:
        senders = {name: make(url, prefixes[name]) for name, make in LIBRARIES.items()}
        samples: dict[str, list[int]] = {}
        counter = 0
        for _ in range(rounds):
            for name, send in senders.items():
                for label, args in (("unique args", None), ("repeated args", (-7,))):
                    start = counter
                    counter += n // rounds + 100
                    row = measure(
                        GROUP,
                        label,
                        n // rounds,
                        lambda i, a=args, s=start, f=send: f(a or (s + i,)),
                    )
                    samples.setdefault(f"{name}, {label}", []).extend(row.samples_ns)
        return [Row(GROUP, name, values) for name, values in samples.items()]
    finally:
        for prefix in prefixes.values():  # celery-once names its keys "qo_<task name>..."
            for pattern in (prefix + "*", "qo_" + prefix + "*"):
                for key in client.scan_iter(match=pattern, count=1000):
                    client.unlink(key)
        client.close()
