"""Publishing with an idempotency key or under a reservation cap.

What a call takes before its publish, and gives back if the publish fails, is decided in
:mod:`taskdedup.submission`; this maps it to Celery's ``send_task`` options and handles.
"""

from __future__ import annotations

from typing import Any, Protocol

from kombu.utils.uuid import uuid

from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from ..submission import Call, give_back, published, take
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
    job_id = options.get("task_id") or uuid()
    options["task_id"] = job_id
    payload = None
    if policy is not None and policy.policy.on_conflict == "reschedule_once":
        payload = dump_call(args, kwargs, options.get("serializer") or task.serializer)
    call = Call(
        name,
        task_function(task) if task is not None else None,
        args,
        kwargs,
        job_id,
        policy,
        limits,
        idempotency_key=idempotency[0] if idempotency else None,
        idempotency_ttl=idempotency[1] if idempotency else None,
        delay=delay_of(options),
        queue=queue_of(task, options),
        payload=payload,
        expires_in=expires_in_of(options),
    )
    taken = dedup.drive(take(dedup, integ.idempotency, integ.reservations, publisher.recent, call))
    if taken.answer == "hit":
        return publisher.existing(taken.job_id, options, hit=True)
    if taken.answer == "duplicate":
        return publisher.existing(taken.job_id, options, deduplicated=True)
    if taken.key is not None:
        add_key(taken.key, options)
    if taken.scope is not None:
        options["headers"] = {**(options.get("headers") or {}), SCOPE_HEADER: taken.scope}
    try:
        result = publisher.original(name, args, kwargs, **options)
    except BaseException:  # the publish failed: give back what was taken (G5)
        dedup.drive(give_back(dedup, integ.idempotency, integ.reservations, taken))
        raise
    published(dedup, integ.idempotency, taken)
    result.deduplicated = False
    result.idempotent_hit = False
    return result
