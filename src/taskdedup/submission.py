"""One call submitted with an idempotency key or under a reservation cap, written once for both
adapters.

The order is the design's: the idempotency key first (a hit publishes nothing and takes no
slot), then the task's dedup policy (a duplicate takes no slot, and the key then answers the
holder's job), then a slot of the task's scope, reserved under the job's own id so the publish
needs no separate consume step. What was taken is given back if a later step refuses or the
publish fails, before the error reaches the caller. The adapter publishes in between:
:func:`take` (or, for a retry, :func:`keep_for_retry`) before, then :func:`published` or
:func:`give_back`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from .core import Deduplicator
from .decide import Step, Ticket
from .errors import DuplicateJob, QuotaExceeded, StoreUnavailable
from .flow import Flow, ask
from .idempotency import IdempotencyKeys, Recall, fingerprint
from .policy import TaskPolicy
from .recent import RecentKeys
from .reservations import ReservationGuard, ReservePolicy

log = logging.getLogger("taskdedup")


@dataclasses.dataclass(slots=True)
class Call:
    """One call of a task, as its producer sees it."""

    task: str
    fn: Callable[..., Any] | None  # the task's function (for scopes and fingerprints)
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    job_id: str
    policy: TaskPolicy | None
    limits: ReservePolicy | None
    idempotency_key: str | None = None
    idempotency_ttl: float | None = None
    delay: float = 0.0  # an ETA's seconds from now
    queue: str | None = None
    payload: str | None = None  # the call, kept for reschedule_once
    expires_in: float | None = None
    scheduled: bool = False  # a scheduler's tick: a duplicate is skipped, never DuplicateJob


@dataclasses.dataclass(slots=True)
class Taken:
    """What a call took before its publish. ``answer``: ``publish`` it under ``job_id``, or
    hand the caller the existing job ``job_id`` (an idempotency ``hit``, a ``duplicate``)."""

    answer: Literal["publish", "hit", "duplicate"]
    job_id: str
    key: str | None = None  # the dedup key, for the message
    ticket: Ticket | None = None
    recall: Recall | None = None
    scope: str | None = None  # the scope whose slot the job holds, for the message


def take(
    dedup: Deduplicator,
    keys: IdempotencyKeys,
    guard: ReservationGuard,
    recent: RecentKeys,
    call: Call,
) -> Flow[Taken]:
    """Through the idempotency key, the dedup policy and the reservation cap, in that order."""
    limits = call.limits
    scope = limits.scope_for(call.task, call.fn, call.args, call.kwargs) if limits else None
    taken = Taken("publish", call.job_id)
    call_print = ""
    if call.idempotency_key is not None:
        call_print = fingerprint(call.task, call.fn, call.args, call.kwargs)
        recall = yield from keys.recall_flow(
            call.idempotency_key, call.task, call_print, call.job_id, call.idempotency_ttl
        )
        if recall.hit:
            return Taken("hit", recall.job_id)
        taken.recall = recall
    try:
        if call.policy is not None:
            ticket = yield from _enqueue(dedup, call.policy, call)
            recent.note(ticket)
            taken.key = ticket.key
            if ticket.deduplicated:
                if taken.recall is not None:
                    yield from keys.repoint_flow(taken.recall, ticket.job_id, call_print)
                return Taken("duplicate", ticket.job_id, ticket.key)
            taken.ticket = ticket if ticket.acquired else None
        if limits is not None and scope is not None:
            ttl = limits.ttl_seconds + call.delay  # until it starts, plus an ETA's delay
            try:
                yield from guard.reserve_flow(scope, limits.max_concurrent, ttl, call.job_id)
            except QuotaExceeded:
                dedup.note("reserve", "rejected", logging.INFO, call.task, scope=scope)
                raise
            except StoreUnavailable as exc:  # "raise" raises here; "enqueue" goes on without
                dedup.store_unavailable("reserve", call.task, exc, scope=scope, job=call.job_id)
            else:
                taken.scope = scope
    except BaseException:
        yield from give_back(dedup, keys, guard, taken)
        raise
    return taken


def lately_key(
    policy: TaskPolicy, capped: bool, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """The key of a plain call that may ask first (:func:`held_lately`); None for a call
    that always takes the full path: under a cap, per queue, whose duplicates keep their
    arguments (reschedule_once), or whose arguments do not encode (the full path reports it).
    The adapter hands the key on to the enqueue, so a call's arguments are bound once."""
    p = policy.policy
    if capped or p.per_queue or p.on_conflict == "reschedule_once":
        return None
    try:
        return policy.key_for(args, kwargs)
    except Exception:
        return None


def held_lately(
    dedup: Deduplicator, recent: RecentKeys, policy: TaskPolicy, key: str | None
) -> Step[Ticket | None] | None:
    """For a plain call whose key (:func:`lately_key`) this process saw held lately, the
    store step that asks before the framework builds a message: its answer is the holder's
    Ticket while the key is still held, else None. None instead of a step: take the full path
    (it takes the lock). (A plan, not a flow: most calls stop at the first check.)"""
    if key is None or not recent.seen(key):
        return None
    step = dedup.plan_held(policy, key)
    if step is None:
        return None
    read = step.done

    def noted(reply: Any) -> Ticket | None:
        ticket = read(reply)
        if ticket is not None:
            recent.note(ticket)
        return ticket

    return dataclasses.replace(step, done=noted)


def _enqueue(dedup: Deduplicator, policy: TaskPolicy, call: Call) -> Flow[Ticket]:
    plan = dedup.plan_enqueue(
        policy,
        call.args,
        call.kwargs,
        call.job_id,
        queue=call.queue,
        delay=call.delay,
        payload=call.payload,
        expires_in=call.expires_in,
    )
    try:
        return (yield from ask(plan))
    except DuplicateJob as dup:
        if not call.scheduled:
            raise
        # a scheduler never sees DuplicateJob: the duplicate tick is skipped quietly
        log.info("taskdedup: scheduled %s skipped: job %s holds it", call.task, dup)
        return Ticket("duplicate", dup.job_id, dup.key)


def keep_for_retry(
    dedup: Deduplicator,
    guard: ReservationGuard,
    call: Call,
    key: str | None,
    scope: str | None,
    attempt: int,
) -> Flow[Taken]:
    """A retry of attempt ``attempt`` goes out under the job's id: it keeps its lock, now
    QUEUED and confirmed once the retry is in the broker (G6, G11), and the slot of ``scope``
    until it starts. ``key``: the key the message carries (else computed)."""
    taken = Taken("publish", call.job_id)
    if call.policy is not None:
        key = key or call.policy.key_for(call.args, call.kwargs, call.queue)
        plan = dedup.plan_retry(call.policy, key, call.job_id, call.delay, attempt)
        yield from ask(plan)
        active = dedup.active(call.policy.task)  # else no store command at all (G16)
        taken.key = key
        taken.ticket = Ticket("acquired", call.job_id, key, confirm=active)
    if call.limits is not None and scope:  # held again until the retry starts
        ttl = call.limits.ttl_seconds + call.delay
        try:
            yield from guard.reserve_flow(scope, call.limits.max_concurrent, ttl, call.job_id)
        except (QuotaExceeded, StoreUnavailable):
            pass
        else:
            taken.scope = scope
    return taken


def take_owed(
    guard: ReservationGuard,
    task: str,
    fn: Callable[..., Any] | None,
    limits: ReservePolicy | None,
    key: str,
    job_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Flow[Taken]:
    """Before the publish of the one run a reschedule_once owes (its lock already names
    ``job_id``): a slot of its scope if one is free. A full scope does not refuse a run that
    was accepted: it takes its slot when it starts, so the scope goes with it either way."""
    taken = Taken("publish", job_id, key, Ticket("acquired", job_id, key, confirm=True))
    if limits is None:
        return taken
    try:
        scope = limits.scope_for(task, fn, args, kwargs)
    except Exception as exc:  # sent without a scope: it runs, uncapped
        log.warning("taskdedup: no scope for the rescheduled run of %s: %s", task, exc)
        return taken
    with contextlib.suppress(QuotaExceeded, StoreUnavailable):
        yield from guard.reserve_flow(scope, limits.max_concurrent, limits.ttl_seconds, job_id)
    taken.scope = scope
    return taken


def published(dedup: Deduplicator, keys: IdempotencyKeys, taken: Taken) -> None:
    """The job is in the broker: confirm its lock and its idempotency record (batched)."""
    if taken.ticket is not None:
        dedup.published(taken.ticket)
    if taken.recall is not None:
        keys.published(taken.recall)


def give_back(
    dedup: Deduplicator, keys: IdempotencyKeys, guard: ReservationGuard, taken: Taken
) -> Flow[None]:
    """Nothing was published: release the lock, free the idempotency key and the slot."""
    if taken.ticket is not None:
        yield from ask(dedup.plan_publish_failed(taken.ticket))
    if taken.recall is not None:
        yield from keys.publish_failed_flow(taken.recall)
    if taken.scope is not None:
        yield from guard.give_back_flow(taken.scope, taken.job_id)
