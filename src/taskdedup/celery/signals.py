"""Celery signals for taskdedup's decisions, so users can wire their own alerts.

from taskdedup.celery import signals

@signals.task_deduplicated.connect
def dropped(sender, job_id, holder, key, event, **_):
    log.info("%s: a duplicate was answered with job %s", sender, holder)

Each signal's ``sender`` is the task's name; every one is sent with ``event`` (the
:class:`~taskdedup.events.Decision`), ``job_id``, ``holder`` and ``key``. They are sent in the
process that decided (the producer for ``task_deduplicated``, the worker for the rest), where
the decision was made: a receiver must be quick, and one that raises is logged, not passed on.
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

from ..events import Decision

_ARGS = {"event", "job_id", "holder", "key"}

#: A submission was answered with the job that holds its key (nothing was published).
task_deduplicated = Signal(name="taskdedup.task_deduplicated", providing_args=_ARGS)
#: A retry within the idempotency ttl was answered with the job of its idempotency key.
idempotent_hit = Signal(name="taskdedup.idempotent_hit", providing_args=_ARGS)
#: A delivered copy was dropped: its job finished, ran out of attempts, or moved on (G7, G12).
copy_skipped = Signal(name="taskdedup.copy_skipped", providing_args=_ARGS)
#: A delivered copy was sent back to wait: its job, or its key's holder, runs (G7, G12).
copy_deferred = Signal(name="taskdedup.copy_deferred", providing_args=_ARGS)
#: A copy runs in place of an earlier run of its attempt that ended without a word (its
#: worker died; its lease lapsed): the job is being recovered after a crash.
job_recovered = Signal(name="taskdedup.job_recovered", providing_args=_ARGS)
#: The run owed by reschedule_once was sent as job ``fields["next"]`` after job ``job_id``.
task_rescheduled = Signal(name="taskdedup.task_rescheduled", providing_args=_ARGS)
#: A job's end (or a failed publish, a revoke) freed its key.
lock_released = Signal(name="taskdedup.lock_released", providing_args=_ARGS)
#: A running job found its lock or slot gone (its lease lapsed): it may now run beside another.
lease_lost = Signal(name="taskdedup.lease_lost", providing_args=_ARGS)
#: A submission was refused because its scope's slots were all taken (QuotaExceeded).
quota_rejected = Signal(name="taskdedup.quota_rejected", providing_args=_ARGS)
#: A decision the store could not answer (it followed on_store_error, or put the job back).
store_unavailable = Signal(name="taskdedup.store_unavailable", providing_args=_ARGS)
#: Every decision, those above included.
decision_made = Signal(name="taskdedup.decision_made", providing_args=_ARGS)

BY_KIND: dict[str, Signal] = {
    "deduplicated": task_deduplicated,
    "idempotent_hit": idempotent_hit,
    "copy_skipped": copy_skipped,
    "copy_deferred": copy_deferred,
    "recovered": job_recovered,
    "rescheduled": task_rescheduled,
    "lock_released": lock_released,
    "lease_lost": lease_lost,
    "quota_rejected": quota_rejected,
    "store_unavailable": store_unavailable,
}


def send(event: Decision) -> None:
    """Send ``event`` as ``decision_made`` and as its kind's signal (a Runner listener)."""
    named = BY_KIND.get(event.kind or "")
    for signal in (decision_made, named):
        if signal is not None and signal.receivers:
            _send(signal, event)


def _send(signal: Signal, event: Decision) -> Any:
    return signal.send(
        sender=event.task, event=event, job_id=event.job_id, holder=event.holder, key=event.key
    )
