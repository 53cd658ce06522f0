"""The publish side: every way Celery sends a task ends in ``app.send_task``, wrapped here.

``delay``, ``apply_async``, signatures and canvas members, ETA/countdown, ``send_task`` by name,
beat and ``Task.retry`` all call ``app.send_task``; so one wrapper sees every publish. A retry
(``retries > 0``) keeps its lock; anything else asks the Deduplicator first, or, on a Redis
broker that is also the store, takes the lock where kombu pushes the message (redis_push).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import functools
import time
from typing import TYPE_CHECKING, Any, cast

from kombu.utils.uuid import uuid

from ..core import Step, Ticket
from ..stores.base import Acquire
from ..stores.redis import RedisStore
from .messages import KEY_HEADER, dump_call
from .redis_push import PENDING, NotPublished, PendingEnqueue
from .tasks import task_policy

if TYPE_CHECKING:
    from .integration import CeleryDedup

#: A message that belongs to a group or chord, or carries what runs after it, is never dropped
#: at enqueue: the canvas waits for that very id, so a deduplicated member would hang it.
CANVAS_OPTIONS = ("group_id", "chord", "chain", "link", "link_error")
#: A key seen held is asked about first for this long: a duplicate is then found before Celery
#: builds a message (the fused push would find it only after).
RECENT_SECONDS = 10.0
RECENT_KEYS = 10_000
#: A lock already taken by a task's apply_async for the publish it is about to make.
DECIDED: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "taskdedup_decided", default=None
)


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
        self.recently_held: dict[str, float] = {}  # key -> until when it is asked about first

    def __call__(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        integ = self.integration
        task = integ.app.tasks.get(name)
        policy = task_policy(task, integ.settings) if task is not None else None
        if policy is None or any(options.get(option) for option in CANVAS_OPTIONS):
            return self.original(name, args, kwargs, **options)
        integ.prepare(task)  # a task registered after the app was finalized
        dedup = integ.dedup
        delay = delay_of(options)
        queue = options.get("queue") or getattr(task, "queue", None)
        if queue is not None and not isinstance(queue, str):  # a kombu Queue
            queue = getattr(queue, "name", str(queue))
        retries = options.get("retries") or 0
        if retries and options.get("task_id"):  # Task.retry: same id, keeps its lock (G6)
            headers = options.get("headers") or {}
            key = headers.get(KEY_HEADER) or policy.key_for(args or (), kwargs or {}, queue)
            dedup.retry(policy, key, options["task_id"], delay=delay, attempt=retries - 1)
            _add_key(key, options)
            return self.original(name, args, kwargs, **options)

        decided = DECIDED.get()
        if decided is not None and decided.job_id == options.get("task_id"):
            return self._publish(decided, name, args, kwargs, options)
        job_id = options.get("task_id") or uuid()
        payload = None
        if policy.policy.on_conflict == "reschedule_once":
            payload = dump_call(
                args or (), kwargs or {}, options.get("serializer") or task.serializer
            )
        plan = dedup.plan_enqueue(policy, args or (), kwargs or {}, job_id, queue, delay, payload)
        options["task_id"] = job_id
        if isinstance(plan, Step) and self._fusable(plan):
            return self._publish_fused(plan, job_id, name, args, kwargs, options)
        ticket = plan if isinstance(plan, Ticket) else dedup.run(plan)
        self._remember(ticket)
        if ticket.deduplicated:
            return self._holder(ticket, options)
        return self._publish(ticket, name, args, kwargs, options)

    def wrap_apply_async(self, task: Any) -> None:
        """Let a plain call of a key seen held lately ask the store before Celery prepares a
        publish: a duplicate then costs one round trip and little else."""
        if getattr(task, "_taskdedup_apply_async", None) is not None:
            return
        if task_policy(task, self.integration.settings) is None:
            return
        original = task.apply_async

        @functools.wraps(original)
        def apply_async(
            args: Any = None, kwargs: Any = None, task_id: Any = None, **options: Any
        ) -> Any:
            if task_id is None and not options:  # .delay(...), .apply_async(args, kwargs)
                ticket = self._ask_first(task, args, kwargs)
                if ticket is not None and ticket.deduplicated:
                    result = task.AsyncResult(ticket.job_id)
                    result.deduplicated = True
                    return result
                if ticket is not None:
                    token = DECIDED.set(ticket)
                    try:
                        return original(args, kwargs, task_id=ticket.job_id)
                    finally:
                        DECIDED.reset(token)
            return original(args, kwargs, task_id=task_id, **options)

        task._taskdedup_apply_async = original
        task.apply_async = apply_async

    def _ask_first(self, task: Any, args: Any, kwargs: Any) -> Ticket | None:
        """The store's answer for a call whose key was seen held lately; None otherwise."""
        integ = self.integration
        policy = task_policy(task, integ.settings)
        if policy is None or policy.policy.per_queue:
            return None
        if policy.policy.on_conflict == "reschedule_once":
            return None  # its duplicates carry their arguments: the full path keeps them
        try:
            key = policy.key_for(args or (), kwargs or {})
        except Exception:
            return None  # Celery's own checks, then the full path, report it
        seen = self.recently_held.get(key)
        if seen is None or seen < time.monotonic() or integ.app.conf.task_always_eager:
            return None
        plan = integ.dedup.plan_enqueue(policy, args or (), kwargs or {}, key=key)
        ticket = plan if isinstance(plan, Ticket) else integ.dedup.run(plan)
        self._remember(ticket)
        return ticket

    def _publish(
        self, ticket: Ticket, name: str, args: Any, kwargs: Any, options: dict[str, Any]
    ) -> Any:
        """Publish an acquired (or skipped) ticket's job; release its lock if that fails."""
        dedup = self.integration.dedup
        if ticket.key is not None:
            _add_key(ticket.key, options)
        try:
            result = self.original(name, args, kwargs, **options)
        except BaseException:
            dedup.publish_failed(ticket)  # G5: released before the error reaches the caller
            raise
        dedup.published(ticket)
        result.deduplicated = False
        return result

    def _publish_fused(
        self,
        step: Step[Ticket],
        job_id: str,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
    ) -> Any:
        """Publish with the lock taken where kombu pushes the message (see redis_push)."""
        dedup = self.integration.dedup
        pending = PendingEnqueue(job_id, step, cast(RedisStore, dedup.store))
        _add_key(pending.op.key, options)
        token = PENDING.set(pending)
        try:
            result = self.original(name, args, kwargs, **options)
        except NotPublished:
            self._forget_subscription(job_id, options)
            ticket = step.done(pending.reply)  # a duplicate; raises DuplicateJob if asked to
            self._remember(ticket)
            return self._holder(ticket, options)
        except BaseException:
            if pending.reply is not None and not pending.fused:
                dedup.publish_failed(step.done(pending.reply))  # G5
            raise
        finally:
            PENDING.reset(token)
        if pending.ticket is not None:  # the store was down: published without dedup
            ticket = pending.ticket
        elif pending.reply is not None:
            ticket = step.done(pending.reply)
            if not pending.fused:
                dedup.published(ticket)
        else:  # the message left by a way that was not hooked: take its lock now
            ticket = dedup.run(step)
            dedup.published(ticket)
        self._remember(ticket)
        result.deduplicated = False
        return result

    def _fusable(self, step: Step[Ticket]) -> bool:
        """Worth taking the lock inside the push: a Redis broker on the store's server, and a
        key not seen held lately (a likely duplicate is cheaper to ask about first)."""
        if not self.integration.fused_publish:
            return False
        seen = self.recently_held.get(cast(Acquire, step.op).key)
        return seen is None or seen < time.monotonic()

    def _remember(self, ticket: Ticket) -> None:
        """Note keys seen held, so the next call for them asks before building a message."""
        if ticket.key is None:
            return
        if ticket.outcome == "duplicate" or ticket.acquired:
            if len(self.recently_held) >= RECENT_KEYS:
                self.recently_held.clear()
            self.recently_held[ticket.key] = time.monotonic() + RECENT_SECONDS

    def _holder(self, ticket: Ticket, options: dict[str, Any]) -> Any:
        result_cls = options.get("result_cls") or self.integration.app.AsyncResult
        result = result_cls(ticket.job_id)
        result.deduplicated = True
        return result

    def _forget_subscription(self, job_id: str, options: dict[str, Any]) -> None:
        """Celery subscribed to the result of the message it built; no such job will exist."""
        app = self.integration.app
        if options.get("ignore_result", app.conf.task_ignore_result):
            return
        consumer = getattr(app.backend, "result_consumer", None)
        cancel = getattr(consumer, "cancel_for", None)
        if cancel is not None:
            cancel(job_id)


def _add_key(key: str, options: dict[str, Any]) -> None:
    """The dedup key travels in a header, so the worker need not compute it again."""
    headers = dict(options.get("headers") or {})
    headers[KEY_HEADER] = key
    options["headers"] = headers
