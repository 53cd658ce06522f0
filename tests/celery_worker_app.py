"""A Celery app for tests that run a real worker in a subprocess (prefork pool, kill -9).

The test passes the Redis URL and its key prefix in the environment; every key the app writes
(broker, results, locks, markers) is under that prefix.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, signals

from taskdedup.celery import deduplicate, install, pace, reserve

URL = os.environ["TD_REDIS_URL"]
BROKER = os.environ.get("TD_BROKER_URL") or URL
PREFIX = os.environ["TD_PREFIX"]
VISIBILITY = float(os.environ.get("TD_VISIBILITY_TIMEOUT", "3600"))

app = Celery("subprocess_app", broker=BROKER, backend=URL, set_as_current=True)
app.conf.update(
    broker_transport_options={
        "global_keyprefix": f"{PREFIX}:kombu:",
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,  # look for expired unacked messages every second
        "unacked_restore_throttle": 1,
    },
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:result:"},
    task_default_queue=f"{PREFIX}-q",
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    taskdedup_key_prefix=PREFIX,
    taskdedup_url=os.environ.get("TD_STORE_URL") or URL,
    taskdedup_on_store_error=os.environ.get("TD_ON_STORE_ERROR") or "enqueue",
    broker_heartbeat=0,
    taskdedup_default_lease=2,  # the slot lease of capped_job
    taskdedup_grace=float(os.environ.get("TD_GRACE", "60")),
)
install(app)
marks = redis.Redis.from_url(URL)


@signals.worker_ready.connect
def ready(**_: object) -> None:
    marks.set(f"{PREFIX}:mark:ready", 1, ex=600)


@deduplicate("until_executed", lease=2, keys=["name"])
@app.task(name="sub.long_job", shared=False)
def long_job(name: str, seconds: float) -> str:
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    time.sleep(seconds)
    return name


@deduplicate("until_executed", lease=2, keys=["name"])
@app.task(name="sub.late_job", acks_late=True, shared=False)
def late_job(name: str, seconds: float) -> str:
    """Counts its runs; only the first run takes ``seconds``."""
    runs = marks.incr(f"{PREFIX}:mark:runs:{name}")
    marks.expire(f"{PREFIX}:mark:runs:{name}", 600)
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    if runs == 1:
        time.sleep(seconds)
    return name


@reserve(max_concurrent=1, scope="tenant")
@app.task(name="sub.capped_job", shared=False)
def capped_job(tenant: str, seconds: float) -> str:
    marks.set(f"{PREFIX}:mark:pid:{tenant}", os.getpid(), ex=600)
    time.sleep(seconds)
    return tenant


@deduplicate("until_executed", lease=2, keys=["name"], on_conflict="reschedule_once")
@app.task(name="sub.rescheduled_job", shared=False)
def rescheduled_job(name: str, seconds: float) -> str:
    """Counts its runs (tests/test_metrics.py): a duplicate while it runs owes one more."""
    marks.incr(f"{PREFIX}:mark:runs:{name}")
    marks.expire(f"{PREFIX}:mark:runs:{name}", 600)
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    time.sleep(seconds)
    return name


# ---- fault tests (tests/test_faults_celery.py): runs record their start and end --------------


def record_run(name: str, job_id: str, fence: object, event: str) -> None:
    """Append ``event job fence time`` to the run log of ``name`` (read by the test)."""
    log = f"{PREFIX}:mark:log:{name}"
    marks.rpush(log, f"{event} {job_id} {fence} {time.time():.6f} {os.getpid()}")
    marks.expire(log, 600)


@deduplicate("until_executed", lease=2, keys=["name"])
@app.task(name="sub.fenced_job", acks_late=True, bind=True, shared=False)
def fenced_job(self: object, name: str, seconds: float) -> str:
    """Records its start and end with its fencing token; sleeps ``seconds``, or the number of
    seconds in the mark ``sleep:<name>`` once the test has set it."""
    request = self.request  # type: ignore[attr-defined]
    fence = getattr(request, "taskdedup_fence", None)
    record_run(name, request.id, fence, "start")
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    override = marks.get(f"{PREFIX}:mark:sleep:{name}")
    time.sleep(float(override) if override is not None else seconds)
    record_run(name, request.id, fence, "end")
    return request.id  # type: ignore[no-any-return]


class Flaky(Exception):
    """A retryable failure (autoretry_for)."""


@deduplicate("until_executed", lease=1, keys=["name"])
@app.task(
    name="sub.retried_late_job",
    acks_late=True,
    bind=True,
    shared=False,
    autoretry_for=(Flaky,),
    retry_kwargs={"countdown": 3, "max_retries": 1},
)
def retried_late_job(self: object, name: str, seconds: float) -> str:
    """Attempt 0 takes ``seconds`` and fails (retried in 3 s); attempt 1 succeeds at once.
    Each run records its start and end with its attempt."""
    request = self.request  # type: ignore[attr-defined]
    attempt = request.retries or 0
    record_run(name, f"{request.id}/{attempt}", getattr(request, "taskdedup_fence", None), "start")
    if attempt == 0:
        time.sleep(seconds)
    record_run(name, f"{request.id}/{attempt}", None, "end")
    if attempt == 0:
        raise Flaky(name)
    return name


@signals.before_task_publish.connect
def die_while_sending_a_retry(sender: object = None, headers: object = None, **_: object) -> None:
    """kill -9 of the pool process that sends the first retry of killed_at_retry: after the
    store kept the lock for that retry, before the retry is in the broker."""
    retries = (headers or {}).get("retries") if isinstance(headers, dict) else None
    if (
        sender == "sub.killed_at_retry"
        and retries
        and marks.set(f"{PREFIX}:mark:killed_at_retry", 1, nx=True, ex=600)
    ):
        os.kill(os.getpid(), 9)


@deduplicate("until_executed", lease=1, keys=["name"])
@app.task(
    name="sub.killed_at_retry",
    acks_late=True,
    reject_on_worker_lost=True,
    bind=True,
    shared=False,
    autoretry_for=(Flaky,),
    retry_kwargs={"countdown": 1, "max_retries": 3},
)
def killed_at_retry(self: object, name: str) -> str:
    """Attempt 0 fails at once; its process dies sending the retry (the first time)."""
    request = self.request  # type: ignore[attr-defined]
    attempt = request.retries or 0
    record_run(name, f"{request.id}/{attempt}", None, "start")
    if attempt == 0:
        raise Flaky(name)
    return name


# ---------------------------------------------------------------- tests/test_celery_revoke.py
# Long jobs that are terminated while they run. The lease is long (60 s), so only the revoke
# handling can free their key or slot within seconds.


def _long_body(name: str, seconds: float) -> str:
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    time.sleep(seconds)
    return name


@deduplicate("until_executed", lease=60, keys=["name"])
@app.task(name="sub.revoke_until_executed", shared=False)
def revoke_until_executed(name: str, seconds: float) -> str:
    return _long_body(name, seconds)


@deduplicate("until_and_while_executing", lease=60, keys=["name"])
@app.task(name="sub.revoke_until_and_while", shared=False)
def revoke_until_and_while(name: str, seconds: float) -> str:
    return _long_body(name, seconds)


@reserve(max_concurrent=1, scope="tenant")
@deduplicate("until_executing", lease=60, keys=["tenant"])
@app.task(name="sub.revoke_capped", shared=False)
def revoke_capped(tenant: str, seconds: float) -> str:
    return _long_body(tenant, seconds)


@deduplicate("until_executed", lease=6, keys=["name"])
@app.task(name="sub.revoke_survivor", shared=False)
def revoke_survivor(name: str, seconds: float) -> str:
    """Ignores SIGUSR2 (a terminate with that signal) and runs on, counting half seconds."""
    import signal

    signal.signal(signal.SIGUSR2, lambda *_: None)
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        marks.incr(f"{PREFIX}:mark:ticks:{name}")
        marks.expire(f"{PREFIX}:mark:ticks:{name}", 600)
        time.sleep(0.5)
    return name


@deduplicate("debounce", delay=1, max_wait=3, lease=5, keys=["name"])
@app.task(name="sub.debounced_job", shared=False)
def debounced_job(name: str, n: int, seconds: float = 0.0) -> int:
    """Notes each run (its n, when it began, how many runs of the name were going on then)
    and, apart, its job id."""
    from celery import current_task

    marks.rpush(f"{PREFIX}:mark:jobs:{name}", current_task.request.id)
    marks.expire(f"{PREFIX}:mark:jobs:{name}", 600)
    return _noted_run(name, n, seconds)


def _noted_run(name: str, n: int, seconds: float) -> int:
    import json

    began = time.time()
    marks.set(f"{PREFIX}:mark:pid:{name}", os.getpid(), ex=600)
    active = marks.incr(f"{PREFIX}:mark:active:{name}")
    try:
        marks.rpush(f"{PREFIX}:mark:runs:{name}", json.dumps([n, began, active]))
        marks.expire(f"{PREFIX}:mark:runs:{name}", 600)
        time.sleep(seconds)
    finally:
        marks.decr(f"{PREFIX}:mark:active:{name}")
    return n


@deduplicate("until_executed", on_conflict="supersede", lease=3, keys=["name"])
@app.task(name="sub.superseding_late_job", acks_late=True, reject_on_worker_lost=True, shared=False)
def superseding_late_job(name: str, n: int, seconds: float = 0.0) -> int:
    """Notes each run; acks late: the broker delivers a killed run's message again."""
    return _noted_run(name, n, seconds)


@pace("10/s")
@app.task(name="sub.paced_job", bind=True, shared=False)
def paced_job(self: object, n: int) -> int:
    """Notes when it started, and the start it was given (its ETA; None for a job sent with no
    countdown) (issue 27: one every 100 ms, whoever submitted it)."""
    import json
    from datetime import datetime

    eta = self.request.eta  # type: ignore[attr-defined]
    given = None if eta is None else datetime.fromisoformat(str(eta)).timestamp()
    marks.rpush(f"{PREFIX}:mark:paced", json.dumps([n, time.time(), given]))
    marks.expire(f"{PREFIX}:mark:paced", 600)
    return n


# ---------------------------------------------------------------- tests/test_schedules.py
# Two `celery beat` processes send these entries every second; each run notes the slot of the
# tick it was sent for (the taskdedup_tick header), its job and its start and end.

app.conf.beat_schedule = {
    "every-second": {"task": "sub.every_tick", "schedule": 1.0, "args": ("every-second",)},
    "overrun-skip": {"task": "sub.overrun_skip", "schedule": 1.0, "args": ("overrun-skip",)},
    "overrun-buffer": {
        "task": "sub.overrun_buffer",
        "schedule": 1.0,
        "args": ("overrun-buffer",),
    },
}


def note_tick(task: object, entry: str, seconds: float) -> None:
    request = task.request  # type: ignore[attr-defined]
    slot = request.get("taskdedup_tick")
    log = f"{PREFIX}:mark:ticks:{entry}"
    marks.rpush(log, f"start {slot} {request.id} {time.time():.6f}")
    time.sleep(seconds)
    marks.rpush(log, f"end {slot} {request.id} {time.time():.6f}")
    marks.expire(log, 600)


@deduplicate("until_executed", lease=2, keys=["entry"])
@app.task(name="sub.every_tick", bind=True, shared=False)
def every_tick(self: object, entry: str) -> None:
    note_tick(self, entry, 0.0)


@deduplicate("until_executed", lease=2, keys=["entry"], overlap="skip")
@app.task(name="sub.overrun_skip", bind=True, shared=False)
def overrun_skip(self: object, entry: str) -> None:
    note_tick(self, entry, 2.2)


@deduplicate("until_executed", lease=2, keys=["entry"], overlap="buffer_one")
@app.task(name="sub.overrun_buffer", bind=True, shared=False)
def overrun_buffer(self: object, entry: str) -> None:
    note_tick(self, entry, 2.2)
