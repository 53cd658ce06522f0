"""Claim: may this delivery of a job run now? (G3, G7, G12, G14)"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import StoreUnavailable
from ..policy import TaskPolicy
from ..settings import Settings
from ..stores.base import Claim, ClaimReply, Lease, LockMode, ms
from .answers import BUSY_DELAY, Admission, store_retry_delay
from .step import Notes, Step, active

#: per strategy: what the claim does to the enqueue lock, and whether the run takes a run lock
CLAIM_MODES: dict[str, tuple[LockMode, bool]] = {
    "until_executing": ("release", False),
    "until_executed": ("hold", False),
    "until_expired": ("hold", False),
    "while_executing": ("none", True),
    "until_and_while_executing": ("release", True),
    "debounce": ("release", True),  # a new burst may start while the run runs, never beside it
}


def plan_claim(
    settings: Settings,
    tp: TaskPolicy,
    job_id: str,
    *,
    note: Notes,
    owner: str,
    nonce: str,
    new_id: Callable[[], str],
    key: str | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    queue: str | None = None,
    attempt: int | None = None,
    store_waits: int = 0,
    lost_claims: Sequence[str] = (),
) -> Admission | Step[Admission]:
    """``owner``: who runs jobs here. ``nonce``: this claim's own id; ``new_id``: makes the id
    of the run owed by reschedule_once, if the claim hands the lock on. ``store_waits``: how
    many times this delivery was already sent back because the store could not answer its
    claim (sets the back-off of the next one). ``lost_claims``: the nonces of this job's
    earlier claims whose replies never arrived (see ``Admission.claim_nonce``)."""
    p, task = tp.policy, tp.task
    if not active(settings, task):
        return Admission("skipped", job_id, key)
    key = key or tp.key_for(args, kwargs, queue)
    lock_mode, run_lock = CLAIM_MODES[p.strategy]
    reschedule = p.on_conflict == "reschedule_once" and lock_mode == "release"
    lease_ms = ms(p.lease_seconds)
    dry = settings.dry_run
    op = Claim(
        key,
        job_id,
        owner,
        lease_ms,
        ms(p.ttl_seconds),
        lock_mode,
        run_lock,
        ms(settings.remember_finished),
        attempt=attempt,
        max_attempts=p.max_attempts,
        handoff_job_id=new_id() if reschedule else None,
        grace_ms=min(ms(settings.grace), ms(p.ttl_seconds)),
        nonce=nonce,
        lost_claims=tuple(lost_claims),
        task=tp.task,
        latest=tp.runs_latest,
    )

    def done(reply: ClaimReply) -> Admission:
        outcome: str = reply.outcome if reply.outcome == "run" or not dry else "would_skip"
        if outcome == "run" and attempt is not None and reply.attempts > attempt + 1:
            outcome = "recovered"  # an earlier run of this attempt ended without a word
        level = logging.DEBUG if outcome in ("run", "early") else logging.INFO
        note("claim", outcome, level, task, key=key, job=job_id, holder=reply.holder)
        lease = Lease(key, job_id, lease_ms, task=task) if reply.outcome == "run" else None
        retry_after = {
            "busy": BUSY_DELAY,
            "running": p.lease_seconds + 1,
            "early": reply.wait_ms / 1000,  # debounce: when the run is due
        }.get(reply.outcome)
        return Admission(
            reply.outcome,
            job_id,
            key,
            reply.fence,
            reply.attempts,
            reply.holder,
            reply.handoff,
            lease,
            dry_run=dry,
            retry_after=retry_after,
            arguments=reply.arguments,
        )

    def failed(exc: StoreUnavailable) -> Admission:
        # An accepted job is never failed, nor run unguarded, because the store is down
        # (G14): it goes back to the broker and is claimed again later. on_store_error is
        # the producer's choice; it does not apply here.
        delay = store_retry_delay(store_waits)
        note(
            "claim",
            "store_unavailable",
            logging.WARNING,
            task,
            key=key,
            job=job_id,
            retry_in=f"{delay:g}s",
            error=exc,
        )
        return Admission(
            "store_unavailable", job_id, key, dry_run=dry, retry_after=delay, claim_nonce=nonce
        )

    return Step(op, done, failed)
