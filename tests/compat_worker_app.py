"""A Celery app whose tasks use the compat drop-ins, for tests that run a real prefork worker
in a subprocess (kill -9). Every key it writes is under the test's prefix: the broker's, the
results', taskdedup's, celery-singleton's (``singleton_key_prefix``) and celery-once's (its keys
are ``qo_<task name>...``, and the task names start with the prefix).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, signals

from taskdedup.compat.celery_once import QueueOnce
from taskdedup.compat.celery_singleton import Singleton

URL = os.environ["TD_REDIS_URL"]
PREFIX = os.environ["TD_PREFIX"]

app = Celery("compat_app", broker=URL, backend=URL, set_as_current=True)
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{PREFIX}:kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:result:"},
    task_default_queue=f"{PREFIX}-q",
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    taskdedup_key_prefix=PREFIX,
    # a killed job's locks lapse within the lease: 2 s, or the test's TD_LEASE
    taskdedup_default_lease=float(os.environ.get("TD_LEASE", "2")),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": URL, "default_timeout": 600},
    },
    singleton_key_prefix=f"{PREFIX}:SINGLETONLOCK_",
)
marks = redis.Redis.from_url(URL)


@signals.worker_ready.connect
def ready(**_: object) -> None:
    marks.set(f"{PREFIX}:mark:ready", 1, ex=600)


def _run(name: str, seconds: float) -> str:
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    time.sleep(seconds)
    return name


@app.task(base=QueueOnce, name=f"{PREFIX}.once_job", once={"keys": ["name"]}, shared=False)
def once_job(name: str, seconds: float) -> str:
    return _run(name, seconds)


@app.task(base=Singleton, name=f"{PREFIX}.singleton_job", unique_on=["name"], shared=False)
def singleton_job(name: str, seconds: float) -> str:
    return _run(name, seconds)
