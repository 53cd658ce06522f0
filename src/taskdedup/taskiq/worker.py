"""The worker side: claim in ``pre_execute``, heartbeat while the task runs, finish afterwards.

A taskiq middleware cannot stop the receiver from calling the task, so each deduplicated task's
function gets a thin guard: a delivery that must not run carries a marker keyword argument, and
the guard raises taskiq's ``NoResultError`` (a kind that pickles) instead of calling the
function. taskiq then writes no result (the holder's stays), the retry middlewares leave it
alone, and the message is acknowledged as usual. A copy whose holder still runs, a
while_executing job whose key is busy, or a job whose scope is full is sent again later under
the same id (``resend``; if the holder died meanwhile, the copy takes over after the lease).
A copy of a finished job is dropped (G7).

The lock is finished in ``post_execute``, which runs after every middleware's ``on_error``: by
then a retry middleware has re-sent the job (seen by the producer side, which keeps the lock)
or not, whatever the order of the middlewares (G6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.exceptions import NoResultError
from taskiq.message import TaskiqMessage
from taskiq.result import TaskiqResult

from .. import delivery
from ..background import AsyncHeartbeat
from ..decide import Admission
from ..decide.envelope import Waits
from ..flow import Flow
from ..stores.base import Lease
from .options import (
    ATTEMPT_LABEL,
    FENCE_LABEL,
    KEY_LABEL,
    RETRIES_LABEL,
    RUN_KWARG,
    SCOPE_LABEL,
    SKIP_KWARG,
    label,
    set_label,
    task_limits,
)
from .resend import Resender
from .sends import queue_of
from .state import DedupState

log = logging.getLogger("taskdedup")
T = TypeVar("T")


_running: set[str] = set()  # sync deliveries whose thread is still in the task function
_running_mutex = threading.Lock()


def _still_running(ident: str) -> bool:
    with _running_mutex:
        return ident in _running


class Skipped(NoResultError):
    """taskiq's NoResultError for a delivery that must not run. Unlike taskiq's own it
    survives pickling, so a process pool can hand it back (an exception that does not
    unpickle breaks the whole pool)."""

    def __reduce__(self) -> tuple[type[Skipped], tuple[()]]:
        return (type(self), ())


class _SyncGuard:
    """The guard of a sync task function (a class, so a process pool can pickle it)."""

    __taskdedup_guard__ = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.pop(SKIP_KWARG, None) is not None:
            raise Skipped()
        ident = kwargs.pop(RUN_KWARG, None)
        if ident is None:
            return self.fn(*args, **kwargs)
        with _running_mutex:
            _running.add(ident)
        try:
            return self.fn(*args, **kwargs)
        finally:
            with _running_mutex:
                _running.discard(ident)


def guard(task: AsyncTaskiqDecoratedTask[Any, Any]) -> None:
    """Put the guard around the task's function, once (the receiver reads it per message)."""
    fn = task.original_func
    if getattr(fn, "__taskdedup_guard__", False):
        return
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            if kwargs.pop(SKIP_KWARG, None) is not None:
                raise Skipped()
            return await fn(*args, **kwargs)

        run.__taskdedup_guard__ = True  # type: ignore[attr-defined]
        task.original_func = run
    else:
        task.original_func = _SyncGuard(fn)


@dataclasses.dataclass(slots=True)
class Run:
    """One admitted delivery, from ``pre_execute`` to ``post_execute``."""

    delivery: delivery.Delivery
    admission: Admission
    retried: bool = False  # a retry of this attempt was sent: keep the lock
    error: BaseException | None = None  # what the task raised (before middlewares changed it)


class Worker:
    """Claim, heartbeat, retry and finish for the deliveries of one broker's worker (the rules
    are :mod:`taskdedup.delivery`'s; this maps them to taskiq: a guard, labels, a re-send)."""

    def __init__(self, middleware: DedupState) -> None:
        self.mw = middleware
        self.runs: dict[tuple[str, int], Run] = {}
        self.slots: dict[tuple[str, int], list[Any]] = {}  # [slot lease, retried]
        self._threads: set[asyncio.Task[None]] = set()  # waiting for a timed-out sync task
        self._heartbeat: AsyncHeartbeat | None = None
        self.resender = Resender(middleware)

    def heartbeat(self) -> AsyncHeartbeat:
        if self._heartbeat is None:
            self._heartbeat = AsyncHeartbeat(self.mw.dedup)
        return self._heartbeat

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        broker = self.mw.broker
        task = broker.find_task(message.task_name)
        if task is None:
            return message
        policy = self.mw.policies.for_message(task, message)
        attempt = int(label(message, RETRIES_LABEL) or 0)
        if policy is None and not label(message, SCOPE_LABEL):
            return message
        guard(task)
        limits = task_limits(task)
        d = delivery.Delivery(
            message.task_name,
            message.task_id,
            policy,
            attempt=attempt,
            scope=label(message, SCOPE_LABEL) or None,
            cap=limits.max_concurrent if limits is not None else None,
            key=label(message, KEY_LABEL) or None,
            args=message.args,
            kwargs=message.kwargs,
            queue=queue_of(broker, message),
            waits=Waits.read(lambda name: label(message, name)),
        )
        mw = self.mw
        flow = delivery.admit(mw.dedup, mw.reservations, d, mw.settings.default_lease)
        verdict = await self._drive(message, flow)
        admission = verdict.admission
        if verdict.action != "run":
            message.kwargs[SKIP_KWARG] = admission.outcome if admission else verdict.why
            if verdict.action == "resend":
                await self.resender.later(message, verdict.delay, verdict.waits)
            return message
        if admission is not None and admission.key is not None:
            set_label(message, KEY_LABEL, admission.key, parsed=True)
            set_label(message, FENCE_LABEL, admission.fence, parsed=True)
        if admission is not None and admission.outcome == "run":
            # the retry middlewares bump _retries in this very labels dict when they re-send
            set_label(message, ATTEMPT_LABEL, attempt, parsed=True)
            self.runs[(message.task_id, attempt)] = Run(d, admission)
            self._end_with_this_delivery((message.task_id, attempt))
            if admission.lease is not None:
                self.heartbeat().add(admission.lease)
        self._hold_slot(message, verdict.slot, attempt)
        _mark_sync_run(task, message, attempt)
        return message

    async def _drive(self, message: TaskiqMessage, flow: Flow[T]) -> T:
        async def hand_off(owed: delivery.HandOff) -> None:
            await self.resender.hand_off(message, owed.key, owed.handoff)

        return await self.mw.dedup.adrive(flow, hand_off)

    def _hold_slot(self, message: TaskiqMessage, held: Lease | None, attempt: int) -> None:
        """The delivery runs: renew its slot by heartbeat until it ends."""
        if held is None:
            return
        set_label(message, ATTEMPT_LABEL, attempt, parsed=True)
        self.slots[(message.task_id, attempt)] = [held, False]
        self._end_with_this_delivery((message.task_id, attempt))
        self.heartbeat().add(held)

    def _end_with_this_delivery(self, ident: tuple[str, int]) -> None:
        """If post_execute never runs for this delivery (another middleware raised first),
        stop renewing its leases when the receiver's task for it ends: the lock and the slot
        then lapse within one lease (G4), instead of living as long as the worker."""
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._abandon(ident))

    def _abandon(self, ident: tuple[str, int]) -> None:
        run = self.runs.pop(ident, None)
        if run is not None and run.admission.lease is not None:
            self.heartbeat().discard(run.admission.lease)
        slot = self.slots.pop(ident, None)
        if slot is not None:
            self.heartbeat().discard(slot[0])

    def on_error(self, message: TaskiqMessage, exception: BaseException) -> None:
        if SKIP_KWARG in message.kwargs:
            return
        run = self.runs.get((message.task_id, _attempt(message)))
        if run is not None:
            run.error = exception

    def retried(self, job_id: str, attempt: int) -> None:
        """The producer side saw a retry of ``job_id`` sent after ``attempt`` failed."""
        run = self.runs.get((job_id, attempt))
        if run is not None:
            run.retried = True
        slot = self.slots.get((job_id, attempt))
        if slot is not None:
            slot[1] = True

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        if message.kwargs.pop(SKIP_KWARG, None) is not None:
            message.kwargs.pop(RUN_KWARG, None)
            return
        message.kwargs.pop(RUN_KWARG, None)
        attempt = _attempt(message)
        run = self.runs.pop((message.task_id, attempt), None)
        slot = self.slots.pop((message.task_id, attempt), None)
        if _still_running(_ident(message.task_id, attempt)):
            # a sync task cut by taskiq's timeout runs on in its thread: keep its lock and slot
            # (the heartbeat renews them) until the thread is out of the function
            end = functools.partial(self._end, message, result, attempt, run, slot)
            later = asyncio.get_running_loop().create_task(
                self._after_thread(_ident(message.task_id, attempt), end)
            )
            self._threads.add(later)
            later.add_done_callback(self._threads.discard)
            return
        await self._end(message, result, attempt, run, slot)

    async def _after_thread(self, ident: str, end: Callable[[], Awaitable[None]]) -> None:
        while _still_running(ident):
            await asyncio.sleep(0.05)
        await end()

    async def _end(
        self,
        message: TaskiqMessage,
        result: TaskiqResult[Any],
        attempt: int,
        run: Run | None,
        slot: list[Any] | None,
    ) -> None:
        """The delivery is over: free or keep its slot, finish, keep or hand on its lock. A
        retry that was sent (or scheduled) keeps both."""
        held, slot_retried = slot if slot is not None else (None, False)
        if held is not None:
            self.heartbeat().discard(held)
        keep_lock = False
        if run is not None:
            if run.admission.lease is not None:
                self.heartbeat().discard(run.admission.lease)
            keep_lock = run.retried  # the retry's send moved the lock back to QUEUED
            key, policy = run.admission.key, run.delivery.policy
            if not keep_lock and key is not None and policy and _retry_scheduled(run, result):
                # a retry middleware swapped the error for NoResultError without a send we
                # saw (SmartRetryMiddleware with a schedule_source): keep the lock for it
                await self.mw.dedup.aretry(policy, key, message.task_id, attempt=attempt)
                keep_lock = True
        d = (
            run.delivery
            if run is not None
            else delivery.Delivery(message.task_name, message.task_id, None, attempt)
        )
        flow = delivery.end(
            self.mw.dedup,
            self.mw.reservations,
            d,
            run.admission if run is not None else None,
            held,
            keep_slot=slot_retried or isinstance(result.error, NoResultError),
            keep_lock=keep_lock,
        )
        await self._drive(message, flow)

    async def close(self) -> None:
        """Stop beating; send the copies waiting to be sent again now, so none is lost."""
        for thread in list(self._threads):  # its lock and slot lapse after their lease
            thread.cancel()
        await self.resender.close()
        if self._heartbeat is not None:
            await self._heartbeat.stop()
            self._heartbeat = None


def _ident(task_id: str, attempt: int) -> str:
    return f"{task_id}:{attempt}"


def _mark_sync_run(
    task: AsyncTaskiqDecoratedTask[Any, Any], message: TaskiqMessage, attempt: int
) -> None:
    """Name a sync delivery to its guard (after the claim: the name is not an argument)."""
    if isinstance(task.original_func, _SyncGuard):
        message.kwargs[RUN_KWARG] = _ident(message.task_id, attempt)


def _attempt(message: TaskiqMessage) -> int:
    """The attempt this delivery ran as (noted in pre_execute, as _retries may have moved)."""
    noted = label(message, ATTEMPT_LABEL)
    return int(noted if noted is not None else label(message, RETRIES_LABEL) or 0)


def _retry_scheduled(run: Run, result: TaskiqResult[Any]) -> bool:
    return (
        isinstance(result.error, NoResultError)
        and run.error is not None
        and not isinstance(run.error, NoResultError)
    )
