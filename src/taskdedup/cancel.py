"""Cooperative cancel-in-progress: how a running job learns that a newer submission
superseded it (``on_conflict="supersede", running="cancel"``).

The store marks the running job's lock when such a submission arrives; the lease renewals the
worker sends anyway (every lease/3) bring the mark back, and the heartbeat notes it here
(:func:`ask_to_stop`). The job reads it at its own checkpoints: :func:`superseded` or
:func:`raise_if_superseded`. Nothing is killed: a job that never looks simply runs to its end,
and the newer run follows. Which job runs in the current context is said by the heartbeat too:
a worker adds a job's lease in the context that runs it (a Celery pool thread or process, a
taskiq task's asyncio task), before its body starts."""

from __future__ import annotations

import contextvars
import threading

from .errors import Superseded

_asked: set[tuple[str, str]] = set()  # (key, job id) of the runs here asked to stop
_mutex = threading.Lock()
_current: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "taskdedup_running", default=None
)


def running(key: str, job_id: str) -> None:
    """``job_id`` (of ``key``) starts running in this context."""
    _current.set((key, job_id))


def ended(key: str, job_id: str) -> None:
    """``job_id`` ended: its stop request, if any, is forgotten (a later job in this context
    says it runs before its body starts). Every job's end passes here: without a request
    pending in this process (nearly always) it takes no lock."""
    if not _asked:
        return
    with _mutex:
        _asked.discard((key, job_id))


def ask_to_stop(key: str, job_id: str) -> None:
    """A renewal found ``job_id``'s lock marked: a newer submission superseded it."""
    with _mutex:
        _asked.add((key, job_id))


def superseded() -> bool:
    """Whether a newer submission asked the job running in this context to stop (False
    outside a job, and for a policy without ``running="cancel"``)."""
    run = _current.get()
    if run is None:
        return False
    with _mutex:
        return run in _asked


def raise_if_superseded() -> None:
    """Raise :class:`~taskdedup.errors.Superseded` at a checkpoint of a superseded job."""
    run = _current.get()
    if superseded():
        raise Superseded(run[1] if run else None)
