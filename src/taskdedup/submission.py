"""One call submitted, whatever its route, written once for both adapters.

Every way a job is sent (a plain call, an idempotency key, a reservation cap, a retry, a canvas
member, a scheduler's tick, the run a reschedule owes) goes through :func:`submit`: the adapter
reads the framework's facts once into a :class:`Call` and maps the :class:`Taken` it gets back
to the framework (publish, or hand the caller the existing job). A store that takes the lock
in the broker's own push answers through :func:`after_push` instead.

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
from .pacing import PacePolicy, Pacer
from .policy import TaskPolicy
from .recent import RecentKeys
from .reservations import ReservationGuard, ReservePolicy
from .settings import Settings
from .stores.base import Acquire, AcquireReply, PushesWithLock
from .ticks import Tick, mark_key, once_per_tick, tick_key, tick_overlap, unmark_flow

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
    expires_in: float | None = None
    #: a scheduler's tick: sent once per slot, and a duplicate is skipped or buffered by its
    #: overlap (never DuplicateJob), said once per entry while it stays so (:mod:`.ticks`)
    tick: Tick | None = None
    key: str | None = None  # the call's dedup key, when already known (else computed)
    scope: str | None = None  # a retry: the scope whose slot its message names
    retry: bool = False  # a retry of ``job_id`` (after ``attempt`` failed): it keeps its lock
    attempt: int = 0
    #: a canvas member: a duplicate follows its holder (never DuplicateJob), and a worker's
    #: step is sent even when the store is down (``in_worker``), never lost
    member: bool = False
    in_worker: bool = False
    #: the call's arguments in the framework's serializer, for a policy that keeps the latest
    #: duplicate's arguments (reschedule_once): asked for only then
    dump: Callable[[], str] | None = None
    pace: PacePolicy | None = None  # the task's pace (@pace): a start given after the cap


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
    #: @pace: seconds from now the job may start, when later than the call's own delay (the
    #: adapter publishes it with that countdown); None: as the call asked
    start_in: float | None = None
    #: the store's name of the entry whose tick this job took (forgotten if not published)
    tick_mark: str | None = None


def submit(
    dedup: Deduplicator,
    keys: IdempotencyKeys,
    guard: ReservationGuard,
    recent: RecentKeys,
    call: Call,
) -> Flow[Taken]:
    """What one call takes before its publish, whatever its route: a retry keeps its lock and
    slot; any other call goes through its idempotency key, dedup policy and cap."""
    if call.retry:
        return (yield from keep_for_retry(dedup, guard, call, call.key, call.scope, call.attempt))
    return (yield from take(dedup, keys, guard, recent, call))


def take(
    dedup: Deduplicator,
    keys: IdempotencyKeys,
    guard: ReservationGuard,
    recent: RecentKeys,
    call: Call,
) -> Flow[Taken]:
    """Through the scheduler's tick, the idempotency key, the dedup policy and the reservation
    cap, in that order."""
    limits = call.limits
    scope = limits.scope_for(call.task, call.fn, call.args, call.kwargs) if limits else None
    taken = Taken("publish", call.job_id)
    if call.tick is not None and call.policy is not None:
        tick_overlap(call.policy, call.tick)  # (a bad entry takes no tick)
    if once_per_tick(dedup.settings, call.tick, call.policy, call.task):
        assert call.tick is not None
        mark = mark_key(call.task, call.tick)
        sent = yield from dedup.ticks.claim_flow(mark, call.task, call.tick, call.job_id)
        if sent is not None:  # this tick (or a later one) is out already
            return Taken("duplicate", sent)
        if call.tick.slot_ms is not None:
            taken.tick_mark = mark
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
            except QuotaExceeded as full:  # (of a stacked cap: the scope that was full)
                dedup.note("reserve", "rejected", logging.INFO, call.task, scope=full.scope)
                raise
            except StoreUnavailable as exc:  # "raise" raises here; "enqueue" goes on without
                dedup.store_unavailable("reserve", call.task, exc, scope=scope, job=call.job_id)
            else:
                taken.scope = scope
        if call.pace is not None:
            taken.start_in = yield from paced(dedup, call, call.pace)
    except BaseException:
        yield from give_back(dedup, keys, guard, taken)
        raise
    return taken


def paced(dedup: Deduplicator, call: Call, pace: PacePolicy) -> Flow[float | None]:
    """The start a paced call is given (after its idempotency key, dedup policy and cap, so a
    hit, a duplicate or a refusal takes no start): seconds from now when later than the call's
    own delay, else None. A store that cannot answer follows on_store_error (``enqueue``:
    published at once, unpaced)."""
    scope = pace.scope_for(call.task, call.fn, call.args, call.kwargs)
    try:
        wait = yield from Pacer(dedup.store, dedup.settings).delay_flow(scope, pace)
    except StoreUnavailable as exc:  # "raise" raises here; "enqueue" goes on without
        dedup.store_unavailable("pace", call.task, exc, scope=scope, job=call.job_id)
        return None
    if wait <= call.delay:
        return None
    dedup.note("pace", "delayed", logging.DEBUG, call.task, scope=scope, job=call.job_id)
    return wait


def lately_key(
    policy: TaskPolicy, capped: bool, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """The key of a plain call that may ask first (:func:`held_lately`); None for a call
    that always takes the full path: under a cap, per queue, whose duplicates keep their
    arguments (reschedule_once, debounce), or whose arguments do not encode (the full path
    reports it). The adapter hands the key on to the enqueue, so a call's arguments are bound
    once."""
    p = policy.policy
    if capped or p.per_queue or policy.keeps_arguments:
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


def plan_call(dedup: Deduplicator, policy: TaskPolicy, call: Call) -> Ticket | Step[Ticket]:
    """The enqueue decision of ``call``, planned (its arguments kept only for a policy that
    keeps the latest duplicate's; a scheduler's tick by its overlap)."""
    key, counted = call.key, True
    if call.tick is not None:
        key = key_of(policy, key, call.args, call.kwargs, call.queue)
        key, counted = tick_key(policy, call.tick, key)
    dump = call.dump
    payload = dump() if dump is not None and policy.keeps_arguments and counted else None
    return dedup.plan_enqueue(
        policy,
        call.args,
        call.kwargs,
        call.job_id,
        queue=call.queue,
        delay=call.delay,
        payload=payload,
        key=key,
        expires_in=call.expires_in,
        quiet=call.tick is not None,
        counted=counted,
    )


def _enqueue(dedup: Deduplicator, policy: TaskPolicy, call: Call) -> Flow[Ticket]:
    try:
        ticket = yield from ask(plan_call(dedup, policy, call))
    except DuplicateJob as dup:
        if call.tick is None and not call.member:
            raise
        # a scheduler never sees DuplicateJob, and a canvas member follows its holder
        ticket = Ticket("duplicate", dup.job_id, dup.key)
    except StoreUnavailable:  # (on_store_error="raise")
        if not (call.member and call.in_worker):
            raise
        ticket = Ticket("store_unavailable", call.job_id, None)  # a worker's step: never lost
    if call.tick is not None:
        dedup.ticks.saw(call.task, call.tick.entry, ticket, buffers=policy.policy.owes_runs)
    return ticket


def planned_key(plan: Step[Ticket]) -> str:
    """The key whose lock a planned enqueue (:func:`plan_call`'s Step) takes."""
    assert isinstance(plan.op, Acquire)
    return plan.op.key


def key_of(
    policy: TaskPolicy,
    key: str | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    queue: str | None,
) -> str:
    """A job's dedup key: the one its message carries, else computed from its arguments."""
    return key or policy.key_for(args, kwargs or {}, queue)


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
        key = key_of(call.policy, key, call.args, call.kwargs, call.queue)
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
    if taken.tick_mark is not None:
        yield from unmark_flow(taken.tick_mark, taken.job_id)


# ---------------------------------------------------------------- the lock taken in the push


def may_fuse(policy: TaskPolicy, settings: Settings, *, errors_leave_publish: bool) -> bool:
    """Whether a plain call of ``policy`` may take its lock in the broker's own push (a store
    that :class:`~taskdedup.stores.base.PushesWithLock`, on the broker's server). Not in a
    dry run (nothing is decided), and not when the call must raise DuplicateJob or
    StoreUnavailable as themselves and the framework wraps an error raised in its publish
    (``errors_leave_publish`` False: taskiq's kick turns them into SendTaskError)."""
    if not settings.fused_publish or settings.dry_run:
        return False
    raises = policy.policy.on_conflict == "raise" or settings.on_store_error == "raise"
    return errors_leave_publish or not raises


def push_with_lock(
    store: PushesWithLock, step: Step[Ticket], queue: str, message: str | bytes
) -> AcquireReply:
    """Run an enqueue step's acquire with the push of ``message`` onto ``queue``."""
    assert isinstance(step.op, Acquire)
    return store.acquire_and_push(step.op, queue, message)


async def apush_with_lock(
    store: PushesWithLock, step: Step[Ticket], queue: str, message: str | bytes
) -> AcquireReply:
    """The asyncio twin of :func:`push_with_lock`."""
    assert isinstance(step.op, Acquire)
    return await store.aacquire_and_push(step.op, queue, message)


def lock_taken(reply: AcquireReply) -> bool:
    """Whether an acquire run in the push took the lock (so the message went out with it)."""
    return reply.acquired


@dataclasses.dataclass(frozen=True, slots=True)
class Pushed:
    """What became of a call whose acquire ran in its message's push. ``answer``: ``pushed``
    (the message is in the queue under its lock: nothing more to do), ``duplicate`` (nothing
    was pushed: hand the caller the holder ``ticket.job_id``), ``publish`` (nothing was pushed:
    publish it now, then confirm ``ticket``; its lock is ours if the holder's publish failed)."""

    answer: Literal["pushed", "duplicate", "publish"]
    ticket: Ticket


def after_push(dedup: Deduplicator, step: Step[Ticket], reply: AcquireReply) -> Flow[Pushed]:
    """Read the reply of ``step``'s acquire run with the push: a holder still being published
    is asked about again (counted once) until it is confirmed or gone."""
    reply = dedup.published_here(reply, step.op)
    if reply.acquired:
        return Pushed("pushed", step.done(reply))
    if step.waits is not None and step.waits(reply) is not None:
        ticket = yield dataclasses.replace(step, op=step.again or step.op)
    else:
        ticket = step.done(reply)
    return Pushed("duplicate" if ticket.deduplicated else "publish", ticket)


# ---------------------------------------------------------------- the run a reschedule owes


@dataclasses.dataclass(frozen=True, slots=True)
class SendOwed:
    """A request for the adapter: publish the run a reschedule owes, as it is (no dedup, no
    cap), under ``job_id`` with the key (and the slot's scope) in its message."""

    job_id: str
    key: str
    scope: str | None
    args: Sequence[Any]
    kwargs: Mapping[str, Any]


def publish_owed(
    dedup: Deduplicator,
    keys: IdempotencyKeys,
    guard: ReservationGuard,
    owed: Call,
    payload: str | None,
    load: Callable[[str], tuple[Sequence[Any], Mapping[str, Any]]],
) -> Flow[None]:
    """Publish the one run reschedule_once owes (``owed``: its task, key and job id, and the
    arguments of the run in hand): with the latest duplicate's arguments (``payload``, read
    by ``load``) if it kept them, in a slot of its scope if one is free. The adapter sends it
    when the flow yields :class:`SendOwed`; a failure to send frees its lock and slot and is
    logged: the run in hand goes on."""
    assert owed.key is not None
    args, kwargs = (owed.args, owed.kwargs) if payload is None else load(payload)
    taken = yield from take_owed(
        guard, owed.task, owed.fn, owed.limits, owed.key, owed.job_id, args, kwargs
    )
    try:
        yield SendOwed(owed.job_id, owed.key, taken.scope, args, kwargs)
    except Exception:
        yield from give_back(dedup, keys, guard, taken)
        log.exception(
            "taskdedup: could not publish the rescheduled run %s[%s] (reschedule_once)",
            owed.task,
            owed.job_id,
        )
        return
    published(dedup, keys, taken)
