"""The demo's taskiq broker: what ``taskiq worker examples.demo.taskiq_app:broker`` runs, and
what the demo imports to submit jobs.

A taskiq-redis ``ListQueueBroker`` on the private Redis (``DEMO_REDIS_URL``), with taskdedup's
middleware, whose store defaults to the broker's Redis. Each task records its runs in the
:mod:`journal` so the demo can count them.
"""

from __future__ import annotations

from typing import Any

from examples.demo.journal import PREFIX, Journal, url
from taskiq import Context, TaskiqDepends, TaskiqEvents, TaskiqState
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskdedup.taskiq import DedupMiddleware, reserve

CONTEXT: Any = TaskiqDepends()  # taskiq fills in the Context

broker = (
    # socket_timeout=None: redis-py's default 5 s would end an idle worker's BRPOP
    ListQueueBroker(url(), queue_name="demo-taskiq", socket_timeout=None)
    .with_result_backend(
        RedisAsyncResultBackend(url(), prefix_str="demo-results", result_ex_time=600)
    )
    .with_middlewares(DedupMiddleware(key_prefix=PREFIX))
)
journal = Journal()


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def ready(state: TaskiqState) -> None:
    """Tell the demo this worker takes jobs now."""
    journal.ready("taskiq")


@broker.task(task_name="ci.build_image")
async def build_image(repo: str, sha: str, context: Context = CONTEXT) -> str:
    """Check 4: submitted with an idempotency key (a CI step that is retried)."""
    job = context.message.task_id
    journal.record("build_image", "start", job, repo, sha)
    journal.record("build_image", "end", job, repo, sha)
    return f"{repo}@{sha}"


@reserve(max_concurrent=2, scope="user_id")
@broker.task(task_name="exports.export")
async def export(user_id: int, fmt: str, context: Context = CONTEXT) -> str:
    """Check 5: at most 2 in flight per user; runs until the demo opens its gate."""
    job = context.message.task_id
    journal.record("export", "start", job, user_id, fmt)
    await journal.await_gate("export")
    journal.record("export", "end", job, user_id, fmt)
    return f"export of user {user_id} as {fmt}"
