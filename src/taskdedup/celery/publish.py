"""The publish side: every way Celery sends a task ends in ``app.send_task``, wrapped here.

``delay``, ``apply_async``, signatures and canvas members, ETA/countdown, ``send_task`` by name,
beat and ``Task.retry`` all call ``app.send_task``; so one wrapper sees every publish. It reads
the call's facts once (messages.call_of) and asks the core what the call takes
(:func:`taskdedup.submission.submit`, the same flow for every route), then maps the answer to
Celery: publish, or hand the caller the existing job's handle. On a store that can, a plain
call's lock is taken where kombu pushes the message, or its acquire is written before Celery
builds the message (redis_push). A deduplicated task's ``apply_async`` is wrapped too, so that
a plain call of a key seen held a moment ago is answered from the store before Celery builds a
message.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

from .. import transactions
from ..decide import Step, Ticket
from ..decide.envelope import TICK
from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..stores.base import SendsEarly, Sent
from ..submission import (
    Call,
    Taken,
    after_push,
    give_back,
    held_lately,
    lately_key,
    lock_taken,
    plan_call,
    planned_key,
    published,
    submit,
)
from ..ticks import once_per_tick, sent_now
from . import redis_push
from .beat import OVERLAP_OPTION
from .canvas import MIN_PATIENCE, publish_follower, register, results_kept
from .messages import RESEND_OPTION, SCOPE_HEADER, add_key, call_of
from .redis_push import PENDING, NotPublished, PendingEnqueue, StoreDown, hear_sent
from .state import CeleryDedup
from .tasks import task_limits, task_pace, task_policy

log = logging.getLogger("taskdedup")


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
        idempotency = (options.pop("idempotency_key", None), options.pop("idempotency_ttl", None))
        if options.pop(RESEND_OPTION, False):  # the worker's own publish: as it is
            return self.original(name, args, kwargs, **options)
        task = integ.app.tasks.get(name)
        policy = limits = pace = None
        if task is not None:
            policy, limits = task_policy(task, integ.settings), task_limits(task)
            pace = task_pace(task)
        tick = sent_now()
        if tick is not None:
            options.pop(OVERLAP_OPTION, None)  # (read from the entry, never sent)
        ticked = once_per_tick(integ.settings, tick, policy, name)
        if not (policy or limits or pace or idempotency[0] is not None or ticked):
            return self.original(name, args, kwargs, **options)
        if task is not None:
            integ.prepare(task)  # a task registered after the app was finalized
        known = getattr(self._known, "call", None)  # bound once: in apply_async, then here
        key = known[2] if known and known[0] is args and known[1] is kwargs else None
        call = call_of(task, name, args, kwargs, options, policy, limits, idempotency, key)
        call.tick, call.pace = tick, pace
        call.in_worker = call.member and integ.app.current_worker_task is not None
        if call.member and not call.retry:  # never capped, followed when a duplicate
            if policy is None or idempotency[0] is not None or not results_kept(integ, task):
                return self.original(name, args, kwargs, **options)  # as it is: never waits
        elif policy and not (call.retry or call.limits or call.pace or call.idempotency_key
                             or call.tick):  # fmt: skip
            fast = self._publish_fast(call, policy, name, args, kwargs, options)
            if fast is not None:
                return fast
        dedup = integ.dedup
        taken = dedup.drive(submit(dedup, integ.idempotency, integ.reservations, self.recent, call))
        return self.answer(taken, call, self.original, name, args, kwargs, options)

    def answer(
        self,
        taken: Taken,
        call: Call,
        publish: Callable[..., Any],
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
    ) -> Any:
        """Map what the call took to Celery: the existing job's handle (a canvas member's
        duplicate sends its follower first), or the publish, what was taken given back if it
        fails (G5) and confirmed once it is in the broker (G11)."""
        integ = self.integration
        if taken.answer == "hit":
            return self.existing(taken.job_id, options, hit=True)
        if taken.answer == "duplicate":
            if call.member and taken.job_id != call.job_id and taken.key is not None:
                lease = call.policy.policy.lease_seconds if call.policy else 0.0
                task = integ.app.tasks.get(name)
                follower = (taken.job_id, taken.key, name, args, kwargs, options)
                publish_follower(integ, self.original, task, *follower, max(lease, MIN_PATIENCE))
            return self.existing(taken.job_id, options, deduplicated=True)
        if taken.key is not None:
            add_key(taken.key, options)
        if taken.scope is not None:
            options["headers"] = {**(options.get("headers") or {}), SCOPE_HEADER: taken.scope}
        if call.tick is not None and call.tick.slot_ms is not None:
            options["headers"] = {**(options.get("headers") or {}), TICK: call.tick.slot_ms}
        if taken.start_in is not None:  # @pace: a later start than the call asked for
            options.pop("eta", None)
            options["countdown"] = taken.start_in
        sent = functools.partial(self._publish, taken, call, publish, name, args, kwargs, options)
        joined = None if call.retry else transactions.current(integ.dedup.store)
        if joined is None:
            return sent()
        joined.after_commit(sent)  # the lock is in the caller's transaction: publish on commit
        return self.existing(call.job_id, options)

    def _publish(self, taken: Taken, call: Call, publish: Callable[..., Any], *sent: Any) -> Any:
        integ, (name, args, kwargs, options) = self.integration, sent
        try:
            result = publish(name, args, kwargs, **options)
        except BaseException:  # the publish failed: give back what was taken (G5); a retry's
            if not call.retry:  # lock and slot are freed by its run's end, which fails with it
                keys, guard = integ.idempotency, integ.reservations
                integ.dedup.drive(give_back(integ.dedup, keys, guard, taken))
            raise
        published(integ.dedup, integ.idempotency, taken)
        result.deduplicated = False
        result.idempotent_hit = False
        return result

    def _publish_fast(
        self, call: Call, policy: TaskPolicy, name: str, args: Any, kwargs: Any, options: Any
    ) -> Any:
        """A plain call on a store that takes the lock in kombu's push, or that sends the
        acquire before Celery builds the message; None: take the usual path."""
        integ = self.integration
        if not (integ.fused_publish or integ.sends_early):
            return None
        plan = plan_call(integ.dedup, policy, call)
        if not isinstance(plan, Step):
            return None
        call.key = planned_key(plan)  # (the usual path must not bind it again)
        if self.recent.seen(call.key):
            return None
        sent = None if integ.fused_publish else cast(SendsEarly, integ.dedup.store).send(plan.op)
        if sent is None and not integ.fused_publish:
            return None  # (it could not be written: the usual path)
        return self._publish_pending(plan, call, name, args, kwargs, options, sent)

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

    def _publish_pending(
        self,
        step: Step[Ticket],
        call: Call,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        sent: Sent[Any] | None = None,
    ) -> Any:
        """Publish with the lock taken where kombu pushes the message, or with the reply of
        the acquire ``sent`` early read just before the publish (see redis_push)."""
        dedup = self.integration.dedup
        assert call.key is not None
        pending = PendingEnqueue(call.job_id, step, dedup.store, sent=sent)
        add_key(call.key, options)
        token = PENDING.set(pending)
        try:
            app = self.integration.app
            result = redis_push.send_keeping_producer(
                app, self.original, name, args, kwargs, **options
            )
        except NotPublished:
            self._forget_subscription(call.job_id, options)
            assert pending.reply is not None
            pushed = dedup.drive(after_push(dedup, step, pending.reply))
            self.recent.note(pushed.ticket)
            ticket = pushed.ticket
            held = pushed.answer == "duplicate"
            taken = Taken("duplicate" if held else "publish", ticket.job_id, ticket.key)
            taken.ticket = ticket
            return self.answer(taken, call, self.original, name, args, kwargs, options)
        except StoreDown as down:  # on_store_error="raise", kept from kombu's retries
            raise down.error from None
        except BaseException:
            hear_sent(pending)  # Celery failed before the publish
            if pending.reply is not None and lock_taken(pending.reply) and not pending.fused:
                dedup.publish_failed(step.done(pending.reply))  # G5
            raise
        finally:
            PENDING.reset(token)
        if pending.sent is not None or (pending.reply is None and pending.ticket is None):
            log.warning("%s[%s]: published by a way taskdedup does not hook", name, call.job_id)
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
