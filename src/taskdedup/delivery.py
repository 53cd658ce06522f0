"""One delivery on a worker, from its start to its end, written once for both adapters.

A worker that receives a job asks, in this order: does the job hold its scope's slot (or may
it take one)? May it run now (the claim)? When it ends: free the slot, then release, keep or
hand on the lock. The answers, and what is logged and freed on the way, are the same whatever
the framework; what differs is how a framework sends a delivery back, drops it or publishes the
run a reschedule owes. So the rules are written here as flows (see :mod:`taskdedup.flow`) that
yield store operations, planned decisions and the :class:`HandOff`
request an adapter carries out; ``Deduplicator.drive``/``adrive`` run them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .core import Deduplicator
from .decide import FULL_DELAY, Admission, Completion
from .decide.envelope import Waits
from .errors import QuotaExceeded, StoreUnavailable
from .flow import Flow, ask
from .policy import TaskPolicy
from .reservations import ReservationGuard
from .stores.base import Handoff, Inspect, JobState, Lease
from .submission import key_of

log = logging.getLogger("taskdedup")


@dataclasses.dataclass(frozen=True, slots=True)
class HandOff:
    """Publish the one run that reschedule_once owes, under the id the lock holds."""

    key: str
    handoff: Handoff


@dataclasses.dataclass(slots=True)
class Delivery:
    """What a worker knows of one delivery of a job."""

    task: str
    job_id: str
    policy: TaskPolicy | None
    attempt: int = 0
    scope: str | None = None  # the reservation scope whose slot the job holds, if any
    cap: int | None = None  # that scope's max_concurrent (None: start without a slot)
    key: str | None = None  # the dedup key the producer computed, if it sent one
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    queue: str | None = None
    waits: Waits = dataclasses.field(default_factory=Waits)

    def lock_key(self) -> str | None:
        """The job's dedup key: the one its message carries, else computed again."""
        if self.policy is None:
            return None
        return key_of(self.policy, self.key, self.args, self.kwargs, self.queue)


Action = Literal["run", "resend", "drop"]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a delivery: ``run`` it (renew ``admission.lease`` and ``slot`` while it
    runs), ``resend`` it after ``delay`` seconds carrying ``waits``, or ``drop`` it."""

    action: Action
    admission: Admission | None = None
    slot: Lease | None = None
    delay: float = 0.0
    waits: Waits = dataclasses.field(default_factory=Waits)
    why: str = ""  # for the log line of a delivery that does not run

    @property
    def reason(self) -> str:
        """Why the delivery does not run now (busy, running, store_unavailable...)."""
        return self.admission.outcome if self.admission is not None else self.why


def start_slot(
    guard: ReservationGuard, d: Delivery, default_lease: float
) -> Flow[Lease | Verdict | None]:
    """The job's slot for one lease from now (taken now if its reservation lapsed or it was
    sent without one); None without a scope or a store. A job without a slot that finds its
    scope full is sent again later: the Verdict says so. ``default_lease``: the lease of a
    job without a dedup policy."""
    if not d.scope:
        return None
    lease = d.policy.policy.lease_seconds if d.policy else default_lease
    try:
        return (yield from guard.start_flow(d.scope, d.job_id, lease, d.cap))
    except StoreUnavailable as exc:
        log.warning("taskdedup: could not renew the slot of %s: %s", d.job_id, exc)
        return None
    except QuotaExceeded:
        log.info(
            "taskdedup: not starting %s[%s]: it holds no slot and scope %s is full; "
            "sent again in %gs",
            d.task,
            d.job_id,
            d.scope,
            FULL_DELAY,
        )
        return Verdict("resend", delay=FULL_DELAY, waits=d.waits, why="full")


def claim(
    dedup: Deduplicator, guard: ReservationGuard, d: Delivery, slot: Lease | None
) -> Flow[Verdict]:
    """May the delivery run now? A copy of a finished job is dropped, its slot freed (G7); a
    busy one, a copy of a running job or one the store could not claim (G14) is sent back
    later; a claim that hands the lock on asks for the owed run's publish first."""
    if d.policy is None:
        return Verdict("run", slot=slot)
    admission: Admission = yield from ask(
        dedup.plan_claim(
            d.policy,
            d.job_id,
            key=d.key,
            args=d.args,
            kwargs=d.kwargs,
            queue=d.queue,
            attempt=d.attempt,
            store_waits=d.waits.store_waits,
            lost_claims=d.waits.lost_claims,
        )
    )
    if admission.handoff is not None and admission.key is not None:
        yield HandOff(admission.key, admission.handoff)
    if admission.should_run:
        return Verdict("run", admission, slot)
    if admission.retry_after is None:  # a copy of a finished job: over
        if slot is not None:
            yield from guard.give_back_flow(slot.key, slot.job_id)
        verdict = Verdict("drop", admission, why="dropped")
    else:
        delay = admission.retry_after
        waits = d.waits.after(admission)
        verdict = Verdict("resend", admission, None, delay, waits, f"sent again in {delay:g}s")
    log.info(
        "taskdedup: not running %s[%s]: %s (holder %s), %s",
        d.task,
        d.job_id,
        admission.outcome,
        admission.holder,
        verdict.why,
    )
    return verdict


def admit(
    dedup: Deduplicator, guard: ReservationGuard, d: Delivery, default_lease: float
) -> Flow[Verdict]:
    """:func:`start_slot`, then :func:`claim`."""
    slot = yield from start_slot(guard, d, default_lease)
    if isinstance(slot, Verdict):
        return slot
    return (yield from claim(dedup, guard, d, slot))


def end(
    dedup: Deduplicator,
    guard: ReservationGuard,
    d: Delivery,
    admission: Admission | None,
    slot: Lease | None,
    *,
    keep_slot: bool = False,
    keep_lock: bool = False,
) -> Flow[None]:
    """The delivery is over. Ended for good: free its slot, then release, keep or hand on its
    lock (finish). A retry of it that was sent keeps both (``keep_slot``, ``keep_lock``: G6)."""
    if slot is not None and not keep_slot:
        yield from guard.give_back_flow(slot.key, slot.job_id)
    if keep_lock or d.policy is None or admission is None or admission.key is None:
        return None
    done: Completion = yield from ask(
        dedup.plan_finish(d.policy, admission.key, d.job_id, d.attempt)
    )
    if done.handoff is not None:
        yield HandOff(admission.key, done.handoff)
    return None


def discard(
    dedup: Deduplicator,
    guard: ReservationGuard,
    task: str,
    job_id: str,
    key: str | None,
    scope: str | None,
    *,
    killed: bool,
    release: bool = True,
    why: str = "discarded",
) -> Flow[bool]:
    """A job that will not run here (revoked or expired) or, ``killed``, was terminated: free
    its slot and, with ``release``, its lock (G13). A discarded job frees only a lock still
    QUEUED, and its slot only while the store does not record the job running: a plain revoke
    does not stop a run, and every worker discards the copies of a revoked job it receives,
    so freeing more would let a new job run beside the one still going. A terminated job frees
    everything. True when the lock was freed; ``why`` (revoked, expired...) is logged.
    A job whose key is unknown (no key in its message, no arguments) frees no lock: it
    lapses after its ttl."""
    if scope:
        running = False
        if not killed and key is not None:
            try:
                running = (yield JobState(key, job_id)) == "running"
            except StoreUnavailable:
                running = False
        if not running:
            yield from guard.give_back_flow(scope, job_id)
    if key is None or not release:
        if release:
            log.info(
                "taskdedup: %s %s[%s]: its key is unknown (none in its message, no "
                "arguments): its lock lapses after its ttl",
                why,
                task,
                job_id,
            )
        return False
    how = "terminated" if killed else "discarded"
    freed: bool = yield dedup.plan_release(key, job_id, task=task, queued_only=not killed, why=how)
    if freed:
        log.info("taskdedup: %s %s[%s]: its key is free", why, task, job_id)
    elif not killed:
        log.info(
            "taskdedup: %s %s[%s]: its key is not queued (its job runs, or ran, elsewhere): "
            "left to that run",
            why,
            task,
            job_id,
        )
    return freed


#: How long a delivery the broker will not take back (it is down too) waits in the worker for
#: its claim before it gives up (:func:`when_resend_refused`).
STAY_AT_MOST = 600.0
Refused = Literal["fail_and_free", "requeue", "fail"]


def when_resend_refused(admission: Admission | None, acks_late: bool) -> Refused:
    """The broker would not take a delivery back for :data:`STAY_AT_MOST` seconds. If the store
    never answered, the job fails visibly, its lock freed first (G5: ``fail_and_free``). If
    another run holds the key (busy) or this very job runs elsewhere (a copy of it), nothing
    here is ours to free: a delivery the broker can still take back (acks_late) goes back to
    it (``requeue``), and so does a copy of a running job acknowledged already (the job runs,
    renewing its lease, and a failure would be written under its id while it runs). A busy
    job acknowledged already fails visibly (``fail``)."""
    outcome = admission.outcome if admission is not None else "store_unavailable"
    if outcome == "store_unavailable":
        return "fail_and_free"
    if acks_late or outcome == "running":
        return "requeue"
    return "fail"


#: What a job record says of a holder: running under a live lease, queued, finished, no
#: record, or the store could not say.
HolderRecord = Literal["running", "queued", "finished", "none", "unknown"]


def holder_may_end(key: str, holder: str, *, revoked: bool = False) -> Flow[bool]:
    """Whether a key's holder may still end with a result (a canvas member that follows it
    waits while it may): its lock or run lock names it, or its job record says it runs under
    a live lease, or the store cannot say. A holder marked revoked may only while its record
    says it runs: a plain revoke does not stop a running job."""
    if revoked:
        return (yield from holder_record(key, holder)) == "running"
    try:
        info = yield Inspect(key)
    except StoreUnavailable:
        return True  # cannot tell: keep waiting, the result backend may still answer
    if info is not None and holder in (info.job_id, info.running_job):
        return True
    return (yield from holder_record(key, holder)) in ("running", "unknown")


def holder_record(key: str, job_id: str) -> Flow[HolderRecord]:
    """What the store's record of ``job_id`` under ``key`` says (written at claim, renewed by
    heartbeats, marked finished at finish); "unknown" only when the store could not answer."""
    try:
        state: HolderRecord = yield JobState(key, job_id)
    except StoreUnavailable:
        return "unknown"
    return state
