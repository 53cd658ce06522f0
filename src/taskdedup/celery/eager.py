"""Eager mode made faithful: with ``task_always_eager`` (or a direct ``task.apply()``) Celery
runs the job in the caller and never publishes, so without this a test would pass while
production deduplicates otherwise. A deduplicated task's ``apply`` takes the enqueue decision
first, as a publish would: a duplicate is not run and gets a handle to the job that holds its
key (``.deduplicated``, no result: the result is the holder's); a new call runs, through the
worker's claim and finish; a retry (``self.retry()`` applies again) keeps the lock, as a
published retry does. Idempotency keys, reservation caps and the following of canvas members
are taken where a message is published, so eager mode does not apply them (README). The
``eager`` setting's ``bypass`` gives the old behaviour back.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import Task, states
from celery.result import EagerResult

from .messages import add_key
from .publish import plan_call, publish_retry
from .state import integration_for
from .tasks import task_limits, task_policy


def hook_apply() -> None:
    """Wrap ``Task.apply`` of every Celery task class, once per process: a task created
    lazily and never published (eager mode publishes nothing) is prepared here too."""
    if getattr(Task, "_taskdedup_hooked", False):
        return
    original = Task.apply

    @functools.wraps(original)
    def apply(task: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        integ = integration_for(task.app)
        policy = None if integ is None else task_policy(task, integ.settings)
        if integ is None or policy is None or integ.settings.eager != "faithful":
            return original(task, args, kwargs, **options)
        integ.prepare(task)  # its run claims and finishes, as on a worker
        if options.get("retries") and options.get("task_id"):  # Task.retry, eager: apply again
            return publish_retry(  # a retry keeps its lock under the same id (G6)
                integ,
                lambda _, a, k, **o: original(task, a, k, **o),
                task,
                policy,
                task_limits(task),
                task.name,
                args,
                kwargs,
                options,
            )
        dedup = integ.dedup
        _, plan = plan_call(integ, task, policy, args, kwargs, options)
        ticket = dedup.settle(plan)
        if ticket.deduplicated:
            held = EagerResult(ticket.job_id, None, states.PENDING)
            held.deduplicated = True
            return held
        dedup.published(ticket)  # "in the broker": the run below claims it, as a worker would
        if ticket.key is not None:
            add_key(ticket.key, options)
        result = original(task, args, kwargs, **options)
        result.deduplicated = False
        return result

    Task.apply = apply
    Task._taskdedup_hooked = True
