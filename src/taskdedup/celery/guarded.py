"""Publishing with an idempotency key or under a reservation cap.

The order is the design's: the idempotency key first (a hit publishes nothing and takes no
slot), then the task's dedup policy (a duplicate takes no slot, and the key then answers the
holder's job), then a slot of the task's scope, reserved under the job's own id so the publish
needs no separate consume step. A refusal or a failed publish gives back everything taken
before the error reaches the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kombu.utils.uuid import uuid

from ..core import Ticket
from ..errors import QuotaExceeded, StoreUnavailable
from ..idempotency import Recall, fingerprint
from ..policy import TaskPolicy
from ..reservations import ReservePolicy
from .messages import SCOPE_HEADER, add_key, delay_of, dump_call, queue_of
from .tasks import task_function

if TYPE_CHECKING:
    from .publish import Publisher


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
    recall: Recall | None = None
    call_print = ""
    if idempotency is not None:
        call_print = fingerprint(name, fn, args, kwargs)
        recall = integ.idempotency.recall(idempotency[0], name, call_print, job_id, idempotency[1])
        if recall.hit:
            return _answer(publisher, recall.job_id, options, hit=True)
    ticket: Ticket | None = None
    if policy is not None:
        payload = None
        if policy.policy.on_conflict == "reschedule_once":
            serializer = options.get("serializer") or task.serializer
            payload = dump_call(args, kwargs, serializer)
        queue = queue_of(task, options)
        ticket = dedup.enqueue(
            policy,
            args,
            kwargs,
            job_id=job_id,
            queue=queue,
            delay=delay_of(options),
            payload=payload,
        )
        publisher.recent.note(ticket)
        if ticket.deduplicated:
            if recall is not None:
                integ.idempotency.repoint(recall, ticket.job_id, call_print)
            return _answer(publisher, ticket.job_id, options, deduplicated=True)
        if ticket.key is not None:
            add_key(ticket.key, options)

    def give_back() -> None:
        if ticket is not None:
            dedup.publish_failed(ticket)
        if recall is not None:
            integ.idempotency.publish_failed(recall)

    if limits is not None:
        scope = limits.scope_for(name, fn, args, kwargs)
        try:
            integ.reservations.reserve(scope, limits.max_concurrent, limits.ttl, member=job_id)
        except QuotaExceeded:
            give_back()
            raise
        except StoreUnavailable as exc:
            try:
                dedup._store_down("reserve", name, exc, scope=scope, job=job_id)
            except StoreUnavailable:
                give_back()
                raise
        else:
            options["headers"] = {**(options.get("headers") or {}), SCOPE_HEADER: scope}
    try:
        result = publisher.original(name, args, kwargs, **options)
    except BaseException:
        give_back()
        if limits is not None and SCOPE_HEADER in (options.get("headers") or {}):
            integ.reservations.release(options["headers"][SCOPE_HEADER], job_id)
        raise
    if ticket is not None:
        dedup.published(ticket)
    if recall is not None:
        integ.idempotency.published(recall)
    result.deduplicated = False
    result.idempotent_hit = False
    return result


def _answer(
    publisher: Publisher,
    job_id: str,
    options: dict[str, Any],
    *,
    hit: bool = False,
    deduplicated: bool = False,
) -> Any:
    """A handle to an existing job: the original (an idempotent hit) or the holder."""
    result_cls = options.get("result_cls") or publisher.integration.app.AsyncResult
    result = result_cls(job_id)
    result.deduplicated = deduplicated
    result.idempotent_hit = hit
    return result
