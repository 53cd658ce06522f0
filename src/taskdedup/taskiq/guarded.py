"""Sending with an idempotency key or under a reservation cap (taskiq's ``pre_send`` side).

What a send takes before its kick, and gives back if the kick fails, is decided in
:mod:`taskdedup.submission`; this maps it to taskiq labels and the producer's decision.
"""

from __future__ import annotations

from typing import Any, Protocol

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.message import TaskiqMessage

from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from ..submission import Call, Taken, take
from ..submission import give_back as submission_give_back
from .options import (
    IDEMPOTENCY_KEY_LABEL,
    IDEMPOTENCY_TTL_LABEL,
    KEY_LABEL,
    SCOPE_LABEL,
    call_shape,
    label,
    set_label,
    task_function,
)
from .sends import Decision, dump_call, queue_of, remember
from .state import DedupState


class Producer(Protocol):
    """What a guarded send needs of the producer: the shared state and the keys seen held
    lately."""

    mw: DedupState
    recent: RecentKeys


async def guarded_pre_send(
    producer: Producer,
    task: AsyncTaskiqDecoratedTask[Any, Any],
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    message: TaskiqMessage,
) -> None:
    """Decide one send through its idempotency key, dedup policy and reservation cap; the
    decision waits in the producer's context variable for the kick."""
    mw = producer.mw
    decision = Decision(message, message.task_id, message.task_id)
    remember(decision)
    payload = None
    if policy is not None and policy.policy.on_conflict == "reschedule_once":
        payload = dump_call(mw.broker, message.args, message.kwargs)
    ttl = label(message, IDEMPOTENCY_TTL_LABEL)
    call = Call(
        message.task_name,
        call_shape(task_function(task)),
        message.args,
        message.kwargs,
        message.task_id,
        policy,
        limits,
        idempotency_key=label(message, IDEMPOTENCY_KEY_LABEL),
        idempotency_ttl=None if ttl is None else float(ttl),
        delay=float(label(message, "delay") or 0.0),
        queue=queue_of(mw.broker, message),
        payload=payload,
        scheduled="schedule_id" in message.labels,
    )
    taken = await mw.dedup.adrive(
        take(mw.dedup, mw.idempotency, mw.reservations, producer.recent, call)
    )
    if taken.key is not None:
        set_label(message, KEY_LABEL, taken.key, parsed=False)
    if taken.answer != "publish":  # the caller gets the existing job
        message.task_id = decision.job_id = taken.job_id
        decision.deduplicated = True
        decision.hit = taken.answer == "hit"
        remember(decision)
        return
    decision.ticket, decision.recall, decision.scope = taken.ticket, taken.recall, taken.scope
    if taken.scope is not None:
        set_label(message, SCOPE_LABEL, taken.scope, parsed=False)


async def give_back(producer: Producer, decision: Decision) -> None:
    """Nothing was sent: release the lock, free the idempotency key and the slot."""
    mw = producer.mw
    taken = Taken(
        "publish",
        decision.sent_id,
        ticket=decision.ticket,
        recall=decision.recall,
        scope=decision.scope,
    )
    await mw.dedup.adrive(submission_give_back(mw.dedup, mw.idempotency, mw.reservations, taken))
