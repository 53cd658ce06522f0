"""Enqueue: take the key's lock for a call, or learn which job holds it (G1, G2, G11, G13)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import DuplicateJob, PayloadTooLarge, StoreUnavailable
from ..policy import ENQUEUE_LOCKING, TaskPolicy
from ..settings import Settings
from ..stores.base import Acquire, AcquireReply, Peek, ms
from .answers import Ticket
from .guards import GuardFree, GuardHeld, current_guard, guard_answered
from .step import Notes, Step, active


def plan_enqueue(
    settings: Settings,
    tp: TaskPolicy,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    job_id: str,
    *,
    note: Notes,
    holder_pending: Callable[[AcquireReply], float | None],
    queue: str | None = None,
    delay: float = 0.0,
    payload: str | None = None,
    key: str | None = None,
    expires_in: float | None = None,
    quiet: bool = False,
    counted: bool = True,
) -> Ticket | Step[Ticket]:
    """A Ticket when no store call is needed, else the Step whose ``op`` is an
    :class:`Acquire` (raises KeyEncodingError for bad arguments). ``key``: the call's key,
    when the caller has already computed it. ``expires_in``: the seconds after which the
    broker's job will never start (Celery's ``expires``); its lock then lives no longer than
    that plus ``grace``, so a job that expires unseen does not hold its key for the whole ttl
    (G13). A job that starts in time takes its lock's life at its claim. ``holder_pending``:
    how long to wait before asking again about a holder whose publish is not confirmed yet.
    ``quiet``: a duplicate is logged at DEBUG (a scheduler's tick, said once per entry by
    the caller instead). ``counted=False``: a duplicate is not counted on the lock, so it owes
    no run (a scheduler's tick whose entry says overlap "skip")."""
    p, task = tp.policy, tp.task
    if not active(settings, task) or p.strategy not in ENQUEUE_LOCKING:
        return Ticket("skipped", job_id, None)
    if delay > 0 and not p.including_scheduled:
        return Ticket("skipped", job_id, None)
    key = key or tp.key_for(args, kwargs, queue)
    ttl = ms(p.ttl_seconds + max(delay, 0.0))
    if expires_in is not None and p.strategy != "until_expired":  # a throttle outlives runs
        ttl = min(ttl, ms(max(expires_in, 0.0) + settings.grace))
    # debounce: the lock lives its ttl, not just past the cap (max_wait): a delivery that comes
    # late (a backlog) still finds the burst's latest arguments on it (the chaos soak found
    # them lost when the lock lapsed a grace after the cap)
    debounce_ms, wait_ms = p.debounce_ms
    grace = min(ms(settings.grace), ttl)
    dry = settings.dry_run
    if not tp.keeps_arguments or not counted:
        payload = None
    limit = settings.reschedule_payload_limit
    if payload is not None and limit and len(payload.encode()) > limit:
        raise PayloadTooLarge(task, len(payload.encode()), limit)
    cancel = p.running == "cancel"
    guard = current_guard()  # (taskdedup.compat: the peer's key, in the same step)
    op = Acquire(
        key,
        job_id,
        ttl,
        grace,
        counted and not dry,
        payload,
        task,
        debounce_ms,
        wait_ms,
        cancel,
        guard,
    )

    def done(reply: AcquireReply) -> Ticket:
        if guard is not None:
            guard_answered()
        if reply.guard == "held":
            raise GuardHeld(reply.guard_answer)
        if reply.guard == "free":
            raise GuardFree(reply.holder)
        if reply.acquired:
            note("enqueue", "acquired", logging.DEBUG, task, key=key, job=job_id)
            return Ticket("acquired", job_id, key, reply.fence, confirm=grace < ttl)
        if reply.pending and not dry:
            # The wait passed and the holder is still not published: it may never be (its
            # producer died mid-publish). Its job is no answer to give; publish this one
            # without a lock: at worst a missed dedup, never lost work.
            note(
                "enqueue",
                "holder_unconfirmed",
                logging.WARNING,
                task,
                key=key,
                holder=reply.holder,
                job=job_id,
            )
            return Ticket("skipped", job_id, None)
        note(
            "enqueue",
            "would_deduplicate" if dry else duplicate_outcome(tp, reply),
            logging.DEBUG if quiet and not dry else logging.INFO,
            task,
            key=key,
            holder=reply.holder,
        )
        if p.on_conflict == "raise" and not dry:
            raise DuplicateJob(reply.holder, key, task)
        holder = job_id if dry else reply.holder
        return Ticket(
            "duplicate",
            holder,
            key,
            reply.fence,
            reply.duplicates,
            dry_run=dry,
            running=reply.running,
        )

    def failed(exc: StoreUnavailable) -> Ticket:
        note("enqueue", "store_unavailable", logging.WARNING, task, error=exc, key=key, job=job_id)
        if guard is not None:
            guard_answered()
        if settings.on_store_error == "raise" or guard is not None:  # (the guard's owner's
            raise exc  # library raises when its own key cannot be taken)
        return Ticket("store_unavailable", job_id, key)

    # A holder still being published may fail and free the key: answering with it could
    # lose this call's work, so ask again (counted once) until it is confirmed or gone.
    return Step(
        op,
        done,
        failed,
        waits=None if dry else holder_pending,
        again=dataclasses.replace(op, record_duplicate=False, payload=None, guard=None),
    )


def duplicate_outcome(tp: TaskPolicy, reply: AcquireReply) -> str:
    """What a duplicate did, as its decision's outcome (each counted and signalled as its own
    kind): ``debounced`` (folded into the burst's one run, which moves), ``superseded`` (its
    arguments replace those of the holder still queued), ``cancel_requested`` (the running
    holder is asked to stop; the duplicate's run follows it), else ``duplicate``."""
    p = tp.policy
    if p.strategy == "debounce":
        return "debounced"
    if p.on_conflict == "supersede":
        if not reply.running:
            return "superseded"
        if p.running == "cancel":
            return "cancel_requested"
    return "duplicate"


def plan_held(
    settings: Settings, tp: TaskPolicy, key: str, *, note: Notes
) -> Step[Ticket | None] | None:
    """An adapter's shortcut for a likely duplicate: a Step answering the holder's Ticket when
    ``key`` is held (counted as a duplicate; DuplicateJob when the policy says so), or None
    when it is free. None instead of a Step when no shortcut applies (dedup off, dry run, a
    strategy without an enqueue lock): then enqueue as usual."""
    p, task = tp.policy, tp.task
    if not active(settings, task) or p.strategy not in ENQUEUE_LOCKING or settings.dry_run:
        return None

    def done(reply: AcquireReply | None) -> Ticket | None:
        if reply is None or reply.pending:  # free, or a holder that may yet fail:
            return None  # the usual enqueue decides
        note("enqueue", "duplicate", logging.INFO, task, key=key, holder=reply.holder)
        if p.on_conflict == "raise":
            raise DuplicateJob(reply.holder, key, task)
        return Ticket("duplicate", reply.holder, key, reply.fence, reply.duplicates)

    def failed(exc: StoreUnavailable) -> Ticket | None:
        return None  # the usual enqueue meets the outage and follows on_store_error

    return Step(Peek(key), done, failed)
