"""While and after a run: renew leases, keep the lock for a retry, finish, release
(G4, G5, G6, G8, G10, G13)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import StoreUnavailable
from ..policy import HOLD_WHILE_RUNNING, RUN_LOCKING, TaskPolicy
from ..settings import Settings
from ..stores.base import Finish, FinishReply, Heartbeat, Lease, Release, Retry, ms
from .answers import Completion
from .step import Notes, Step


def plan_heartbeat(batch: tuple[Lease, ...], *, note: Notes) -> Step[tuple[int, ...] | None]:
    """Renew many leases in one batch; None when the store is down. Each answer says whether
    that job still held something."""

    def done(reply: tuple[int, ...]) -> tuple[int, ...]:
        return reply

    def failed(exc: StoreUnavailable) -> None:
        note("heartbeat", "store_unavailable", logging.WARNING, "?", error=exc)
        return None

    return Step(Heartbeat(batch), done, failed)


def plan_retry(
    settings: Settings,
    tp: TaskPolicy,
    key: str,
    job_id: str,
    delay: float,
    attempt: int | None,
    *,
    note: Notes,
) -> Step[bool]:
    """The job will run again under the same id: keep its lock, now QUEUED (G6), until the
    retry's publish is confirmed for ``grace`` (G11)."""
    ttl = ms(tp.policy.ttl_seconds + max(delay, 0.0))
    grace = min(ms(settings.grace), ttl)
    op = Retry(key, job_id, ttl, attempt, grace_ms=grace, delay_ms=round(max(delay, 0.0) * 1000))

    def done(kept: bool) -> bool:
        outcome = "kept" if kept else "unlocked"
        note("retry", outcome, logging.DEBUG, tp.task, key=key, job=job_id)
        return kept

    def failed(exc: StoreUnavailable) -> bool:
        note("retry", "store_unavailable", logging.WARNING, tp.task, error=exc)
        return False

    return Step(op, done, failed)


def plan_finish(
    settings: Settings,
    tp: TaskPolicy,
    key: str,
    job_id: str,
    attempt: int | None,
    *,
    note: Notes,
    new_id: Callable[[], str],
) -> Step[Completion]:
    """The job ended for good (success or final failure): release, throttle or hand off."""
    p = tp.policy
    holds = p.strategy in HOLD_WHILE_RUNNING or p.strategy in RUN_LOCKING
    reschedule = p.owes_runs and p.strategy in HOLD_WHILE_RUNNING  # a duplicate while it ran
    ttl = ms(p.ttl_seconds)
    op = Finish(
        key,
        job_id,
        throttle=p.strategy == "until_expired",
        memory_ms=ms(settings.remember_finished),
        handoff_job_id=new_id() if reschedule else None,
        attempt=attempt,
        grace_ms=min(ms(settings.grace), ttl),
        ttl_ms=ttl,
    )

    def done(reply: FinishReply) -> Completion:
        outcome = "handed_off" if reply.handoff else "released" if reply.released else "kept"
        if reply.stale:
            outcome = "stale"
        quiet = (reply.released and not reply.handoff) or not holds
        level = logging.DEBUG if quiet and not reply.stale else logging.INFO
        then = reply.handoff.job_id if reply.handoff else None
        note("finish", outcome, level, tp.task, key=key, job=job_id, next=then)
        return Completion(reply.released, reply.handoff)

    def failed(exc: StoreUnavailable) -> Completion:
        note("finish", "store_unavailable", logging.WARNING, tp.task, error=exc)
        return Completion(False)

    def answer_now() -> Completion:  # nothing to hand on: the caller need not wait
        return Completion(True)

    return Step(op, done, failed, answer_now=None if reschedule else answer_now)


def plan_release(
    op: Release, task: str, *, note: Notes, unreleased: Callable[[Release], Any]
) -> Step[bool]:
    """Owner-checked release (failed publish, revoke): only ``op.job_id``'s lock goes. A
    release the store could not take is handed to ``unreleased`` (sent again until the store
    takes it: the lock must not outlive the outage, G13)."""
    key, job_id = op.key, op.job_id

    def done(released: bool) -> bool:
        outcome = "released" if released else "not_holder"
        note("release", outcome, logging.DEBUG, task, key=key, job=job_id)
        return released

    def failed(exc: StoreUnavailable) -> bool:
        note(
            "release",
            "store_unavailable",
            logging.WARNING,
            task,
            key=key,
            job=job_id,
            then="sent again when the store answers",
            error=exc,
        )
        unreleased(op)
        return False

    return Step(op, done, failed)
