"""Deduplicator: the decisions of the lock diagram, with no framework imports.

Each decision is planned once as a :class:`Step` (the store operation to run, how to read its
reply, what to do if the store is down) and executed by a sync or an asyncio runner, so Celery
(sync) and taskiq (asyncio) share one copy of the logic. Settings that apply to every decision
(``enabled``, ``dry_run``, ``disabled_tasks``, ``on_store_error``) are applied here, once, for
both adapters. Every decision is logged on the ``taskdedup`` logger and counted in ``stats``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

from .background import Confirmer, Releaser
from .errors import DuplicateJob, PayloadTooLarge, StoreUnavailable
from .policy import ENQUEUE_LOCKING, HOLD_WHILE_RUNNING, RUN_LOCKING, TaskPolicy
from .settings import Settings
from .stores.base import (
    Acquire,
    AcquireReply,
    Claim,
    ClaimReply,
    Finish,
    FinishReply,
    Handoff,
    Heartbeat,
    Lease,
    LockMode,
    Op,
    Peek,
    Release,
    Retry,
    Store,
    ms,
)

log = logging.getLogger("taskdedup")
T = TypeVar("T")

TicketOutcome = Literal["acquired", "duplicate", "store_unavailable", "skipped"]
#: Seconds before a delivery whose key is another job's (busy) is tried again.
BUSY_DELAY = 1.0
#: Seconds before a job that holds no slot and found its scope full at start is tried again.
FULL_DELAY = 2.0
#: The longest wait between two tries of a delivery the store could not claim (G14).
STORE_RETRY_MAX = 30.0
#: How long a duplicate waits for a holder whose publish is not confirmed yet (it may fail
#: and free the key) before it is answered with that holder all the same, and how often it
#: asks again meanwhile.
HOLDER_WAIT = 5.0
HOLDER_POLL = 0.05
AdmissionOutcome = Literal[
    "run", "running", "done", "busy", "exhausted", "store_unavailable", "skipped"
]


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    """The answer to an enqueue: publish ``job_id``, or hand the caller ``holder``'s job."""

    outcome: TicketOutcome
    job_id: str  # the id to publish under (ours), or the holder's id for a duplicate
    key: str | None
    fence: int = 0
    duplicates: int = 0
    dry_run: bool = False
    confirm: bool = False  # the lock waits for a publish confirmation (G11)

    @property
    def acquired(self) -> bool:
        return self.outcome == "acquired"

    @property
    def deduplicated(self) -> bool:
        """True when nothing must be published: the caller gets ``job_id``'s existing job."""
        return self.outcome == "duplicate" and not self.dry_run

    @property
    def should_publish(self) -> bool:
        return not self.deduplicated


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The answer to a claim: may this delivery of the job run now?"""

    outcome: AdmissionOutcome
    job_id: str
    key: str | None
    fence: int = 0
    attempts: int = 0
    holder: str = ""
    handoff: Handoff | None = None  # publish this job now (reschedule owed at start)
    lease: Lease | None = None  # renew this while the job runs
    dry_run: bool = False
    retry_after: float | None = None  # not run now: send this delivery again in so many s
    #: the claim's own id: when the store could not answer (store_unavailable), the delivery
    #: sent again carries it among its lost claims, so a record that claim may have written is
    #: not taken for a run of the job elsewhere
    claim_nonce: str = ""

    @property
    def should_run(self) -> bool:
        """Run the body now. Otherwise the delivery is sent again after ``retry_after``
        (busy, its holder running, the store down) or, when that is None, dropped."""
        return self.outcome in ("run", "skipped") or self.dry_run


#: How many lost claims a delivery remembers (the store answers again long before more pile up)
LOST_CLAIMS_KEPT = 8


def parse_lost_claims(value: Any) -> list[str]:
    """The lost claims a delivery carries (a header or label: a list, or comma-separated)."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item) for item in items if item][-LOST_CLAIMS_KEPT:]


def with_lost_claim(lost: Sequence[str], admission: Admission) -> list[str]:
    """``lost`` plus this claim's nonce when the store could not answer it (its reply may have
    been lost after the store wrote the job's record)."""
    if admission.outcome != "store_unavailable" or not admission.claim_nonce:
        return list(lost)
    return [*lost, admission.claim_nonce][-LOST_CLAIMS_KEPT:]


def store_retry_delay(waits: int) -> float:
    """How long a delivery waits before its next claim after ``waits`` claims the store could
    not answer: 1, 2, 4 ... seconds, at most STORE_RETRY_MAX."""
    return min(2.0 ** max(waits, 0), STORE_RETRY_MAX)


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """The answer to a finish: whether the lock was released, and a job to publish, if owed."""

    released: bool
    handoff: Handoff | None = None


@dataclasses.dataclass(slots=True)
class Step(Generic[T]):
    """A planned decision: the store operation to run, how to read its reply, and what to do
    if the store is down. An adapter with a faster way to run ``op`` (the Celery adapter
    fuses an enqueue's acquire with the broker's push) runs it itself and calls ``done``,
    unless ``waits`` says that reply is not final yet: then it runs the Step as usual.

    ``waits``: for a reply that is not an answer yet (the key's holder is still being
    published, and may yet fail), the seconds to wait before asking again with ``again``;
    None for a final reply. The runners ask for HOLDER_WAIT at most, then take the last reply
    as it is."""

    op: Op[Any]
    done: Callable[[Any], T]
    failed: Callable[[StoreUnavailable], T]
    waits: Callable[[Any], float | None] | None = None
    again: Op[Any] | None = None


_CLAIM_MODES: dict[str, tuple[LockMode, bool]] = {
    "until_executing": ("release", False),
    "until_executed": ("hold", False),
    "until_expired": ("hold", False),
    "while_executing": ("none", True),
    "until_and_while_executing": ("release", True),
}


class Deduplicator:
    """Makes the dedup decisions for both adapters against one store."""

    def __init__(
        self, store: Store, settings: Settings | None = None, *, owner: str | None = None
    ) -> None:
        self.store = store
        self.settings = settings or Settings()
        self._owner = owner
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self.confirmer = Confirmer(self)
        self.releaser = Releaser(self)

    @property
    def owner(self) -> str:
        """Who runs jobs here: host and pid (read each time, so it stays true after a fork)."""
        return self._owner or f"{socket.gethostname()}:{os.getpid()}"

    def active(self, task: str) -> bool:
        return self.settings.enabled and task not in self.settings.disabled_tasks

    # ------------------------------------------------------------------ runners

    def run(self, step: Step[T]) -> T:
        """Execute a planned Step against the store (``plan_enqueue`` and friends)."""
        return self._run(step)

    async def arun(self, step: Step[T]) -> T:
        """The asyncio twin of :meth:`run`."""
        return await self._arun(step)

    def resume(self, step: Step[T]) -> T:
        """Run a Step whose ``op`` an adapter already ran itself (a fused publish) and whose
        reply was not final: ask again with ``again``, so nothing is counted twice."""
        return self._run(step, step.again)

    async def aresume(self, step: Step[T]) -> T:
        return await self._arun(step, step.again)

    def _run(self, step: Step[T], first: Op[Any] | None = None) -> T:
        op, deadline = first or step.op, time.monotonic() + HOLDER_WAIT
        while True:
            try:
                reply = self.store.run(op)
            except StoreUnavailable as exc:
                return step.failed(exc)
            pause = None if step.waits is None else step.waits(reply)
            if pause is None or time.monotonic() > deadline:
                return step.done(reply)
            op = step.again or step.op
            if pause:
                time.sleep(pause)

    async def _arun(self, step: Step[T], first: Op[Any] | None = None) -> T:
        op, deadline = first or step.op, time.monotonic() + HOLDER_WAIT
        while True:
            try:
                reply = await self.store.arun(op)
            except StoreUnavailable as exc:
                return step.failed(exc)
            pause = None if step.waits is None else await self._apending(step, reply)
            if pause is None or time.monotonic() > deadline:
                return step.done(reply)
            op = step.again or step.op
            if pause:  # (0: at once, without letting other tasks run meanwhile)
                await asyncio.sleep(pause)

    def note(self, decision: str, outcome: str, level: int, task: str, **fields: Any) -> None:
        with self._stats_lock:
            self.stats[f"{decision}.{outcome}"] += 1
        if log.isEnabledFor(level):
            detail = " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, ""))
            log.log(level, "%s %s %s: %s", decision, outcome, task, detail)

    def store_unavailable(
        self, decision: str, task: str, exc: StoreUnavailable, **fields: Any
    ) -> None:
        self.note(decision, "store_unavailable", logging.WARNING, task, error=exc, **fields)
        if self.settings.on_store_error == "raise":
            raise exc

    # ------------------------------------------------------------------ enqueue

    def enqueue(
        self,
        policy: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        job_id: str | None = None,
        queue: str | None = None,
        delay: float = 0.0,
        payload: str | None = None,
        expires_in: float | None = None,
    ) -> Ticket:
        """Take the enqueue lock for one call, or learn which job already holds it.

        Raises DuplicateJob when the policy says ``on_conflict="raise"``. After publishing an
        acquired ticket call :meth:`published`; if the publish fails, :meth:`publish_failed`.
        """
        step = self.plan_enqueue(
            policy, args, kwargs, job_id, queue, delay, payload, expires_in=expires_in
        )
        return step if isinstance(step, Ticket) else self._run(step)

    async def aenqueue(
        self,
        policy: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        job_id: str | None = None,
        queue: str | None = None,
        delay: float = 0.0,
        payload: str | None = None,
        expires_in: float | None = None,
    ) -> Ticket:
        """The asyncio twin of :meth:`enqueue`."""
        step = self.plan_enqueue(
            policy, args, kwargs, job_id, queue, delay, payload, expires_in=expires_in
        )
        return step if isinstance(step, Ticket) else await self._arun(step)

    def plan_enqueue(
        self,
        tp: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        job_id: str | None = None,
        queue: str | None = None,
        delay: float = 0.0,
        payload: str | None = None,
        key: str | None = None,
        expires_in: float | None = None,
    ) -> Ticket | Step[Ticket]:
        """:meth:`enqueue` without running it: a Ticket when no store call is needed, else the
        Step whose ``op`` is an :class:`Acquire` (raises KeyEncodingError for bad arguments).
        ``key``: the call's key, when the caller has already computed it. ``expires_in``: the
        seconds after which the broker's job will never start (Celery's ``expires``); its lock
        then lives no longer than that plus ``grace``, so a job that expires unseen (no worker
        read it, or the worker that dropped it could not tell the store) does not hold its key
        for the whole ttl (G13). A job that starts in time takes its lock's life at its claim."""
        job_id = job_id or str(uuid.uuid4())
        p, task = tp.policy, tp.task
        if not self.active(task) or p.strategy not in ENQUEUE_LOCKING:
            return Ticket("skipped", job_id, None)
        if delay > 0 and not p.including_scheduled:
            return Ticket("skipped", job_id, None)
        key = key or tp.key_for(args, kwargs, queue)
        ttl = ms(p.ttl_seconds + max(delay, 0.0))
        if expires_in is not None and p.strategy != "until_expired":  # a throttle outlives runs
            ttl = min(ttl, ms(max(expires_in, 0.0) + self.settings.grace))
        grace = min(ms(self.settings.grace), ttl)
        dry = self.settings.dry_run
        if p.on_conflict != "reschedule_once":
            payload = None
        limit = self.settings.reschedule_payload_limit
        if payload is not None and limit and len(payload.encode()) > limit:
            raise PayloadTooLarge(task, len(payload.encode()), limit)
        op = Acquire(
            key,
            job_id,
            ttl,
            grace,
            record_duplicate=not dry,
            payload=payload,
        )

        def done(reply: AcquireReply) -> Ticket:
            if reply.acquired:
                self.note("enqueue", "acquired", logging.DEBUG, task, key=key, job=job_id)
                return Ticket("acquired", job_id, key, reply.fence, confirm=grace < ttl)
            if (
                reply.pending and not dry
            ):  # HOLDER_WAIT passed and the holder is still not published: it
                # may never be (its producer died mid-publish). Its job is no answer to give;
                # publish this one without a lock: at worst a missed dedup, never lost work.
                self.note(
                    "enqueue",
                    "holder_unconfirmed",
                    logging.WARNING,
                    task,
                    key=key,
                    holder=reply.holder,
                    job=job_id,
                )
                return Ticket("skipped", job_id, None)
            outcome = "would_deduplicate" if dry else "duplicate"
            self.note("enqueue", outcome, logging.INFO, task, key=key, holder=reply.holder)
            if p.on_conflict == "raise" and not dry:
                raise DuplicateJob(reply.holder, key, task)
            return Ticket(
                "duplicate",
                job_id if dry else reply.holder,
                key,
                reply.fence,
                reply.duplicates,
                dry_run=dry,
            )

        def failed(exc: StoreUnavailable) -> Ticket:
            self.store_unavailable("enqueue", task, exc, key=key, job=job_id)
            return Ticket("store_unavailable", job_id, key)

        # A holder still being published may fail and free the key: answering with it could
        # lose this call's work, so ask again (counted once) until it is confirmed or gone.
        return Step(
            op,
            done,
            failed,
            waits=None if dry else self._holder_pending,
            again=dataclasses.replace(op, record_duplicate=False, payload=None),
        )

    def plan_held(self, tp: TaskPolicy, key: str) -> Step[Ticket | None] | None:
        """An adapter's shortcut for a likely duplicate: a Step answering the holder's Ticket
        when ``key`` is held (counted as a duplicate; DuplicateJob when the policy says so),
        or None when it is free. None instead of a Step when no shortcut applies (dedup off,
        dry run, a strategy without an enqueue lock): then enqueue as usual."""
        p, task = tp.policy, tp.task
        if not self.active(task) or p.strategy not in ENQUEUE_LOCKING or self.settings.dry_run:
            return None

        def done(reply: AcquireReply | None) -> Ticket | None:
            if reply is None or reply.pending:  # free, or a holder that may yet fail:
                return None  # the usual enqueue decides
            self.note("enqueue", "duplicate", logging.INFO, task, key=key, holder=reply.holder)
            if p.on_conflict == "raise":
                raise DuplicateJob(reply.holder, key, task)
            return Ticket("duplicate", reply.holder, key, reply.fence, reply.duplicates)

        def failed(exc: StoreUnavailable) -> Ticket | None:
            return None  # the usual enqueue meets the outage and follows on_store_error

        return Step(Peek(key), done, failed)

    def _holder_pending(self, reply: AcquireReply) -> float | None:
        """When to ask again about a holder still being published (None: it is not). A holder
        published by this very process has its confirmation sent now, and is asked about
        again at once."""
        if not reply.pending or reply.acquired:
            return None
        return 0.0 if self.confirmer.hurry(reply.holder) else HOLDER_POLL

    async def _apending(self, step: Step[T], reply: Any) -> float | None:
        """``step.waits`` for the async runner: a holder published by this very process has
        its confirmation sent without blocking the event loop."""
        if step.waits is None:
            return None
        if isinstance(reply, AcquireReply) and reply.pending and not reply.acquired:
            return 0.0 if await self.confirmer.ahurry(reply.holder) else HOLDER_POLL
        return step.waits(reply)

    def published(self, ticket: Ticket) -> None:
        """The job of an acquired ticket is in the broker: confirm its lock (batched, G11)."""
        if ticket.acquired and ticket.confirm and ticket.key is not None:
            self.confirmer.add(ticket.key, ticket.job_id)

    def publish_failed(self, ticket: Ticket) -> bool:
        """Publishing failed: release the ticket's lock before the error reaches the caller."""
        if not ticket.acquired or ticket.key is None:
            return False
        return self.release(ticket.key, ticket.job_id, task="(publish failed)")

    async def apublish_failed(self, ticket: Ticket) -> bool:
        if not ticket.acquired or ticket.key is None:
            return False
        return await self.arelease(ticket.key, ticket.job_id, task="(publish failed)")

    # ------------------------------------------------------------------ claim

    def claim(
        self,
        policy: TaskPolicy,
        job_id: str,
        *,
        key: str | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        queue: str | None = None,
        attempt: int | None = None,
        store_waits: int = 0,
        lost_claims: Sequence[str] = (),
    ) -> Admission:
        """A worker is about to run ``job_id``: may it? (``key`` is recomputed when not given.)

        ``store_waits``: how many times this delivery was already sent back because the store
        could not answer its claim (sets the back-off of the next one). ``lost_claims``: the
        nonces of this job's earlier claims whose replies never arrived (see
        ``Admission.claim_nonce``)."""
        step = self._plan_claim(
            policy, job_id, key, args, kwargs, queue, attempt, store_waits, lost_claims
        )
        return step if isinstance(step, Admission) else self._run(step)

    async def aclaim(
        self,
        policy: TaskPolicy,
        job_id: str,
        *,
        key: str | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        queue: str | None = None,
        attempt: int | None = None,
        store_waits: int = 0,
        lost_claims: Sequence[str] = (),
    ) -> Admission:
        step = self._plan_claim(
            policy, job_id, key, args, kwargs, queue, attempt, store_waits, lost_claims
        )
        return step if isinstance(step, Admission) else await self._arun(step)

    def _plan_claim(
        self,
        tp: TaskPolicy,
        job_id: str,
        key: str | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        queue: str | None,
        attempt: int | None,
        store_waits: int = 0,
        lost_claims: Sequence[str] = (),
    ) -> Admission | Step[Admission]:
        p, task = tp.policy, tp.task
        if not self.active(task):
            return Admission("skipped", job_id, key)
        key = key or tp.key_for(args, kwargs, queue)
        lock_mode, run_lock = _CLAIM_MODES[p.strategy]
        reschedule = p.on_conflict == "reschedule_once" and lock_mode == "release"
        lease_ms = ms(p.lease_seconds)
        owner = self.owner
        dry = self.settings.dry_run
        op = Claim(
            key,
            job_id,
            owner,
            lease_ms,
            ms(p.ttl_seconds),
            lock_mode,
            run_lock,
            ms(self.settings.remember_finished),
            attempt=attempt,
            max_attempts=p.max_attempts,
            handoff_job_id=str(uuid.uuid4()) if reschedule else None,
            grace_ms=min(ms(self.settings.grace), ms(p.ttl_seconds)),
            nonce=uuid.uuid4().hex[:16],
            lost_claims=tuple(lost_claims),
        )

        def done(reply: ClaimReply) -> Admission:
            level = logging.DEBUG if reply.outcome == "run" else logging.INFO
            outcome = reply.outcome if reply.outcome == "run" or not dry else "would_skip"
            self.note("claim", outcome, level, task, key=key, job=job_id, holder=reply.holder)
            lease = Lease(key, job_id, lease_ms, task=task) if reply.outcome == "run" else None
            retry_after = {"busy": BUSY_DELAY, "running": p.lease_seconds + 1}.get(reply.outcome)
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
            )

        def failed(exc: StoreUnavailable) -> Admission:
            # An accepted job is never failed, nor run unguarded, because the store is down
            # (G14): it goes back to the broker and is claimed again later. on_store_error is
            # the producer's choice; it does not apply here.
            delay = store_retry_delay(store_waits)
            self.note(
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
                "store_unavailable",
                job_id,
                key,
                dry_run=dry,
                retry_after=delay,
                claim_nonce=op.nonce,
            )

        return Step(op, done, failed)

    # ------------------------------------------------------------------ while running

    def heartbeat(self, leases: Iterable[Lease]) -> tuple[bool, ...] | None:
        """Renew many leases in one batch; None when the store is down (logged). Each answer
        says whether that job still held something (see :meth:`lease_lost`)."""
        batch = tuple(leases)
        return self._run(self._plan_heartbeat(batch)) if batch else ()

    async def aheartbeat(self, leases: Iterable[Lease]) -> tuple[bool, ...] | None:
        batch = tuple(leases)
        return await self._arun(self._plan_heartbeat(batch)) if batch else ()

    def _plan_heartbeat(self, batch: tuple[Lease, ...]) -> Step[tuple[bool, ...] | None]:
        def done(reply: tuple[bool, ...]) -> tuple[bool, ...]:
            with self._stats_lock:
                self.stats["heartbeat.renewed"] += sum(reply)
            return reply

        def failed(exc: StoreUnavailable) -> None:
            self.note("heartbeat", "store_unavailable", logging.WARNING, "?", error=exc)
            return None

        return Step(Heartbeat(batch), done, failed)

    def lease_lost(self, lease: Lease) -> None:
        """A job that still runs here no longer holds its lock or slot (its lease lapsed, say
        while the store was unreachable for longer than the lease): say so loudly, once."""
        what = "slot" if lease.slot else "lock"
        self.note(
            "heartbeat",
            "lost",
            logging.WARNING,
            lease.task or "?",
            key=lease.key,
            job=lease.job_id,
            lost=what,
        )

    # ------------------------------------------------------------------ retry, finish, release

    def retry(
        self,
        policy: TaskPolicy,
        key: str,
        job_id: str,
        *,
        delay: float = 0.0,
        attempt: int | None = None,
    ) -> bool:
        """The job will run again under the same id: keep its lock, now QUEUED (G6)."""
        if not self.active(policy.task):  # the kill switch: no store command at all (G16)
            return False
        return self._run(self._plan_retry(policy, key, job_id, delay, attempt))

    async def aretry(
        self,
        policy: TaskPolicy,
        key: str,
        job_id: str,
        *,
        delay: float = 0.0,
        attempt: int | None = None,
    ) -> bool:
        if not self.active(policy.task):
            return False
        return await self._arun(self._plan_retry(policy, key, job_id, delay, attempt))

    def _plan_retry(
        self, tp: TaskPolicy, key: str, job_id: str, delay: float, attempt: int | None
    ) -> Step[bool]:
        op = Retry(key, job_id, ms(tp.policy.ttl_seconds + max(delay, 0.0)), attempt)

        def done(kept: bool) -> bool:
            self.note(
                "retry", "kept" if kept else "unlocked", logging.DEBUG, tp.task, key=key, job=job_id
            )
            return kept

        def failed(exc: StoreUnavailable) -> bool:
            self.note("retry", "store_unavailable", logging.WARNING, tp.task, error=exc)
            return False

        return Step(op, done, failed)

    def finish(
        self, policy: TaskPolicy, key: str, job_id: str, *, attempt: int | None = None
    ) -> Completion:
        """The job ended for good (success or final failure): release, throttle or hand off."""
        if not self.active(policy.task):  # the kill switch: no store command at all (G16)
            return Completion(False)
        return self._run(self._plan_finish(policy, key, job_id, attempt))

    async def afinish(
        self, policy: TaskPolicy, key: str, job_id: str, *, attempt: int | None = None
    ) -> Completion:
        if not self.active(policy.task):
            return Completion(False)
        return await self._arun(self._plan_finish(policy, key, job_id, attempt))

    def _plan_finish(
        self, tp: TaskPolicy, key: str, job_id: str, attempt: int | None
    ) -> Step[Completion]:
        p = tp.policy
        holds = p.strategy in HOLD_WHILE_RUNNING or p.strategy in RUN_LOCKING
        reschedule = p.on_conflict == "reschedule_once" and p.strategy in HOLD_WHILE_RUNNING
        ttl = ms(p.ttl_seconds)
        op = Finish(
            key,
            job_id,
            throttle=p.strategy == "until_expired",
            memory_ms=ms(self.settings.remember_finished),
            handoff_job_id=str(uuid.uuid4()) if reschedule else None,
            attempt=attempt,
            grace_ms=min(ms(self.settings.grace), ttl),
            ttl_ms=ttl,
        )

        def done(reply: FinishReply) -> Completion:
            outcome = "handed_off" if reply.handoff else "released" if reply.released else "kept"
            if reply.stale:
                outcome = "stale"
            level = logging.DEBUG if reply.released or not holds else logging.INFO
            self.note(
                "finish",
                outcome,
                level,
                tp.task,
                key=key,
                job=job_id,
                next=reply.handoff.job_id if reply.handoff else None,
            )
            return Completion(reply.released, reply.handoff)

        def failed(exc: StoreUnavailable) -> Completion:
            self.note("finish", "store_unavailable", logging.WARNING, tp.task, error=exc)
            return Completion(False)

        return Step(op, done, failed)

    def release(self, key: str, job_id: str, *, task: str = "?", queued_only: bool = False) -> bool:
        """Owner-checked release (failed publish, revoke): only ``job_id``'s lock goes.
        ``queued_only``: only while that lock is QUEUED (a discarded or expired copy of a job
        must not free the key of the job's run still going elsewhere)."""
        return self._run(self._plan_release(Release(key, job_id, queued_only), task))

    async def arelease(
        self, key: str, job_id: str, *, task: str = "?", queued_only: bool = False
    ) -> bool:
        return await self._arun(self._plan_release(Release(key, job_id, queued_only), task))

    def _plan_release(self, op: Release, task: str) -> Step[bool]:
        key, job_id = op.key, op.job_id

        def done(released: bool) -> bool:
            self.note(
                "release",
                "released" if released else "not_holder",
                logging.DEBUG,
                task,
                key=key,
                job=job_id,
            )
            return released

        def failed(exc: StoreUnavailable) -> bool:
            # sent again until the store takes it: the lock must not outlive the outage (G13)
            self.note(
                "release",
                "store_unavailable",
                logging.WARNING,
                task,
                key=key,
                job=job_id,
                then="sent again when the store answers",
                error=exc,
            )
            self.releaser.add(op)
            return False

        return Step(op, done, failed)

    def close(self) -> None:
        """Flush pending confirmations and stop background work."""
        self.confirmer.stop()
