"""The soak's Celery app, imported by the workers (``celery -A chaos.app worker``) and producers.

Everything comes from the environment the orchestrator sets: the broker, the store (a Redis or
a PostgreSQL URL, see :func:`store_url`) and the records server. Each task body records its own
start and end (job id, attempt, fencing token, pid, wall-clock time) on the records server,
which no fault ever touches, so the checker can rebuild every execution afterwards.

Tasks: one per strategy, all keyed on ``name`` only, lease 2 s (kills are recovered quickly),
``acks_late`` with ``task_reject_on_worker_lost`` and a 5 s visibility timeout (a killed job is
delivered again, as at-least-once users configure it). ``behavior`` decides the outcome:
``ok``; ``flakyN`` raises a retryable error on its first N attempts (autoretry, max 3);
``fail`` raises a non-retryable error (a final failure).

The newest-wins tasks (``chaos.debounce``, ``chaos.supersede``, ``chaos.supersede_cancel``)
take a ``seq`` too, unique to each submission, which the start record keeps: the worker swaps
in the latest submission's arguments, so the seq tells whose arguments ran. The cancel task's
body works in small chunks and stops at the first checkpoint where a newer submission asked it
to (``raise_if_superseded``), its end record's outcome ``superseded``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery, signals

import taskdedup
from taskdedup.celery import deduplicate, install

from .config import (
    ACKED,
    DEBOUNCE_DELAY,
    DEBOUNCE_MAX_WAIT,
    GRACE,
    HELD,
    LEASE,
    LEDGER,
    MESSAGE_HEADER,
    MESSAGES,
    POPPED,
    PUBLISHED,
    PUBLISHES,
    QUEUE,
    RECEIVED,
    RUNNING,
    RUNS,
    STORE_PREFIX,
    STORE_TIMEOUT,
    TTL,
    VISIBILITY_TIMEOUT,
)

__all__ = ["LEDGER", "TASKS", "app", "records"]

BROKER_URL = os.environ["CHAOS_BROKER_URL"]
STORE_URL = os.environ["CHAOS_STORE_URL"]
RECORDS_URL = os.environ["CHAOS_RECORDS_URL"]


def store_url(url: str) -> str:
    """The ``taskdedup_url`` of the store at ``url``, each call bounded by STORE_TIMEOUT: on
    Redis the socket timeouts; on PostgreSQL the store's ``timeout`` (the wait for a pooled
    connection, and the server's statement and lock timeouts) and libpq's ``connect_timeout``
    (whole seconds, 2 at least). A PostgreSQL URL may carry a query already (the socket's
    ``host``)."""
    if url.startswith(("postgresql:", "postgres:")):
        joiner = "&" if "?" in url else "?"
        connect = max(2, STORE_TIMEOUT)
        return f"{url}{joiner}timeout={STORE_TIMEOUT}&connect_timeout={connect}"
    return f"{url}?socket_timeout={STORE_TIMEOUT}&socket_connect_timeout={STORE_TIMEOUT}"


app = Celery("chaos", broker=BROKER_URL, backend=RECORDS_URL, set_as_current=True)
app.conf.update(
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,  # look for messages of dead workers every second
        "unacked_restore_throttle": 1,
        # kombu's restore takes a mutex in Redis for unacked_mutex_expire (300 s by default);
        # a worker killed while it holds it leaves every killed job's message unrestored that
        # long, past the drain's deadline. Likely what a CI run met: 20 messages unacked for
        # 130 s, the lists empty, restarted workers alive and idle (nothing was restored). A
        # restore sweep takes milliseconds.
        "unacked_mutex_expire": 10,
    },
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_heartbeat=0,
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_expires=3600,
    taskdedup_url=store_url(STORE_URL),
    taskdedup_key_prefix=STORE_PREFIX,
    taskdedup_grace=GRACE,
    taskdedup_default_lease=LEASE,
)
if os.environ.get("CHAOS_ROLE") == "worker":
    # A retry (or taskdedup's own re-send) published while the broker restarts waits for it,
    # as a user running through broker restarts would configure it; producers keep Celery's
    # default and see the error.
    app.conf.task_publish_retry_policy = {
        "max_retries": 30,
        "interval_start": 0,
        "interval_step": 0.5,
        "interval_max": 1,
    }
install(app)
records = redis.Redis.from_url(RECORDS_URL)


class Flaky(Exception):
    """A retryable failure (autoretry_for)."""


class Broken(Exception):
    """A final failure: not retried."""


@signals.worker_ready.connect
def ready(sender: Any = None, **_: object) -> None:
    records.set(f"ready:{os.environ.get('CHAOS_WORKER_TAG', '?')}", os.getpid())


@signals.before_task_publish.connect
def tag_message(headers: Any = None, **_: object) -> None:
    """Each message gets a tag of its own (a re-sent copy of a job too), kept by the broker
    when it restores the message."""
    if headers is not None:
        headers[MESSAGE_HEADER] = uuid.uuid4().hex


@signals.after_task_publish.connect
def published(headers: Any = None, **_: object) -> None:
    """The message left kombu's publish: from here on, losing it is the transport's doing."""
    job = (headers or {}).get("id")
    if job:
        records.sadd(PUBLISHED, job)
        records.hincrby(PUBLISHES, job, 1)
        tag = (headers or {}).get(MESSAGE_HEADER)
        if tag:
            records.hset(MESSAGES, tag, json.dumps({"job": job, "t": time.time()}))


def _count_pops() -> None:
    """Count each message kombu hands to the worker's consumer, before Celery sees it: a job
    published but never received is then either never taken off the broker, or taken and lost
    inside the worker (killed between the two)."""
    from kombu.transport.virtual import base

    deliver = base.Transport._deliver

    def counted(self: Any, message: Any, queue: Any) -> None:
        job = ((message or {}).get("headers") or {}).get("id")
        if job:
            records.hincrby(POPPED, job, 1)
        deliver(self, message, queue)

    base.Transport._deliver = counted  # type: ignore[method-assign]


def _record_held() -> None:
    """Record when kombu's Redis transport holds each message as unacked (from then on the
    broker gives it back if the worker dies) and when a worker consumes it (ack, or reject
    without requeue). A message whose last record is not a consumption was back in the
    broker after it, or lost between a pop and the next hold."""
    from kombu.transport import redis as transport

    append, ack, reject = transport.QoS.append, transport.QoS.ack, transport.QoS.reject

    def tag_of(message: Any) -> Any:
        return (getattr(message, "headers", None) or {}).get(MESSAGE_HEADER)

    def held(self: Any, message: Any, delivery_tag: Any) -> None:
        append(self, message, delivery_tag)
        tag = tag_of(message)
        if tag:
            records.hset(HELD, tag, time.time())

    def consumed(self: Any, delivery_tag: Any) -> None:
        tag = tag_of(self._delivered.get(delivery_tag))
        if tag:
            records.hset(ACKED, tag, time.time())

    def acked(self: Any, delivery_tag: Any) -> None:
        consumed(self, delivery_tag)
        ack(self, delivery_tag)

    def rejected(self: Any, delivery_tag: Any, requeue: bool = False) -> None:
        if not requeue:
            consumed(self, delivery_tag)
        reject(self, delivery_tag, requeue=requeue)

    transport.QoS.append = held  # type: ignore[method-assign]
    transport.QoS.ack = acked  # type: ignore[method-assign]
    transport.QoS.reject = rejected  # type: ignore[method-assign]


if os.environ.get("CHAOS_ROLE") == "worker":
    _count_pops()
    _record_held()


@signals.task_received.connect
def received(request: Any = None, **_: object) -> None:
    """A worker took the message off the broker (each delivery counts)."""
    if request is not None:
        records.hincrby(RECEIVED, request.id, 1)


def body(
    task: Any,
    name: str,
    behavior: str,
    seconds: float,
    seq: str | None = None,
    checkpoints: bool = False,
) -> str:
    """Record the start, work for ``seconds``, record the end with its outcome. ``seq``: the
    submission whose arguments this run has (newest-wins tasks). ``checkpoints``: work in
    chunks of 50 ms and stop (outcome ``superseded``) once a newer submission asked to."""
    request = task.request
    run = uuid.uuid4().hex
    pid = os.getpid()
    start = {
        "ev": "start",
        "run": run,
        "task": task.name,
        "name": name,
        "job": request.id,
        "attempt": request.retries or 0,
        "fence": getattr(request, "taskdedup_fence", None),
        "dkey": getattr(request, "taskdedup_key", None),
        "pid": pid,
        "t": time.time(),
    }
    if seq is not None:
        start["seq"] = seq
    records.hset(RUNNING, str(pid), request.id)
    records.rpush(RUNS, json.dumps(start))
    stopped: Exception | None = None
    if checkpoints:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                taskdedup.raise_if_superseded()
            except taskdedup.Superseded as exc:
                stopped = exc
                break
            time.sleep(min(0.05, max(until - time.monotonic(), 0.0)))
    else:
        time.sleep(seconds)
    attempt = request.retries or 0
    if stopped is not None:
        outcome, error = "superseded", stopped
    elif behavior.startswith("flaky") and attempt < int(behavior[5:]):
        outcome, error = "retry", Flaky(f"{name} attempt {attempt}")
    elif behavior == "fail":
        outcome, error = "fail", Broken(name)
    else:
        outcome, error = "ok", None
    end = {"ev": "end", "run": run, "job": request.id, "pid": pid, "t": time.time()}
    end["outcome"] = outcome
    records.rpush(RUNS, json.dumps(end))
    records.hdel(RUNNING, str(pid))
    if error is not None:
        raise error
    return name


TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "autoretry_for": (Flaky,),
    "max_retries": 3,
    "default_retry_delay": 0.3,
    "shared": False,
}
#: including_scheduled: countdown jobs are deduplicated too, so "never two at once" is promised
#: for every job of these tasks, not only for those sent without a delay
POLICY: dict[str, Any] = {
    "lease": LEASE,
    "ttl": TTL,
    "keys": ["name"],
    "including_scheduled": True,
}


@deduplicate("until_executed", **POLICY)
@app.task(name="chaos.until_executed", **TASK_OPTIONS)
def until_executed(self: Any, name: str, behavior: str = "ok", seconds: float = 0.1) -> str:
    return body(self, name, behavior, seconds)


@deduplicate("until_and_while_executing", **POLICY)
@app.task(name="chaos.until_and_while_executing", **TASK_OPTIONS)
def until_and_while_executing(
    self: Any, name: str, behavior: str = "ok", seconds: float = 0.1
) -> str:
    return body(self, name, behavior, seconds)


@deduplicate("while_executing", **POLICY)
@app.task(name="chaos.while_executing", **TASK_OPTIONS)
def while_executing(self: Any, name: str, behavior: str = "ok", seconds: float = 0.1) -> str:
    return body(self, name, behavior, seconds)


@deduplicate("until_executing", **POLICY)
@app.task(name="chaos.until_executing", **TASK_OPTIONS)
def until_executing(self: Any, name: str, behavior: str = "ok", seconds: float = 0.1) -> str:
    return body(self, name, behavior, seconds)


#: the newest-wins tasks: no countdown for debounce (its run's time is the burst's, not a
#: message's), so including_scheduled is left out there
NEWEST: dict[str, Any] = {"lease": LEASE, "ttl": TTL, "keys": ["name"]}


@deduplicate("debounce", delay=DEBOUNCE_DELAY, max_wait=DEBOUNCE_MAX_WAIT, **NEWEST)
@app.task(name="chaos.debounce", **TASK_OPTIONS)
def debounce(self: Any, name: str, seq: str, behavior: str = "ok", seconds: float = 0.1) -> str:
    return body(self, name, behavior, seconds, seq)


@deduplicate("until_executed", on_conflict="supersede", including_scheduled=True, **NEWEST)
@app.task(name="chaos.supersede", **TASK_OPTIONS)
def supersede(self: Any, name: str, seq: str, behavior: str = "ok", seconds: float = 0.1) -> str:
    return body(self, name, behavior, seconds, seq)


@deduplicate(
    "until_executed", on_conflict="supersede", running="cancel", including_scheduled=True, **NEWEST
)
@app.task(name="chaos.supersede_cancel", **TASK_OPTIONS)
def supersede_cancel(
    self: Any, name: str, seq: str, behavior: str = "ok", seconds: float = 0.1
) -> str:
    return body(self, name, behavior, seconds, seq, checkpoints=True)


TASKS = {
    "until_executed": until_executed,
    "until_and_while_executing": until_and_while_executing,
    "while_executing": while_executing,
    "until_executing": until_executing,
    "debounce": debounce,
    "supersede": supersede,
    "supersede_cancel": supersede_cancel,
}
