"""Publishing with an idempotency key or under a reservation cap.

The order is the design's: the idempotency key first (a hit publishes nothing and takes no
slot), then the task's dedup policy (a duplicate takes no slot, and the key then answers the
holder's job), then a slot of the task's scope, reserved under the job's own id so the publish
needs no separate consume step. A refusal or a failed publish gives back everything taken
before the error reaches the caller.
"""

from __future__ import annotations

from typing import Any, Protocol

from kombu.utils.uuid import uuid

from ..decide import Ticket
from ..errors import StoreUnavailable
from ..idempotency import Recall, fingerprint
from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from .messages import SCOPE_HEADER, add_key, delay_of, dump_call, expires_in_of, queue_of
from .state import CeleryDedup, Handles
from .tasks import task_function


class Publisher(Handles, Protocol):
    """What a guarded publish needs of the publisher: its integration, Celery's own
    ``send_task``, the keys seen held lately and the handles of existing jobs."""

    integration: CeleryDedup
    original: Any
    recent: RecentKeys


def publish_guarded(
    publisher: Publisher,
    task: Any,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    idempotency: tuple[str, float | None] | None,
) -> Any:
    """Publish one call through its idempotency key, dedup policy and reservation cap."""
    integ = publisher.integration
    dedup = integ.dedup
    args, kwargs = args or (), kwargs or {}
    fn = task_function(task) if task is not None else None
    job_id = options.get("task_id") or uuid()
    options["task_id"] = job_id
    scope = limits.scope_for(name, fn, args, kwargs) if limits is not None else None
    recall: Recall | None = None
    call_print = ""
    if idempotency is not None:
        call_print = fingerprint(name, fn, args, kwargs)
        recall = integ.idempotency.recall(idempotency[0], name, call_print, job_id, idempotency[1])
        if recall.hit:
            return publisher.existing(recall.job_id, options, hit=True)
    ticket: Ticket | None = None
    slot = False
    try:
        if policy is not None:
            ticket = _enqueue(publisher, task, policy, args, kwargs, options, job_id)
            if ticket.deduplicated:
                if recall is not None:
                    integ.idempotency.repoint(recall, ticket.job_id, call_print)
                return publisher.existing(ticket.job_id, options, deduplicated=True)
            if ticket.key is not None:
                add_key(ticket.key, options)
        if limits is not None and scope is not None:
            slot = _reserve(publisher, limits, scope, name, job_id, delay_of(options))
            if slot:
                options["headers"] = {**(options.get("headers") or {}), SCOPE_HEADER: scope}
        result = publisher.original(name, args, kwargs, **options)
    except BaseException:  # refused, store down, publish failed: give back what was taken
        if ticket is not None:
            dedup.publish_failed(ticket)
        if recall is not None:
            integ.idempotency.publish_failed(recall)
        if slot and scope is not None:
            integ.reservations.give_back(scope, job_id)
        raise
    if ticket is not None:
        dedup.published(ticket)
    if recall is not None:
        integ.idempotency.published(recall)
    result.deduplicated = False
    result.idempotent_hit = False
    return result


def _enqueue(
    publisher: Publisher,
    task: Any,
    policy: TaskPolicy,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    job_id: str,
) -> Ticket:
    payload = None
    if policy.policy.on_conflict == "reschedule_once":
        payload = dump_call(args, kwargs, options.get("serializer") or task.serializer)
    ticket = publisher.integration.dedup.enqueue(
        policy,
        args,
        kwargs,
        job_id=job_id,
        queue=queue_of(task, options),
        delay=delay_of(options),
        payload=payload,
        expires_in=expires_in_of(options),
    )
    publisher.recent.note(ticket)
    return ticket


def _reserve(
    publisher: Publisher,
    limits: ReservePolicy,
    scope: str,
    task: str,
    job_id: str,
    delay: float,
) -> bool:
    """A slot for the job (until it starts: ttl, plus an ETA's delay), QuotaExceeded, or
    (store down) by on_store_error."""
    integ = publisher.integration
    ttl = limits.ttl_seconds + delay
    try:
        integ.reservations.reserve(scope, limits.max_concurrent, ttl, member=job_id)
    except StoreUnavailable as exc:
        integ.dedup.store_unavailable(
            "reserve", task, exc, scope=scope, job=job_id
        )  # raises or logs
        return False
    return True
