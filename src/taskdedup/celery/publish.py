"""The publish side: every way Celery sends a task ends in ``app.send_task``, wrapped here.

``delay``, ``apply_async``, signatures and canvas members, ETA/countdown, ``send_task`` by name,
beat and ``Task.retry`` all call ``app.send_task``; so one wrapper sees every publish. A retry
(``retries > 0``) keeps its lock; anything else asks the Deduplicator first.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from kombu.utils.uuid import uuid

from .messages import KEY_HEADER, dump_call
from .tasks import task_policy
from .worker import wrap_task

if TYPE_CHECKING:
    from .integration import CeleryDedup

#: A message that belongs to a group or chord, or carries what runs after it, is never dropped
#: at enqueue: the canvas waits for that very id, so a deduplicated member would hang it.
CANVAS_OPTIONS = ("group_id", "chord", "chain", "link", "link_error")


def delay_of(options: dict[str, Any]) -> float:
    """Seconds until a scheduled job is due (0 for a job sent now)."""
    countdown = options.get("countdown")
    if countdown:
        return max(float(countdown), 0.0)
    eta = options.get("eta")
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = dt.datetime.fromisoformat(eta)
    now = dt.datetime.now(eta.tzinfo or dt.timezone.utc)
    if eta.tzinfo is None:
        now = now.replace(tzinfo=None)
    return max((eta - now).total_seconds(), 0.0)


class Publisher:
    """Wraps ``app.send_task`` of one app."""

    def __init__(self, integration: CeleryDedup, original: Any) -> None:
        self.integration = integration
        self.original = original

    def __call__(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        integ = self.integration
        task = integ.app.tasks.get(name)
        policy = task_policy(task, integ.settings) if task is not None else None
        if policy is None or any(options.get(option) for option in CANVAS_OPTIONS):
            return self.original(name, args, kwargs, **options)
        wrap_task(integ, task)  # a task registered after the app was finalized
        dedup = integ.dedup
        headers = dict(options.get("headers") or {})
        delay = delay_of(options)
        queue = options.get("queue") or getattr(task, "queue", None)
        if queue is not None and not isinstance(queue, str):  # a kombu Queue
            queue = getattr(queue, "name", str(queue))
        retries = options.get("retries") or 0
        if retries and options.get("task_id"):  # Task.retry: same id, keeps its lock (G6)
            key = headers.get(KEY_HEADER) or policy.key_for(args or (), kwargs or {}, queue)
            dedup.retry(policy, key, options["task_id"], delay=delay, attempt=retries - 1)
            headers[KEY_HEADER] = key
            options["headers"] = headers
            return self.original(name, args, kwargs, **options)

        job_id = options.get("task_id") or uuid()
        payload = None
        if policy.policy.on_conflict == "reschedule_once":
            payload = dump_call(
                args or (), kwargs or {}, options.get("serializer") or task.serializer
            )
        ticket = dedup.enqueue(
            policy,
            args or (),
            kwargs or {},
            job_id=job_id,
            queue=queue,
            delay=delay,
            payload=payload,
        )
        if ticket.deduplicated:
            result_cls = options.get("result_cls") or integ.app.AsyncResult
            result = result_cls(ticket.job_id)
            result.deduplicated = True
            return result
        options["task_id"] = ticket.job_id
        if ticket.key is not None:
            headers[KEY_HEADER] = ticket.key
            options["headers"] = headers
        try:
            result = self.original(name, args, kwargs, **options)
        except BaseException:
            dedup.publish_failed(ticket)  # G5: released before the error reaches the caller
            raise
        dedup.published(ticket)
        result.deduplicated = False
        return result
