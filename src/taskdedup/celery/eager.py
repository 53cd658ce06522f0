"""Eager mode made faithful: with ``task_always_eager`` (or a direct ``task.apply()``) Celery
runs the job in the caller and never publishes, so without this a test would pass while
production deduplicates otherwise. A deduplicated task's ``apply`` takes the enqueue decision
first, as a publish would (the same flow, :func:`taskdedup.submission.submit`): a duplicate is
not run and gets a handle to the job that holds its key (``.deduplicated``, no result: the
result is the holder's); a new call runs, through the worker's claim and finish; a retry
(``self.retry()`` applies again) keeps the lock, as a published retry does. Idempotency keys,
reservation caps and the following of canvas members are taken where a message is published,
so eager mode does not apply them (docs/testing.md). The ``eager`` setting's ``bypass`` gives
the old behaviour back.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import Task, states
from celery.result import EagerResult

from ..recent import RecentKeys
from ..submission import published, submit
from ..ticks import sent_now
from .messages import add_key, call_of
from .state import integration_for
from .tasks import task_limits, task_policy

_RECENT = RecentKeys()  # (eager calls never ask first: nothing reads what is noted here)


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
        call = call_of(task, task.name, args, kwargs, options, policy, task_limits(task))
        # (canvas members are followed only where they are published)
        call.member, call.tick = False, sent_now()
        dedup = integ.dedup
        if not call.retry:
            call.limits = None
        taken = dedup.drive(submit(dedup, integ.idempotency, integ.reservations, _RECENT, call))
        if call.retry:  # Task.retry, eager: applied again, keeping its lock (G6)
            assert integ.publisher is not None
            run = lambda _, a, k, **o: original(task, a, k, **o)  # noqa: E731
            return integ.publisher.answer(taken, call, run, task.name, args, kwargs, options)
        if taken.answer == "duplicate":
            held = EagerResult(taken.job_id, None, states.PENDING)
            held.deduplicated = True
            return held
        published(dedup, integ.idempotency, taken)  # "in the broker": the run claims it
        if taken.key is not None:
            add_key(taken.key, options)
        result = original(task, args, kwargs, **options)
        result.deduplicated = False
        return result

    Task.apply = apply
    Task._taskdedup_hooked = True
