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
from ..policy import TaskPolicy
from ..stores.base import Lease
from ..submission import give_back, published, take_owed
from .messages import (
    KEY_HEADER,
    RESEND_OPTION,
    SCOPE_HEADER,
    load_call,
)
from .state import CeleryDedup
from .tasks import task_function, task_limits, task_policy

log = logging.getLogger("taskdedup")
#: How long a delivery the broker will not take back (it is down too) waits in the worker for
#: its claim before it fails visibly.
STAY_AT_MOST = 600.0
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
                self._free_lock(task, d.policy, args, kwargs)
                raise
            raise Ignore()
        slot = started
        admission = self._claim(task, d, slot)
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
        never lost (G14); after STAY_AT_MOST seconds (read at each call) it gives up:
        see :meth:`_give_up`."""
        request = task.request
        give_up = time.monotonic() + STAY_AT_MOST
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
                    admission.outcome,
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
        """The broker would not take this delivery back for STAY_AT_MOST seconds. If the store
        never answered, the job fails visibly, its lock freed first (G5). If another run holds
        the key (busy) or this very job runs elsewhere (a copy of it), nothing here is ours to
        free, the other run's key untouched: an acks_late delivery goes back to the broker
        (Reject with requeue). A copy of a running job acknowledged already is rejected too:
        the job runs (it renewed its lease all the while), and a failure would be written
        under its id while it runs. A busy job acknowledged already fails visibly."""
        if admission.outcome == "store_unavailable":
            self._free_lock(task, d.policy, d.args, d.kwargs)
            raise exc
        acks_late = bool(getattr(task, "acks_late", False))
        if acks_late or admission.outcome == "running":
            log.warning(
                "taskdedup: could not send %s[%s] back to the broker for %gs (%s): it is "
                "rejected, %s; the run holding its key is left alone",
                task.name,
                task.request.id,
                STAY_AT_MOST,
                admission.outcome,
                "requeued" if acks_late else "acknowledged already (the job runs elsewhere)",
            )
            raise Reject(exc, requeue=True) from exc
        raise exc

    def _free_lock(self, task: Any, policy: TaskPolicy | None, args: Any, kwargs: Any) -> None:
        """Release the enqueue lock this (unclaimed) job holds, if any."""
        if policy is None:
            return
        request = task.request
        queue = (request.delivery_info or {}).get("routing_key")
        key = header(request, KEY_HEADER) or policy.key_for(args, kwargs, queue)
        with contextlib.suppress(StoreUnavailable):  # else it lapses after its ttl
            self.integ.dedup.publish_failed(Ticket("acquired", request.id, key))

    def _end(
        self, task: Any, d: delivery.Delivery, admission: Admission | None, slot: Lease | None
    ) -> None:
        """The job ended for good: free its slot, then release, keep or hand on its lock."""
        integ = self.integ  # (a finish's reply is read when the next job starts: late)
        flow = delivery.end(integ.dedup, integ.reservations, d, admission, slot)
        self._drive(task, flow, late=True)

    def _publish_handoff(self, task: Any, key: str | None, handoff: Any) -> None:
        """Publish the one rescheduled run (reschedule_once) under the id the lock holds. A
        failure to publish it frees its lock and slot and is logged; the run in hand goes on."""
        if key is None:
            return
        if handoff.payload is not None:
            args, kwargs = load_call(handoff.payload)
        else:
            args, kwargs = task.request.args or (), task.request.kwargs or {}
        integ, job_id = self.integ, handoff.job_id
        fn, limits = task_function(task), task_limits(task)
        owed = take_owed(integ.reservations, task.name, fn, limits, key, job_id, args, kwargs)
        taken = integ.dedup.drive(owed)
        headers = {KEY_HEADER: key}
        if taken.scope is not None:
            headers[SCOPE_HEADER] = taken.scope
        try:
            task.apply_async(args, kwargs, task_id=job_id, headers=headers, **RESEND)
        except Exception:
            integ.dedup.drive(give_back(integ.dedup, integ.idempotency, integ.reservations, taken))
            log.exception(
                "taskdedup: could not publish the rescheduled run %s[%s] (reschedule_once)",
                task.name,
                job_id,
            )
            return
        published(integ.dedup, integ.idempotency, taken)


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


def header(request: Any, name: str) -> Any:
    """A taskdedup header of the running job (Celery puts custom headers on the request)."""
    return getattr(request, name, None) or (getattr(request, "headers", None) or {}).get(name)
