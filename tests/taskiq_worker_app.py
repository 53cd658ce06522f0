"""A taskiq broker for tests that run real ``taskiq worker`` processes (kill -9, redelivery).

The test passes the Redis URL, its key prefix, the broker kind (``list`` or ``stream``) and the
middleware order in the environment; every key the app writes (queue, stream, results, locks,
markers) is under that prefix.
"""

from __future__ import annotations

import asyncio
import os
import time

import redis
from taskiq import Context, SimpleRetryMiddleware, SmartRetryMiddleware, TaskiqDepends, TaskiqEvents
from taskiq.abc.middleware import TaskiqMiddleware
from taskiq.state import TaskiqState
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend, RedisStreamBroker

from taskdedup.taskiq import DedupMiddleware, deduplicate, pace, reserve

URL = os.environ["TD_REDIS_URL"]
PREFIX = os.environ["TD_PREFIX"]
KIND = os.environ.get("TD_BROKER", "list")
ORDER = os.environ.get("TD_ORDER", "dedup first")
RETRY = os.environ.get("TD_RETRY", "simple")
IDLE_MS = int(os.environ.get("TD_IDLE_MS", "600000"))
CONTEXT = TaskiqDepends()

if KIND == "stream":
    broker: ListQueueBroker | RedisStreamBroker = RedisStreamBroker(
        URL,
        queue_name=f"{PREFIX}-stream",
        consumer_group_name=f"{PREFIX}-group",
        idle_timeout=IDLE_MS,  # an unacked message older than this is claimed again
        unacknowledged_lock_timeout=5,
        xread_block=200,
    )
else:
    broker = ListQueueBroker(URL, queue_name=f"{PREFIX}-q")

retry: TaskiqMiddleware
if RETRY == "smart":
    retry = SmartRetryMiddleware(default_retry_count=5, default_delay=0.2)
else:
    retry = SimpleRetryMiddleware(default_retry_count=5)
dedup = DedupMiddleware(
    os.environ.get("TD_STORE_URL") or URL,
    key_prefix=PREFIX,
    on_store_error=os.environ.get("TD_ON_STORE_ERROR") or "enqueue",
)
broker = broker.with_result_backend(
    RedisAsyncResultBackend(URL, prefix_str=f"{PREFIX}:result", result_ex_time=600)
).with_middlewares(*((dedup, retry) if ORDER == "dedup first" else (retry, dedup)))
marks = redis.Redis.from_url(URL)


def mark(name: str, value: object = 1) -> None:
    marks.set(f"{PREFIX}:mark:{name}", str(value), ex=600)


def count(name: str) -> int:
    runs = int(marks.incr(f"{PREFIX}:mark:{name}"))
    marks.expire(f"{PREFIX}:mark:{name}", 600)
    return runs


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def ready(state: TaskiqState) -> None:
    mark(f"ready:{os.getpid()}")


@broker.task(task_name="sub.long_job", deduplicate={"strategy": "until_executed", "lease": 2})
async def long_job(name: str, seconds: float) -> str:
    """Async: counts its runs, notes its pid, then sleeps."""
    count(f"runs:{name}")
    mark(f"pid:{name}", os.getpid())
    await asyncio.sleep(seconds)
    return name


@deduplicate("until_executed", lease=2, keys=["name"])
@broker.task(task_name="sub.sync_job")
def sync_job(name: str, seconds: float) -> str:
    """Sync (runs in the worker's thread pool): counts its runs, then sleeps; ``seconds < 0``
    runs until the test sets the mark ``release:<name>`` (at most 60 s)."""
    count(f"runs:{name}")
    mark(f"pid:{name}", os.getpid())
    if seconds >= 0:
        time.sleep(seconds)
    deadline = time.monotonic() + 60
    while seconds < 0 and not marks.get(f"{PREFIX}:mark:release:{name}"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"sync_job {name!r} was never released")
        time.sleep(0.02)
    return name


@broker.task(
    task_name="sub.flaky",
    deduplicate={"strategy": "until_executed", "lease": 5},
    retry_on_error=True,
)
async def flaky(name: str, context: Context = CONTEXT) -> str:
    """Fails on its first two attempts."""
    attempt = int(context.message.labels.get("_retries", 0))
    count(f"runs:{name}")
    await asyncio.sleep(0.3)
    if attempt < 2:
        raise RuntimeError(f"attempt {attempt} fails")
    return f"{name} after {attempt} retries"


@reserve(max_concurrent=1, scope="tenant", ttl=0.5)
@deduplicate("until_executed", keys=["tenant"])
@broker.task(task_name="sub.capped")
async def capped(tenant: str) -> str:
    """At most one per tenant; its reservation lapses after 0.5 s in the queue."""
    count(f"runs:{tenant}")
    return tenant


@broker.task(task_name="sub.leased", deduplicate={"strategy": "until_executed", "lease": 20})
async def leased(name: str, seconds: float) -> str:
    """A long lease: a second delivery while it runs is sent again only after 21 s."""
    count(f"runs:{name}")
    await asyncio.sleep(seconds)
    return name


@broker.task(task_name="sub.held", deduplicate={"strategy": "until_executed", "lease": 15})
async def held(name: str, seconds: float) -> str:
    """A copy of it delivered while it runs is sent again after 16 s; sleeps ``seconds``, or the
    number in the mark ``sleep:<name>`` once the test has set it."""
    count(f"runs:{name}")
    mark(f"pid:{name}", os.getpid())
    override = marks.get(f"{PREFIX}:mark:sleep:{name}")
    await asyncio.sleep(float(override) if override is not None else seconds)
    return name


# ---- fault tests (tests/test_faults_taskiq.py): runs record their start and end --------------


def record_run(name: str, job_id: str, fence: object, event: str) -> None:
    """Append ``event job fence time`` to the run log of ``name`` (read by the test)."""
    log = f"{PREFIX}:mark:log:{name}"
    marks.rpush(log, f"{event} {job_id} {fence} {time.time():.6f} {os.getpid()}")
    marks.expire(log, 600)


@broker.task(task_name="sub.fenced", deduplicate={"strategy": "until_executed", "lease": 2})
async def fenced(name: str, seconds: float, context: Context = CONTEXT) -> str:
    """Records its start and end with its fencing token; sleeps ``seconds``, or the number of
    seconds in the mark ``sleep:<name>`` once the test has set it."""
    job_id = context.message.task_id
    fence = context.message.labels.get("taskdedup_fence")
    record_run(name, job_id, fence, "start")
    mark(f"pid:{name}", os.getpid())
    override = marks.get(f"{PREFIX}:mark:sleep:{name}")
    await asyncio.sleep(float(override) if override is not None else seconds)
    record_run(name, job_id, fence, "end")
    return job_id


@broker.task(
    task_name="sub.debounced",
    deduplicate={"strategy": "debounce", "delay": 1, "max_wait": 3, "lease": 5, "keys": ["name"]},
)
async def debounced(name: str, n: int, seconds: float = 0.0) -> int:
    """Notes each run (its n, when it began, how many runs of the name were going on then)."""
    import json

    began = time.time()
    active = int(marks.incr(f"{PREFIX}:mark:active:{name}"))
    try:
        marks.rpush(f"{PREFIX}:mark:runs:{name}", json.dumps([n, began, active]))
        marks.expire(f"{PREFIX}:mark:runs:{name}", 600)
        await asyncio.sleep(seconds)
    finally:
        marks.decr(f"{PREFIX}:mark:active:{name}")
    return n


@broker.task(
    task_name="sub.exporting",
    deduplicate={
        "strategy": "until_executed",
        "on_conflict": "supersede",
        "running": "cancel",
        "lease": 1.5,
        "keys": ["name"],
    },
)
async def exporting(name: str, version: int) -> int:
    """Version 1 works for up to 30 s, checking whether it was superseded every 50 ms."""
    from taskdedup import raise_if_superseded

    marks.rpush(f"{PREFIX}:mark:seen:{name}", f"start {version} {time.time()}")
    marks.expire(f"{PREFIX}:mark:seen:{name}", 600)
    try:
        deadline = time.monotonic() + (30 if version == 1 else 0)
        while time.monotonic() < deadline:
            raise_if_superseded()
            await asyncio.sleep(0.05)
    finally:
        marks.rpush(f"{PREFIX}:mark:seen:{name}", f"end {version} {time.time()}")
    return version


@broker.task(
    task_name="sub.rendering",
    deduplicate={"strategy": "until_executed", "on_conflict": "supersede", "keys": ["name"]},
)
async def rendering(name: str, version: int) -> int:
    """Notes its version in the name's order list; version 3 then waits for a go mark."""
    marks.rpush(f"{PREFIX}:mark:order:{name}", f"render {version}")
    marks.expire(f"{PREFIX}:mark:order:{name}", 600)
    if version == 3:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not marks.exists(f"{PREFIX}:mark:go:{name}"):
            await asyncio.sleep(0.05)
    return version


@broker.task(task_name="sub.behind")
async def behind(name: str) -> None:
    """A job of another task, queued behind a superseded one: notes when it ran."""
    marks.rpush(f"{PREFIX}:mark:order:{name}", "other")
    marks.expire(f"{PREFIX}:mark:order:{name}", 600)


@broker.task(
    task_name="sub.exporting_sync",
    deduplicate={
        "strategy": "until_executed",
        "on_conflict": "supersede",
        "running": "cancel",
        "lease": 1.5,
        "keys": ["name"],
    },
)
def exporting_sync(name: str, version: int) -> int:
    """``exporting`` as a sync task (taskiq runs it in its thread pool)."""
    from taskdedup import raise_if_superseded

    marks.rpush(f"{PREFIX}:mark:seen:{name}", f"start {version} {time.time()}")
    marks.expire(f"{PREFIX}:mark:seen:{name}", 600)
    try:
        deadline = time.monotonic() + (30 if version == 1 else 0)
        while time.monotonic() < deadline:
            raise_if_superseded()
            time.sleep(0.05)
    finally:
        marks.rpush(f"{PREFIX}:mark:seen:{name}", f"end {version} {time.time()}")
    return version


@pace("10/s")
@broker.task(task_name="sub.paced")
async def paced(n: int, context: Context = CONTEXT) -> int:
    """Notes when it started, and the start it was given (the taskdedup_start_at label; None
    for a job sent to start at once) (issue 27: one every 100 ms, whoever kicked it)."""
    import json

    given = context.message.labels.get("taskdedup_start_at")
    at = None if given is None else float(given)
    marks.rpush(f"{PREFIX}:mark:paced", json.dumps([n, time.time(), at]))
    marks.expire(f"{PREFIX}:mark:paced", 600)
    return n


# ---------------------------------------------------------------- tests/test_schedules.py
# Two `taskiq scheduler` processes send these every second (label-based schedules: each
# scheduler gives them a random schedule_id); each run notes the slot of the tick it was sent
# for (the taskdedup_tick label), its job, and its start and end.

from taskiq import TaskiqScheduler  # noqa: E402
from taskiq.schedule_sources import LabelScheduleSource  # noqa: E402

scheduler = TaskiqScheduler(broker, [LabelScheduleSource(broker)])


async def note_tick(context: Context, entry: str, seconds: float) -> None:
    message = context.message
    slot, log = message.labels.get("taskdedup_tick"), f"{PREFIX}:mark:ticks:{entry}"
    marks.rpush(log, f"start {slot} {message.task_id} {time.time():.6f}")
    await asyncio.sleep(seconds)
    marks.rpush(log, f"end {slot} {message.task_id} {time.time():.6f}")
    marks.expire(log, 600)


def every_second(entry: str) -> list[dict[str, object]]:
    return [{"interval": 1, "args": [entry]}]


@broker.task(
    task_name="sub.every_tick",
    schedule=every_second("every-second"),
    deduplicate={"strategy": "until_executed", "lease": 2},
)
async def every_tick(entry: str, context: Context = CONTEXT) -> None:
    await note_tick(context, entry, 0.0)


@broker.task(
    task_name="sub.overrun_skip",
    schedule=every_second("overrun-skip"),
    deduplicate={"strategy": "until_executed", "lease": 2, "overlap": "skip"},
)
async def overrun_skip(entry: str, context: Context = CONTEXT) -> None:
    await note_tick(context, entry, 2.2)


@broker.task(
    task_name="sub.overrun_buffer",
    schedule=every_second("overrun-buffer"),
    deduplicate={"strategy": "until_executed", "lease": 2, "overlap": "buffer_one"},
)
async def overrun_buffer(entry: str, context: Context = CONTEXT) -> None:
    await note_tick(context, entry, 2.2)
