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

#: The signal of each kind of decision (see :data:`taskdedup.events.KINDS`).
BY_KIND: dict[str, Signal] = {}


def _of_kind(kind: str, name: str) -> Signal:
    BY_KIND[kind] = signal = Signal(name=f"taskdedup.{name}", providing_args=_ARGS)
    return signal


#: A submission was answered with the job that holds its key (nothing was published).
task_deduplicated = _of_kind("deduplicated", "task_deduplicated")
#: A submission was folded into its burst's one run (``debounce``): ``holder`` is the burst's
#: job. Sent before ``task_deduplicated``, which it is too (as are the next two).
task_debounced = _of_kind("debounced", "task_debounced")
#: A submission's arguments replaced those of its key's job still in the queue (``supersede``).
task_superseded = _of_kind("superseded", "task_superseded")
#: A submission asked its key's running job to stop (``running="cancel"``); its run follows.
cancel_requested = _of_kind("cancel_requested", "cancel_requested")
#: A retry within the idempotency ttl was answered with the job of its idempotency key.
idempotent_hit = _of_kind("idempotent_hit", "idempotent_hit")
#: A delivered copy was dropped: its job finished, ran out of attempts, or moved on (G7, G12).
copy_skipped = _of_kind("copy_skipped", "copy_skipped")
#: A delivered copy was sent back to wait: its job, or its key's holder, runs (G7, G12).
copy_deferred = _of_kind("copy_deferred", "copy_deferred")
#: A copy runs in place of an earlier run of its attempt that ended without a word (its
#: worker died; its lease lapsed): the job is being recovered after a crash.
job_recovered = _of_kind("recovered", "job_recovered")
#: The run owed by reschedule_once was sent as job ``fields["next"]`` after job ``job_id``.
task_rescheduled = _of_kind("rescheduled", "task_rescheduled")
#: A job's end (or a failed publish, a revoke) freed its key.
lock_released = _of_kind("lock_released", "lock_released")
#: A running job found its lock or slot gone (its lease lapsed): it may now run beside another.
lease_lost = _of_kind("lease_lost", "lease_lost")
#: A submission was refused because its scope's slots were all taken (QuotaExceeded).
quota_rejected = _of_kind("quota_rejected", "quota_rejected")
#: A decision the store could not answer (it followed on_store_error, or put the job back).
store_unavailable = _of_kind("store_unavailable", "store_unavailable")
#: Every decision, those above included.
decision_made = Signal(name="taskdedup.decision_made", providing_args=_ARGS)


def send(event: Decision) -> None:
    """Send ``event`` as ``decision_made`` and as its kind's signal (a Runner listener)."""
    named = [BY_KIND[kind] for kind in event.kinds if kind in BY_KIND]
    for signal in (decision_made, *named):
        if signal.receivers:
            _send(signal, event)


def _send(signal: Signal, event: Decision) -> Any:
    return signal.send(
        sender=event.task, event=event, job_id=event.job_id, holder=event.holder, key=event.key
    )
