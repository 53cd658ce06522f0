"""Celery beat: each publish beat makes is a scheduler's tick, named by its schedule entry.

Beat publishes a due entry on every tick whatever became of the last run. The publisher marks
each of its calls as a tick of its entry (``Call.scheduled``), and the core decides the rest
once for Celery and taskiq alike (:mod:`taskdedup.ticks`): a tick whose key a run still holds
is skipped with any ``on_conflict`` (never DuplicateJob, so beat logs no error), said at INFO
once per entry while it stays skipped, and counted in ``stats["beat.skipped"]``.
``celery.beat.Scheduler.apply_async`` is wrapped once per process, which covers the
schedulers built on it (django-celery-beat's among them).
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

_ENTRY: contextvars.ContextVar[str | None] = contextvars.ContextVar("taskdedup_beat", default=None)
_hooked = threading.Lock()


def scheduled_entry() -> str | None:
    """The schedule entry whose tick beat is publishing in this context, if any."""
    return _ENTRY.get()


def hook_scheduler() -> None:
    """Wrap ``celery.beat.Scheduler.apply_async`` (once per process)."""
    from celery.beat import Scheduler

    with _hooked:
        if getattr(Scheduler, "_taskdedup_hooked", False):
            return
        original = Scheduler.apply_async

        def apply_async(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
            token = _ENTRY.set(str(entry.name))
            try:
                return original(self, entry, *args, **kwargs)
            finally:
                _ENTRY.reset(token)

        Scheduler.apply_async = apply_async
        Scheduler._taskdedup_hooked = True
