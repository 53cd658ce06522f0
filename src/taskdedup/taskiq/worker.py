"""The worker side: claim in ``pre_execute``, heartbeat while the task runs, finish afterwards.

A taskiq middleware cannot stop the receiver from calling the task, so each deduplicated task's
function gets a thin guard: a delivery that must not run carries a marker keyword argument, and
the guard raises taskiq's ``NoResultError`` (a kind that pickles) instead of calling the
function. taskiq then writes no result (the holder's stays), the retry middlewares leave it
alone, and the message is acknowledged as usual. A delivery that may not run now
(:func:`taskdedup.delivery.admit`) is sent again later under the same id (``resend``); a copy
of a finished job is dropped (G7).

The lock is finished in ``post_execute``, which runs after every middleware's ``on_error``: by
then a retry middleware has re-sent the job (seen by the producer side, which keeps the lock)
or not, whatever the order of the middlewares (G6).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
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
    START_LABEL,
    label,
    set_label,
    task_limits,
)
from .resend import Resender
from .sends import load_call, queue_of
from .state import DedupState

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
    """A delivery that holds its key or a slot, from ``pre_execute`` to ``post_execute``."""

    delivery: delivery.Delivery
    admission: Admission | None  # the claim, when it holds the key
    slot: Lease | None  # its scope's slot
    retried: bool = False  # a retry of this attempt was sent: keep the lock and the slot
    error: BaseException | None = None  # what the task raised (before middlewares changed it)

    @property
    def leases(self) -> list[Lease]:
        """What the heartbeat renews while the delivery runs: its lock, its slot."""
        held = (self.admission.lease if self.admission else None, self.slot)
        return [lease for lease in held if lease is not None]


class Worker:
    """Claim, heartbeat, retry and finish for the deliveries of one broker's worker (the rules
    are :mod:`taskdedup.delivery`'s; this maps them to taskiq: a guard, labels, a re-send)."""

    def __init__(self, middleware: DedupState) -> None:
        self.mw = middleware
        self.runs: dict[tuple[str, int], Run] = {}
        self._threads: set[asyncio.Task[None]] = set()  # waiting for a timed-out sync task
        self._heartbeat: AsyncHeartbeat | None = None
        self.resender = Resender(middleware)

    def heartbeat(self) -> AsyncHeartbeat:
        if self._heartbeat is None:
            self._heartbeat = AsyncHeartbeat(self.mw.dedup)
        return self._heartbeat

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        mw = self.mw
        task = mw.broker.find_task(message.task_name)
        if task is None:
            return message
        early = float(label(message, START_LABEL) or 0) - time.time()
        if early > 0:  # @pace: held back until its start, then sent again (as it is)
            guard(task)
            message.kwargs[SKIP_KWARG] = "resend"
            await self.resender.later(message, early)
            return message
        policy = mw.policies.for_message(task, message)
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
            queue=queue_of(mw.broker, message),
            waits=Waits.read(lambda name: label(message, name)),
        )
        flow = delivery.admit(mw.dedup, mw.reservations, d, mw.settings.default_lease)
        verdict = await self._drive(message, flow)
        admission = verdict.admission
        if verdict.action != "run":
            message.kwargs[SKIP_KWARG] = verdict.action
            if verdict.action == "resend":
                await self.resender.later(message, verdict.delay, verdict.waits)
            return message
        if admission is not None and admission.arguments is not None:  # debounce: the
            message.args, message.kwargs = load_call(mw.broker, admission.arguments)  # latest
        if admission is not None and admission.key is not None:
            set_label(message, KEY_LABEL, admission.key, parsed=True)
            set_label(message, FENCE_LABEL, admission.fence, parsed=True)
        run = Run(d, admission if admission and admission.lease else None, verdict.slot)
        if run.leases:
            # the retry middlewares bump _retries in this very labels dict when they re-send
            set_label(message, ATTEMPT_LABEL, attempt, parsed=True)
            self._hold((message.task_id, attempt), run)
        if isinstance(task.original_func, _SyncGuard):  # name a sync delivery to its guard
            message.kwargs[RUN_KWARG] = _ident(message.task_id, attempt)  # (after the claim)
        return message

    async def _drive(self, message: TaskiqMessage, flow: Flow[T]) -> T:
        async def hand_off(owed: delivery.HandOff) -> None:
            await self.resender.hand_off(message, owed)

        return await self.mw.dedup.adrive(flow, hand_off)

    def _hold(self, ident: tuple[str, int], run: Run) -> None:
        """Renew the run's lock and slot by heartbeat until it ends. If post_execute never runs
        for this delivery (another middleware raised first), stop when the receiver's task for
        it ends: the lock and the slot then lapse within one lease (G4), instead of living as
        long as the worker."""
        self.runs[ident] = run
        for lease in run.leases:
            self.heartbeat().add(lease)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._let_go(self.runs.pop(ident, None)))

    def _let_go(self, run: Run | None) -> None:
        for lease in run.leases if run is not None else ():
            self.heartbeat().discard(lease)

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

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        skipped = message.kwargs.pop(SKIP_KWARG, None) is not None
        message.kwargs.pop(RUN_KWARG, None)
        attempt = _attempt(message)  # (a skipped copy's run, if any, is another delivery's)
        run = None if skipped else self.runs.pop((message.task_id, attempt), None)
        if run is None:
            return  # it holds nothing
        if not _still_running(_ident(message.task_id, attempt)):
            await self._end(message, result, attempt, run)
            return
        # a sync task cut by taskiq's timeout runs on in its thread: keep its lock and slot
        # (the heartbeat renews them) until the thread is out of the function
        later = asyncio.get_running_loop().create_task(self._end(message, result, attempt, run))
        self._threads.add(later)
        later.add_done_callback(self._threads.discard)

    async def _end(
        self, message: TaskiqMessage, result: TaskiqResult[Any], attempt: int, run: Run
    ) -> None:
        """The delivery is over (a sync one once its thread is out of the function): free or
        keep its slot, finish, keep or hand on its lock. A retry that was sent (or scheduled)
        keeps both."""
        while _still_running(_ident(message.task_id, attempt)):
            await asyncio.sleep(0.05)
        self._let_go(run)
        keep_lock = run.retried  # the retry's send moved the lock back to QUEUED
        key = run.admission.key if run.admission is not None else None
        policy = run.delivery.policy
        if not keep_lock and key is not None and policy and _retry_scheduled(run, result):
            # a retry middleware swapped the error for NoResultError without a send we
            # saw (SmartRetryMiddleware with a schedule_source): keep the lock for it
            await self.mw.dedup.aretry(policy, key, message.task_id, attempt=attempt)
            keep_lock = True
        flow = delivery.end(
            self.mw.dedup,
            self.mw.reservations,
            run.delivery,
            run.admission,
            run.slot,
            keep_slot=run.retried or isinstance(result.error, NoResultError),
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
