"""The publish side: every way Celery sends a task ends in ``app.send_task``, wrapped here.

``delay``, ``apply_async``, signatures and canvas members, ETA/countdown, ``send_task`` by name,
beat and ``Task.retry`` all call ``app.send_task``; so one wrapper sees every publish. A retry
(``retries > 0``) keeps its lock; anything else asks the Deduplicator first, or, on a Redis
broker that is also the store, takes the lock where kombu pushes the message (redis_push). A
deduplicated task's ``apply_async`` is wrapped too, so that a plain call of a key seen held a
moment ago is answered from the store before Celery builds a message.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

from kombu.utils.uuid import uuid

from ..decide import Step, Ticket
from ..errors import DuplicateJob, StoreUnavailable
from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from ..stores.base import Acquire, Sent
from ..submission import Call, held_lately, keep_for_retry, lately_key, published
from .canvas import MIN_PATIENCE, continues, publish_follower, register, results_kept
from .guarded import publish_guarded
from .messages import (
    KEY_HEADER,
    RESEND_OPTION,
    SCOPE_HEADER,
    add_key,
    delay_of,
    dump_call,
    expires_in_of,
    queue_of,
)
from .redis_push import PENDING, NotPublished, PendingEnqueue, StoreDown, hear_sent
from .state import CeleryDedup
from .tasks import task_limits, task_policy

log = logging.getLogger("taskdedup")


def plan_call(
    integ: CeleryDedup,
    task: Any,
    policy: TaskPolicy,
    args: Any,
    kwargs: Any,
    options: Any,
    key: str | None = None,
) -> tuple[str, Ticket | Step[Ticket]]:
    """The call's job id (set in ``options``) and its enqueue decision, planned (``key``:
    the call's key, when ``apply_async`` already computed it)."""
    job_id = options.get("task_id") or uuid()
    options["task_id"] = job_id
    payload = None
    if policy.policy.on_conflict == "reschedule_once":
        serializer = options.get("serializer") or task.serializer
        payload = dump_call(args or (), kwargs or {}, serializer)
    plan = integ.dedup.plan_enqueue(
        policy,
        args or (),
        kwargs or {},
        job_id,
        queue=queue_of(task, options),
        delay=delay_of(options),
        payload=payload,
        key=key,
        expires_in=expires_in_of(options),
    )
    return job_id, plan


def publish_retry(
    integ: CeleryDedup,
    publish: Callable[..., Any],
    task: Any,
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:
    """A retry keeps its lock and its slot under the same id (G6); once it is published, its
    lock and its job's record learn so (G11). ``publish(name, args, kwargs, **options)``
    sends it: Celery's own send_task, or (eager mode) the task's own apply."""
    headers = options.get("headers") or {}
    call = Call(
        name,
        None,
        args or (),
        kwargs or {},
        options["task_id"],
        policy,
        limits,
        delay=delay_of(options),
        queue=queue_of(task, options),
    )
    attempt = (options.get("retries") or 1) - 1
    key, scope = headers.get(KEY_HEADER), headers.get(SCOPE_HEADER)
    taken = integ.dedup.drive(
        keep_for_retry(integ.dedup, integ.reservations, call, key, scope, attempt)
    )
    if taken.key is not None:
        add_key(taken.key, options)
    result = publish(name, args, kwargs, **options)
    published(integ.dedup, integ.idempotency, taken)
    return result


class Publisher:
    """Wraps ``app.send_task`` of one app."""

    def __init__(self, integration: CeleryDedup, original: Any) -> None:
        self.integration = integration
        self.original = original
        self.recent = RecentKeys()  # keys asked about before Celery builds a message
        self._known = threading.local()  # the key apply_async computed for the call under way
        register(integration)  # taskdedup.follow, which stands in for a deduplicated member

    def __call__(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        integ = self.integration
        idempotency_key = options.pop("idempotency_key", None)
        idempotency_ttl = options.pop("idempotency_ttl", None)
        if options.pop(RESEND_OPTION, False):  # the worker's own publish: as it is
            return self.original(name, args, kwargs, **options)
        task = integ.app.tasks.get(name)
        policy = limits = None
        if task is not None:
            policy = task_policy(task, integ.settings)
            limits = task_limits(task)
        if policy is None and limits is None and idempotency_key is None:
            return self.original(name, args, kwargs, **options)
        if task is not None:
            integ.prepare(task)  # a task registered after the app was finalized
        member = continues(options)  # a canvas member: never capped, followed when a duplicate
        if member:
            limits = None
        retries = options.get("retries") or 0
        if retries and options.get("task_id"):  # Task.retry: same id, keeps its lock (G6)
            return publish_retry(
                integ, self.original, task, policy, limits, name, args, kwargs, options
            )
        if member:
            if policy is None or idempotency_key is not None:
                return self.original(name, args, kwargs, **options)
            return self._publish_member(task, policy, name, args, kwargs, options)
        if idempotency_key is not None or limits is not None:
            idempotency = None if idempotency_key is None else (idempotency_key, idempotency_ttl)
            return publish_guarded(
                self, task, name, args, kwargs, options, policy, limits, idempotency
            )
        assert policy is not None
        dedup = integ.dedup
        known = getattr(self._known, "call", None)  # bound once: in apply_async, then here
        key = known[2] if known and known[0] is args and known[1] is kwargs else None
        job_id, plan = plan_call(integ, task, policy, args, kwargs, options, key)
        if isinstance(plan, Step) and not self.recent.seen(cast(Acquire, plan.op).key):
            if integ.fused_publish:
                return self._publish_pending(plan, job_id, name, args, kwargs, options)
            if integ.sends_early:
                sent = dedup.store.send(plan.op)
                if sent is not None:
                    return self._publish_pending(plan, job_id, name, args, kwargs, options, sent)
        ticket = dedup.settle(plan)
        self.recent.note(ticket)
        if ticket.deduplicated:
            return self._holder(ticket, options)
        return self._publish(ticket, name, args, kwargs, options)

    def _publish_member(
        self, task: Any, policy: TaskPolicy, name: str, args: Any, kwargs: Any, options: Any
    ) -> Any:
        """A canvas member (see canvas.py): published when it holds its key; when the key is
        held, the follower stands in for it under its own id, and the caller gets the holder's
        handle. Without a way to read the holder's result it is published as it is."""
        integ = self.integration
        if not results_kept(integ, task):
            return self.original(name, args, kwargs, **options)
        dedup = integ.dedup
        job_id, plan = plan_call(integ, task, policy, args, kwargs, options)
        try:
            ticket = dedup.settle(plan)
        except DuplicateJob as dup:  # on_conflict="raise" would cut the canvas: follow instead
            ticket = Ticket("duplicate", dup.job_id, dup.key)
        except StoreUnavailable:
            if integ.app.current_worker_task is None:
                raise  # on_store_error="raise", asked by the caller
            ticket = Ticket("store_unavailable", job_id, None)  # a worker's step: never lost
        self.recent.note(ticket)
        if not ticket.deduplicated or ticket.key is None:
            return self._publish(ticket, name, args, kwargs, options)
        if ticket.job_id == job_id:  # sent again under the id that holds the key: it exists
            return self._holder(ticket, options)
        patience = max(policy.policy.lease_seconds, MIN_PATIENCE)
        publish_follower(
            integ,
            self.original,
            task,
            ticket.job_id,
            ticket.key,
            name,
            args,
            kwargs,
            options,
            patience,
        )
        return self._holder(ticket, options)

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
                ticket, key = self._ask_first(task, args, kwargs)
                if ticket is not None:
                    return self.existing(
                        ticket.job_id, {"result_cls": task.AsyncResult}, deduplicated=True
                    )
                if key is not None:  # the publish below takes it, not binding the call again
                    self._known.call = (args, kwargs, key)
                    try:
                        return original(args, kwargs)
                    finally:
                        self._known.call = None
            return original(args, kwargs, task_id=task_id, **options)

        task._taskdedup_apply_async = original
        task.apply_async = apply_async

    def _ask_first(self, task: Any, args: Any, kwargs: Any) -> tuple[Ticket | None, str | None]:
        """The holder's Ticket when a call whose key was seen held lately finds it still held,
        else None (the call then takes the full path, which takes the lock); and the call's
        key, when it was computed."""
        integ = self.integration
        policy = task_policy(task, integ.settings)
        if policy is None:
            return None, None
        capped = task_limits(task) is not None
        key = lately_key(policy, capped, args or (), kwargs or {})
        step = held_lately(integ.dedup, self.recent, policy, key)
        if step is None or integ.app.conf.task_always_eager:
            return None, key  # (eager read only when asking: a lookup in settings costs)
        return integ.dedup.run(step), key

    def _publish(
        self, ticket: Ticket, name: str, args: Any, kwargs: Any, options: dict[str, Any]
    ) -> Any:
        """Publish an acquired (or skipped) ticket's job; release its lock if that fails."""
        dedup = self.integration.dedup
        if ticket.key is not None:
            add_key(ticket.key, options)
        try:
            result = self.original(name, args, kwargs, **options)
        except BaseException:
            dedup.publish_failed(ticket)  # G5: released before the error reaches the caller
            raise
        dedup.published(ticket)
        result.deduplicated = False
        return result

    def _publish_pending(
        self,
        step: Step[Ticket],
        job_id: str,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        sent: Sent[Any] | None = None,
    ) -> Any:
        """Publish with the lock taken where kombu pushes the message, or with the reply of
        the acquire ``sent`` early read just before the publish (see redis_push)."""
        dedup = self.integration.dedup
        pending = PendingEnqueue(job_id, step, dedup.store, sent=sent)
        add_key(pending.op.key, options)
        token = PENDING.set(pending)
        try:
            result = self.original(name, args, kwargs, **options)
        except NotPublished:
            self._forget_subscription(job_id, options)
            reply = dedup.published_here(pending.reply)
            if step.waits is None or step.waits(reply) is None:
                ticket = step.done(reply)  # a duplicate; raises DuplicateJob if asked
                self.recent.note(ticket)
                return self._holder(ticket, options)
            result = None  # the holder is still being published: ask again, below
        except StoreDown as down:  # on_store_error="raise", kept from kombu's retries
            raise down.error from None
        except BaseException:
            hear_sent(pending)  # Celery failed before the publish
            if pending.reply is not None and pending.reply.acquired and not pending.fused:
                dedup.publish_failed(step.done(pending.reply))  # G5
            raise
        finally:
            PENDING.reset(token)
        if result is None:  # ask until the holder is confirmed (a duplicate) or gone (ours)
            ticket = dedup.resume(step)
            self.recent.note(ticket)
            if ticket.deduplicated:
                return self._holder(ticket, options)
            return self._publish(ticket, name, args, kwargs, options)
        if pending.sent is not None or (pending.reply is None and pending.ticket is None):
            log.warning("%s[%s]: published by a way taskdedup does not hook", name, job_id)
        hear_sent(pending)  # the message left by a way that was not hooked: lock taken after
        if pending.ticket is not None:  # the store was down: published without dedup
            ticket = pending.ticket
        elif pending.reply is not None:
            ticket = step.done(pending.reply)
            if not pending.fused and not pending.batched:  # a batch may still be discarded:
                dedup.published(ticket)  # its locks keep their grace, never a stuck ttl
        else:  # the message left by a way that was not hooked: take its lock now
            ticket = dedup.run(step)
            dedup.published(ticket)
        self.recent.note(ticket)
        result.deduplicated = False
        return result

    def _holder(self, ticket: Ticket, options: dict[str, Any]) -> Any:
        return self.existing(ticket.job_id, options, deduplicated=True)

    def existing(
        self,
        job_id: str,
        options: dict[str, Any],
        *,
        deduplicated: bool = False,
        hit: bool = False,
    ) -> Any:
        """A handle to a job already sent: the holder of the key, or an idempotent original."""
        result_cls = options.get("result_cls") or self.integration.app.AsyncResult
        result = result_cls(job_id)
        result.deduplicated = deduplicated
        result.idempotent_hit = hit
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
