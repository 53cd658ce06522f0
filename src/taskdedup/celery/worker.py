"""The worker side: claim before the body runs, heartbeat while it runs, then finish.

Each deduplicated task's ``run`` is wrapped (Celery's tracer calls ``task.run``), so the claim
happens inside the worker's request context, with ``self.request`` set. A delivery that must not
run raises ``Ignore``, so no result is written over the real job's: a copy of a finished job is
dropped (G7); a copy whose holder still runs, or a while_executing job whose key is busy, is
sent again with a delay under the same id, so nothing is lost and the caller's handle stays
true (if the holder died meanwhile, the copy takes over once the lease has lapsed).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, NoReturn, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from .. import delivery
from ..decide import Admission, Ticket
from ..decide.envelope import Waits
from ..errors import StoreUnavailable
from ..flow import Flow
from ..stores.base import Lease
from ..submission import Call, SendOwed, publish_owed
from .messages import (
    KEY_HEADER,
    RESEND_OPTION,
    SCOPE_HEADER,
    header,
    load_call,
)
from .state import CeleryDedup
from .tasks import task_function, task_limits, task_policy

log = logging.getLogger("taskdedup")
RESEND = {RESEND_OPTION: True}  # publish options of the worker's own publishes
T = TypeVar("T")


def wrap_task(worker: Worker, task: Any) -> None:
    """Wrap ``task.run`` once; tasks without a policy or a cap are left untouched."""
    if getattr(task, "_taskdedup_run", None) is not None:
        return
    if task_policy(task, worker.integ.settings) is None and task_limits(task) is None:
        return
    original = task.run

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        return worker.run(task, original, args, kwargs)

    task._taskdedup_run = original
    task.run = run


class Worker:
    """Runs one delivery of a deduplicated task through claim, heartbeat and finish (the rules
    are :mod:`taskdedup.delivery`'s; this maps them to Celery: Ignore, a re-send, Reject)."""

    def __init__(self, integ: CeleryDedup) -> None:
        self.integ = integ

    def run(self, task: Any, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = task.request
        if request.id is None or request.called_directly:
            return original(*args, **kwargs)
        if request.is_eager and self.integ.settings.eager == "bypass":
            return original(*args, **kwargs)
        self.integ.dedup.late.read()  # the last job's finish: its reply is here by now
        d = self._delivery(task, args, kwargs)
        integ = self.integ
        started = None
        if d.scope:  # (no flow to drive for the many jobs without a scope)
            default = integ.settings.default_lease
            started = self._drive(task, delivery.start_slot(integ.reservations, d, default))
        if isinstance(started, delivery.Verdict):  # first: a full scope defers the job
            try:
                resend(task, args, kwargs, started.delay, started.waits)
            except Exception:  # the job fails here: free its lock first (G5)
                self._free_lock(d)
                raise
            raise Ignore()
        slot = started
        admission = self._claim(task, d, slot)
        if admission is not None and admission.arguments is not None:
            args, kwargs = load_call(admission.arguments)  # debounce: the burst's latest
        heartbeat = integ.heartbeat()
        leases = [admission.lease] if admission is not None and admission.lease else []
        if slot is not None:
            leases.append(slot)
        for lease in leases:
            heartbeat.add(lease)
        try:
            result = original(*args, **kwargs)
        except (Retry, Ignore):
            raise  # a retry moved the lock to QUEUED (and kept the slot) when it was published
        except Reject as exc:
            if not exc.requeue:
                self._end(task, d, admission, slot)
            raise
        except BaseException:  # a final failure: autoretry_for turns retryable ones into Retry
            self._end(task, d, admission, slot)
            raise
        finally:
            for lease in leases:
                heartbeat.discard(lease)
        self._end(task, d, admission, slot)
        return result

    def _delivery(self, task: Any, args: Any, kwargs: Any) -> delivery.Delivery:
        request = task.request
        scope = header(request, SCOPE_HEADER) or None
        limits = task_limits(task) if scope else None
        return delivery.Delivery(
            task.name,
            request.id,
            task_policy(task, self.integ.settings),
            attempt=request.retries or 0,
            scope=scope,
            cap=limits.max_concurrent if limits is not None else None,
            key=header(request, KEY_HEADER) or None,
            args=args,
            kwargs=kwargs,
            queue=(request.delivery_info or {}).get("routing_key"),
            waits=Waits.read(lambda name: header(request, name)),
        )

    def _drive(self, task: Any, flow: Flow[T], late: bool = False) -> T:
        def hand_off(owed: delivery.HandOff) -> None:
            self._publish_handoff(task, owed.key, owed.handoff)

        return self.integ.dedup.drive(flow, hand_off, late=late)

    def _claim(self, task: Any, d: delivery.Delivery, slot: Lease | None) -> Admission | None:
        """Claim the job, or raise Ignore when this delivery must not run now: it is dropped
        (a copy of a finished job) or sent again later (busy, its holder running, the store
        down). A delivery the broker will not take back waits here and asks again, so it is
        never lost (G14); after delivery.STAY_AT_MOST seconds (read at each call) it gives up:
        see :meth:`_give_up`."""
        request = task.request
        give_up = time.monotonic() + delivery.STAY_AT_MOST
        while True:
            verdict = self._drive(
                task, delivery.claim(self.integ.dedup, self.integ.reservations, d, slot)
            )
            admission = verdict.admission
            if verdict.action == "run":
                if admission is not None:
                    request.taskdedup_key = admission.key
                    request.taskdedup_fence = admission.fence
                return admission
            if verdict.action == "drop" or admission is None:
                raise Ignore()
            try:
                resend(task, d.args, d.kwargs, verdict.delay, verdict.waits)
            except Exception as exc:
                if time.monotonic() + verdict.delay > give_up:
                    self._give_up(task, d, admission, exc)
                log.warning(
                    "taskdedup: could not send %s[%s] back to the broker (%s): %s; it waits "
                    "here and asks again in %gs",
                    task.name,
                    request.id,
                    verdict.reason,
                    exc,
                    verdict.delay,
                )
                time.sleep(verdict.delay)
                d.key, d.waits = admission.key, verdict.waits
                continue
            raise Ignore()

    def _give_up(
        self, task: Any, d: delivery.Delivery, admission: Admission, exc: Exception
    ) -> NoReturn:
        """The broker would not take this delivery back for delivery.STAY_AT_MOST seconds:
        fail (its lock freed first, when the store never answered), or go back to the broker
        (Reject with requeue), as :func:`taskdedup.delivery.when_resend_refused` says."""
        acks_late = bool(getattr(task, "acks_late", False))
        then = delivery.when_resend_refused(admission, acks_late)
        if then == "fail_and_free":
            self._free_lock(d)
            raise exc
        if then == "requeue":
            log.warning(
                "taskdedup: could not send %s[%s] back to the broker for %gs: it is "
                "rejected, %s; the run holding its key is left alone",
                task.name,
                task.request.id,
                delivery.STAY_AT_MOST,
                "requeued" if acks_late else "acknowledged already (the job runs elsewhere)",
            )
            raise Reject(exc, requeue=True) from exc
        raise exc

    def _free_lock(self, d: delivery.Delivery) -> None:
        """Release the enqueue lock this (unclaimed) job holds, if any."""
        with contextlib.suppress(StoreUnavailable):  # else it lapses after its ttl
            key = d.lock_key()
            if key is not None:
                self.integ.dedup.publish_failed(Ticket("acquired", d.job_id, key))

    def _end(
        self, task: Any, d: delivery.Delivery, admission: Admission | None, slot: Lease | None
    ) -> None:
        """The job ended for good: free its slot, then release, keep or hand on its lock."""
        integ = self.integ  # (a finish's reply is read when the next job starts: late)
        flow = delivery.end(integ.dedup, integ.reservations, d, admission, slot)
        self._drive(task, flow, late=True)

    def _publish_handoff(self, task: Any, key: str, handoff: Any) -> None:
        """Publish the one rescheduled run (reschedule_once) under the id the lock holds (the
        steps: :func:`taskdedup.submission.publish_owed`)."""
        integ, request = self.integ, task.request
        owed = Call(
            task.name,
            task_function(task),
            request.args or (),
            request.kwargs or {},
            handoff.job_id,
            None,
            task_limits(task),
            key=key,
        )

        def send(request: SendOwed) -> None:
            headers = {KEY_HEADER: request.key}
            if request.scope is not None:
                headers[SCOPE_HEADER] = request.scope
            task.apply_async(
                request.args, request.kwargs, task_id=request.job_id, headers=headers, **RESEND
            )

        flow = publish_owed(
            integ.dedup, integ.idempotency, integ.reservations, owed, handoff.payload, load_call
        )
        integ.dedup.drive(flow, send)


def resend(task: Any, args: Any, kwargs: Any, delay: float, waits: Waits | None = None) -> None:
    """The running delivery again, ``delay`` seconds from now: same id, queue, callbacks,
    chain and headers. It goes out as it is (no dedup, no cap): the worker settled its lock."""
    request = task.request
    headers = dict(request.as_execution_options().get("headers") or {})  # x-death filtered out
    for name in (KEY_HEADER, SCOPE_HEADER):
        value = header(request, name)
        if value:
            headers[name] = value
    (waits or Waits()).write(headers)
    later = task.signature_from_request(request, args, kwargs, countdown=delay, headers=headers)
    later.apply_async(**RESEND)
