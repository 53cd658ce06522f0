"""Celery beat: each publish is a tick of its schedule entry (:mod:`taskdedup.ticks` decides).

The slot: an interval entry's grid point nearest to now (and such an entry, when it is sent
once per tick, keeps to that grid: its ``last_run_at`` is the grid point it ran for, and beat
looks again at the next one, so beats started apart tick together and beat's own delays do not
add up); a ``crontab``, ``solar`` or ``clocked`` entry's due time, from its ``last_run_at``. An
entry's ``options={"overlap": ...}`` is its own overlap. ``celery.beat.Scheduler``'s
``apply_async``, ``is_due`` and ``reserve`` are wrapped once per process (django-celery-beat's
schedulers are built on it).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from ..ticks import Tick, due_tick, grid_point, interval_tick, once_per_tick, sending, wrap_once

#: The publish option a beat entry may name its overlap with (never sent).
OVERLAP_OPTION = "overlap"


def _period(entry: Any) -> float | None:
    """An interval entry's period in seconds (None: any other schedule, or a relative one)."""
    from celery.schedules import schedule

    sched = entry.schedule
    if type(sched) is schedule and not sched.relative and sched.run_every.total_seconds() > 0:
        return float(sched.run_every.total_seconds())
    return None


def _on_grid(scheduler: Any, entry: Any) -> float | None:
    """The period of an interval entry that is sent once per tick (it keeps to the grid)."""
    from .state import integration_for
    from .tasks import task_policy

    period, integ = _period(entry), integration_for(scheduler.app)
    task = scheduler.app.tasks.get(entry.task)
    if period is None or integ is None or task is None:
        return None
    policy = task_policy(task, integ.settings)
    return period if once_per_tick(integ.settings, Tick(entry.name), policy, task.name) else None


def tick_of(entry: Any) -> Tick:
    """The tick beat publishes ``entry`` for (``entry`` as it was before this tick)."""
    name, overlap, period = (
        str(entry.name),
        (entry.options or {}).get(OVERLAP_OPTION),
        _period(entry),
    )
    if period is not None:
        return interval_tick(name, period, overlap)
    try:
        due = entry.schedule.now() + entry.schedule.remaining_estimate(entry.last_run_at)
        due = due if due.tzinfo is not None else due.replace(tzinfo=timezone.utc)
        return due_tick(name, due.timestamp(), overlap)
    except Exception:  # a schedule that cannot say when it was due: the overlap still applies
        return Tick(name, overlap=overlap)


def hook_scheduler() -> None:
    """Wrap ``celery.beat.Scheduler`` (once per process)."""
    from celery.beat import Scheduler

    def apply_async(original: Any) -> Any:
        def wrapped(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
            with sending(tick_of(entry)):
                return original(self, entry, *args, **kwargs)

        return wrapped

    def is_due(original: Any) -> Any:
        def wrapped(self: Any, entry: Any) -> Any:
            due, next_check = original(self, entry)
            period = _on_grid(self, entry) if due else None
            if period is not None:  # look again at the next grid point, not a period later
                next_check = max(grid_point(period) + period - time.time(), 0.001)
            return due, next_check

        return wrapped

    def reserve(original: Any) -> Any:
        def wrapped(self: Any, entry: Any) -> Any:
            new_entry, period = original(self, entry), _on_grid(self, entry)
            if period is not None:  # it ran for the grid point nearest now
                new_entry.last_run_at = datetime.fromtimestamp(grid_point(period), timezone.utc)
            return new_entry

        return wrapped

    for method, wrap in (("apply_async", apply_async), ("is_due", is_due), ("reserve", reserve)):
        wrap_once(Scheduler, method, wrap)
