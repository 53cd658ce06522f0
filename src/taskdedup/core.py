"""Deduplicator: runs the decisions of ``taskdedup.decide`` against one store.

The rules live in ``decide`` (no I/O); this runner does what they cannot: the store calls,
synchronously (Celery) or from asyncio (taskiq), the waits for a holder still being published,
the ids and the clock, logging and counting every decision, and the background work that
confirms published locks and sends again releases the store could not take.
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
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from . import events
from .background import Confirmer, LateReplies, Releaser
from .decide import (
    Admission,
    Completion,
    Step,
    Ticket,
    active,
    plan_claim,
    plan_enqueue,
    plan_finish,
    plan_heartbeat,
    plan_held,
    plan_release,
    plan_retry,
)
from .errors import StoreUnavailable
from .flow import Flow, adrive, drive
from .policy import TaskPolicy
from .reservations import renew_each
from .settings import Settings
from .stores import sends_early
from .stores.base import AcquireReply, Lease, Op, Peek, Release, Store
from .ticks import ScheduledTicks

log = logging.getLogger("taskdedup")
T = TypeVar("T")

#: How long a duplicate waits for a holder whose publish is not confirmed yet (it may fail
#: and free the key) before it is answered with that holder all the same, and how often it
#: asks again meanwhile.
HOLDER_WAIT = 5.0
HOLDER_POLL = 0.05


def new_id() -> str:
    return str(uuid.uuid4())


class Runner:
    """Executes planned Steps against one store, synchronously or from asyncio, and logs and
    counts what the decisions note."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self.confirmer = Confirmer(self)
        self.releaser = Releaser(self)
        self.late = LateReplies()
        #: Listeners of this runner's decisions (an adapter's signals or callbacks); those of
        #: every runner in the process are :data:`taskdedup.events.everywhere`.
        self.listeners = events.Listeners()
        if self.settings.metrics:  # (the module says what to install when it is missing)
            from .metrics import install_metrics

            install_metrics()

    def run(self, step: Step[T]) -> T:
        """Execute a planned Step against the store (``plan_enqueue`` and friends)."""
        return self._run(step)

    async def arun(self, step: Step[T]) -> T:
        """The asyncio twin of :meth:`run`."""
        return await self._arun(step)

    def settle(self, plan: T | Step[T]) -> T:
        """The answer of a plan: its Step run against the store, or the answer itself when
        planning settled it without the store (a Ticket, an Admission...)."""
        return self._run(plan) if isinstance(plan, Step) else plan

    async def asettle(self, plan: T | Step[T]) -> T:
        return await self._arun(plan) if isinstance(plan, Step) else plan

    def drive(
        self, flow: Flow[T], act: Callable[[Any], Any] | None = None, *, late: bool = False
    ) -> T:
        """Run a flow (:mod:`taskdedup.flow`) against the store: the Steps it yields run here,
        any other request (a framework's part) by ``act``. ``late``: a Step whose reply only
        feeds the notes is written and answered at once, its reply read later (``late``)."""

        def answer(request: Any) -> Any:
            if isinstance(request, Step):
                if late and request.answer_now is not None:
                    return self._run_late(request)
                return self._run(request)
            if act is None:
                raise TypeError(f"nothing here answers {request!r}")
            return act(request)

        return drive(flow, self.store, answer)

    async def adrive(self, flow: Flow[T], act: Callable[[Any], Awaitable[Any]] | None = None) -> T:
        """:meth:`drive` from asyncio."""

        async def answer(request: Any) -> Any:
            if isinstance(request, Step):
                return await self._arun(request)
            if act is None:
                raise TypeError(f"nothing here answers {request!r}")
            return await act(request)

        return await adrive(flow, self.store, answer)

    def resume(self, step: Step[T]) -> T:
        """Run a Step whose ``op`` an adapter already ran itself (a fused publish) and whose
        reply was not final: ask again with ``again``, so nothing is counted twice."""
        return self._run(step, step.again)

    async def aresume(self, step: Step[T]) -> T:
        return await self._arun(step, step.again)

    def _run_late(self, step: Step[T]) -> T:
        """Write ``step``'s operation and answer at once; :attr:`late` reads the reply."""
        assert step.answer_now is not None
        try:
            sent = self.store.send(step.op) if sends_early(self.store) else None
            if sent is not None and sent.written:
                self.late.add(sent, step)
                return step.answer_now()
            if sent is not None:  # it could not be written: run it now, the usual way
                return step.done(sent.reply())
        except StoreUnavailable as exc:
            return step.failed(exc)
        return self._run(step)

    def _run(self, step: Step[T], first: Op[Any] | None = None) -> T:
        op, deadline = first or step.op, time.monotonic() + HOLDER_WAIT
        while True:
            try:
                reply = self.published_here(self.store.run(op), op)
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
                reply = self.published_here(await self.store.arun(op), op)
            except StoreUnavailable as exc:
                return step.failed(exc)
            pause = None if step.waits is None else step.waits(reply)
            if pause is None or time.monotonic() > deadline:
                return step.done(reply)
            op = step.again or step.op
            if pause:  # (0: at once, without letting other tasks run meanwhile)
                await asyncio.sleep(pause)

    def _holder_pending(self, reply: AcquireReply) -> float | None:
        """When to ask again about a holder still being published (None: it is not)."""
        if not reply.pending or reply.acquired:
            return None
        return HOLDER_POLL

    def published_here(self, reply: Any, op: Op[Any]) -> Any:
        """A holder whose publish this very process saw succeed (its confirmation is queued
        here) is as good as confirmed: its reply is final, no need to wait for the batch. A
        peek counts nothing at such a holder: the duplicate is counted with the confirmation."""
        waiting = isinstance(reply, AcquireReply) and reply.pending and not reply.acquired
        if waiting and self.confirmer.queued(reply.holder):
            if isinstance(op, Peek) and op.record_duplicate:
                self.confirmer.count_duplicate(reply.holder)
                return dataclasses.replace(reply, pending=False, duplicates=reply.duplicates + 1)
            return dataclasses.replace(reply, pending=False)
        return reply

    def note(self, decision: str, outcome: str, level: int, task: str, **fields: Any) -> None:
        """Count ``decision.outcome`` in ``stats``, log it on the ``taskdedup`` logger (the
        task, job, holder and key also as the record's ``extra`` fields: ``task_name``,
        ``job_id``, ``holder_job_id``, ``dedup_key``, ``decision``, ``outcome``) and hand it
        to the listeners as a :class:`~taskdedup.events.Decision`."""
        with self._stats_lock:
            self.stats[f"{decision}.{outcome}"] += 1
        if log.isEnabledFor(level):
            detail = " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, ""))
            extra = {
                "decision": decision,
                "outcome": outcome,
                "task_name": task,
                "job_id": fields.get("job"),
                "holder_job_id": fields.get("holder"),
                "dedup_key": fields.get("key"),
            }
            log.log(level, "%s %s %s: %s", decision, outcome, task, detail, extra=extra)
        if self.listeners or events.everywhere:
            self.tell(events.Decision.of(decision, outcome, task, fields))

    def tell(self, event: events.Decision) -> None:
        """Hand ``event`` to this runner's listeners and to those of the whole process."""
        self.listeners.send(event)
        events.everywhere.send(event)

    def store_unavailable(
        self, decision: str, task: str, exc: StoreUnavailable, **fields: Any
    ) -> None:
        self.note(decision, "store_unavailable", logging.WARNING, task, error=exc, **fields)
        if self.settings.on_store_error == "raise":
            raise exc

    def close(self) -> None:
        """Flush pending confirmations, read late replies, try pending releases once more and
        stop the background threads (a later use starts them again)."""
        self.confirmer.stop()
        self.late.stop()
        self.releaser.stop()


class Deduplicator(Runner):
    """Makes the dedup decisions for both adapters against one store."""

    def __init__(
        self, store: Store, settings: Settings | None = None, *, owner: str | None = None
    ) -> None:
        super().__init__(store, settings)
        self._owner = owner
        self.ticks = ScheduledTicks(self.note, self.settings)  # a scheduler's ticks

    @property
    def owner(self) -> str:
        """Who runs jobs here: host and pid (read each time, so it stays true after a fork)."""
        return self._owner or f"{socket.gethostname()}:{os.getpid()}"

    def active(self, task: str) -> bool:
        return active(self.settings, task)

    # ------------------------------------------------------------------ enqueue

    def enqueue(
        self,
        policy: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Ticket:
        """Take the enqueue lock for one call, or learn which job already holds it.

        ``options``: ``job_id``, ``queue``, ``delay``, ``payload``, ``expires_in`` (see
        :func:`taskdedup.decide.plan_enqueue`). Raises DuplicateJob when the policy says
        ``on_conflict="raise"``. After publishing an acquired ticket call :meth:`published`;
        if the publish fails, :meth:`publish_failed`."""
        step = self.plan_enqueue(policy, args, kwargs, **options)
        return self.settle(step)

    async def aenqueue(
        self,
        policy: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Ticket:
        """The asyncio twin of :meth:`enqueue`."""
        step = self.plan_enqueue(policy, args, kwargs, **options)
        return await self.asettle(step)

    def plan_enqueue(
        self,
        tp: TaskPolicy,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        job_id: str | None = None,
        **options: Any,
    ) -> Ticket | Step[Ticket]:
        """:meth:`enqueue` without running it (see :func:`taskdedup.decide.plan_enqueue`)."""
        return plan_enqueue(
            self.settings,
            tp,
            args,
            kwargs,
            job_id or new_id(),
            note=self.note,
            holder_pending=self._holder_pending,
            **options,
        )

    def plan_held(self, tp: TaskPolicy, key: str) -> Step[Ticket | None] | None:
        """See :func:`taskdedup.decide.plan_held`."""
        return plan_held(self.settings, tp, key, note=self.note)

    def published(self, ticket: Ticket) -> None:
        """The job of an acquired ticket is in the broker: confirm its lock (batched, G11)."""
        if ticket.acquired and ticket.confirm and ticket.key is not None:
            self.confirmer.add(ticket.key, ticket.job_id)

    def publish_failed(self, ticket: Ticket) -> bool:
        """Publishing failed: release the ticket's lock before the error reaches the caller."""
        plan = self.plan_publish_failed(ticket)
        return self.settle(plan)

    async def apublish_failed(self, ticket: Ticket) -> bool:
        plan = self.plan_publish_failed(ticket)
        return await self.asettle(plan)

    def plan_publish_failed(self, ticket: Ticket) -> bool | Step[bool]:
        """:meth:`publish_failed` without running it."""
        if not ticket.acquired or ticket.key is None:
            return False
        op = Release(ticket.key, ticket.job_id, why="publish_failed")
        return self._plan_release(op, "(publish failed)")

    # ------------------------------------------------------------------ claim

    def claim(self, policy: TaskPolicy, job_id: str, **delivery: Any) -> Admission:
        """A worker is about to run ``job_id``: may it? ``delivery``: ``key`` (recomputed
        when not given), ``args``, ``kwargs``, ``queue``, ``attempt``, ``store_waits``,
        ``lost_claims`` (see :func:`taskdedup.decide.plan_claim`)."""
        return self.settle(self.plan_claim(policy, job_id, **delivery))

    async def aclaim(self, policy: TaskPolicy, job_id: str, **delivery: Any) -> Admission:
        return await self.asettle(self.plan_claim(policy, job_id, **delivery))

    def plan_claim(
        self, tp: TaskPolicy, job_id: str, **delivery: Any
    ) -> Admission | Step[Admission]:
        """:meth:`claim` without running it."""
        nonce = uuid.uuid4().hex[:16]
        return plan_claim(
            self.settings,
            tp,
            job_id,
            note=self.note,
            owner=self.owner,
            nonce=nonce,
            new_id=new_id,
            **delivery,
        )

    # ------------------------------------------------------------------ while running

    def heartbeat(self, leases: Iterable[Lease]) -> tuple[int, ...] | None:
        """Renew many leases in one batch; None when the store is down (logged). Each answer
        says whether that job still held something (see :meth:`lease_lost`)."""
        batch, fold = renew_each(tuple(leases))
        return (
            fold(self._renewed(self._run(plan_heartbeat(batch, note=self.note)))) if batch else ()
        )

    async def aheartbeat(self, leases: Iterable[Lease]) -> tuple[int, ...] | None:
        batch, fold = renew_each(tuple(leases))
        if not batch:
            return ()
        return fold(self._renewed(await self._arun(plan_heartbeat(batch, note=self.note))))

    def _renewed(self, reply: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if reply is not None:
            renewed = sum(1 for alive in reply if alive)
            with self._stats_lock:
                self.stats["heartbeat.renewed"] += renewed
            if renewed and events.everywhere:  # (the metrics; not users' listeners, whose
                # slowness would hold up the next renewal on the heartbeat's own thread)
                events.everywhere.send(
                    events.Decision("heartbeat", "renewed", "*", fields={"count": renewed})
                )
        return reply

    def lease_lost(self, lease: Lease) -> None:
        """A job that still runs here no longer holds its lock or slot (its lease lapsed, say
        while the store was unreachable for longer than the lease): say so loudly, once."""
        what = "slot" if lease.slot else "lock"
        task = lease.task or "?"
        self.note(
            "heartbeat", "lost", logging.WARNING, task, key=lease.key, job=lease.job_id, lost=what
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
        plan = self.plan_retry(policy, key, job_id, delay, attempt)
        return self.settle(plan)

    async def aretry(
        self,
        policy: TaskPolicy,
        key: str,
        job_id: str,
        *,
        delay: float = 0.0,
        attempt: int | None = None,
    ) -> bool:
        plan = self.plan_retry(policy, key, job_id, delay, attempt)
        return await self.asettle(plan)

    def plan_retry(
        self, tp: TaskPolicy, key: str, job_id: str, delay: float = 0.0, attempt: int | None = None
    ) -> bool | Step[bool]:
        """:meth:`retry` without running it."""
        if not self.active(tp.task):  # the kill switch: no store command at all (G16)
            return False
        return plan_retry(self.settings, tp, key, job_id, delay, attempt, note=self.note)

    def finish(
        self, policy: TaskPolicy, key: str, job_id: str, *, attempt: int | None = None
    ) -> Completion:
        """The job ended for good (success or final failure): release, throttle or hand off."""
        plan = self.plan_finish(policy, key, job_id, attempt)
        return self.settle(plan)

    async def afinish(
        self, policy: TaskPolicy, key: str, job_id: str, *, attempt: int | None = None
    ) -> Completion:
        plan = self.plan_finish(policy, key, job_id, attempt)
        return await self.asettle(plan)

    def plan_finish(
        self, tp: TaskPolicy, key: str, job_id: str, attempt: int | None = None
    ) -> Completion | Step[Completion]:
        """:meth:`finish` without running it."""
        if not self.active(tp.task):  # the kill switch: no store command at all (G16)
            return Completion(False)
        return plan_finish(self.settings, tp, key, job_id, attempt, note=self.note, new_id=new_id)

    def release(self, key: str, job_id: str, *, task: str = "?", queued_only: bool = False) -> bool:
        """Owner-checked release (failed publish, revoke): only ``job_id``'s lock goes.
        ``queued_only``: only while that lock is QUEUED (a discarded or expired copy of a job
        must not free the key of the job's run still going elsewhere)."""
        return self._run(self._plan_release(Release(key, job_id, queued_only), task))

    async def arelease(
        self, key: str, job_id: str, *, task: str = "?", queued_only: bool = False
    ) -> bool:
        return await self._arun(self._plan_release(Release(key, job_id, queued_only), task))

    def plan_release(
        self, key: str, job_id: str, *, task: str = "?", queued_only: bool = False, why: str = ""
    ) -> Step[bool]:
        """:meth:`release` without running it (``why``: for the key's history)."""
        return self._plan_release(Release(key, job_id, queued_only, why), task)

    def _plan_release(self, op: Release, task: str) -> Step[bool]:
        return plan_release(op, task, note=self.note, unreleased=self.releaser.add)
