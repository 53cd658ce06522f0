"""Sending with an idempotency key or under a reservation cap (taskiq's ``pre_send`` side).

As for Celery: the idempotency key first (a hit sends nothing and takes no slot), then the
task's dedup policy (a duplicate takes no slot; the key then answers the holder's job), then a
slot of the task's scope, reserved under the job's own id. What was taken is given back if a
later step refuses or the kick fails, before the error reaches the caller.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.message import TaskiqMessage

from ..decide import Ticket
from ..errors import StoreUnavailable
from ..idempotency import fingerprint
from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from .options import (
    IDEMPOTENCY_KEY_LABEL,
    IDEMPOTENCY_TTL_LABEL,
    KEY_LABEL,
    SCOPE_LABEL,
    call_shape,
    label,
    set_label,
    task_function,
)
from .sends import Decision, dump_call, queue_of, remember
from .state import DedupState


class Producer(Protocol):
    """What a guarded send needs of the producer: the shared state, its enqueue, and the keys
    seen held lately."""

    mw: DedupState
    recent: RecentKeys

    async def enqueue(
        self,
        policy: TaskPolicy,
        message: TaskiqMessage,
        queue: str | None,
        delay: float,
        payload: str | None,
    ) -> Ticket: ...


log = logging.getLogger("taskdedup")


async def guarded_pre_send(
    producer: Producer,
    task: AsyncTaskiqDecoratedTask[Any, Any],
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    message: TaskiqMessage,
) -> None:
    """Decide one send through its idempotency key, dedup policy and reservation cap; the
    decision waits in the producer's context variable for the kick."""
    mw = producer.mw
    name, job_id = message.task_name, message.task_id
    fn = call_shape(task_function(task))
    scope = limits.scope_for(name, fn, message.args, message.kwargs) if limits else None
    decision = Decision(message, job_id, job_id)
    remember(decision)
    key = label(message, IDEMPOTENCY_KEY_LABEL)
    call_print = ""
    if key is not None:
        call_print = fingerprint(name, fn, message.args, message.kwargs)
        ttl = label(message, IDEMPOTENCY_TTL_LABEL)
        recall = await mw.idempotency.arecall(
            key, name, call_print, job_id, None if ttl is None else float(ttl)
        )
        if recall.hit:
            message.task_id = decision.job_id = recall.job_id
            decision.deduplicated = decision.hit = True
            remember(decision)
            return
        decision.recall = recall
    try:
        if policy is not None:
            payload = None
            if policy.policy.on_conflict == "reschedule_once":
                payload = dump_call(mw.broker, message.args, message.kwargs)
            ticket = await producer.enqueue(
                policy,
                message,
                queue_of(mw.broker, message),
                float(label(message, "delay") or 0.0),
                payload,
            )
            producer.recent.note(ticket)
            if ticket.key is not None:
                set_label(message, KEY_LABEL, ticket.key, parsed=False)
            if ticket.deduplicated:
                if decision.recall is not None:
                    await mw.idempotency.arepoint(decision.recall, ticket.job_id, call_print)
                    decision.recall = None
                message.task_id = decision.job_id = ticket.job_id
                decision.deduplicated = True
                remember(decision)
                return
            decision.ticket = ticket if ticket.acquired else None
        if limits is not None and scope is not None:
            ttl = limits.ttl_seconds + float(label(message, "delay") or 0.0)
            try:
                await mw.reservations.areserve(scope, limits.max_concurrent, ttl, member=job_id)
            except StoreUnavailable as exc:  # "raise" raises here; "enqueue" sends without
                mw.dedup.store_unavailable("reserve", name, exc, scope=scope, job=job_id)
            else:
                decision.scope = scope
                set_label(message, SCOPE_LABEL, scope, parsed=False)
    except BaseException:
        await give_back(producer, decision)
        raise


async def give_back(producer: Producer, decision: Decision) -> None:
    """Nothing was sent: release the lock, free the idempotency key and the slot."""
    mw = producer.mw
    if decision.ticket is not None:
        await mw.dedup.apublish_failed(decision.ticket)
    if decision.recall is not None:
        await mw.idempotency.apublish_failed(decision.recall)
    if decision.scope is not None:
        try:
            await mw.reservations.arelease(decision.scope, decision.sent_id)
        except StoreUnavailable as exc:  # it lapses after its ttl anyway
            log.warning("taskdedup: could not free a slot of %s: %s", decision.scope, exc)
