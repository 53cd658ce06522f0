"""Celery beat: each publish beat makes is a tick of its schedule entry, with the tick's slot.

Beat publishes a due entry on every tick whatever became of the last run, and two beats (or
one restarted mid-tick) publish it twice. The publisher marks each of its calls as a
:class:`~taskdedup.ticks.Tick` of its entry, and the core decides the rest once for Celery and
taskiq alike (:mod:`taskdedup.ticks`): one publish per slot, and the overlap of a tick whose
key a run still holds.

The slot is the tick's scheduled time, the same in every beat:

- an interval entry (``schedule``, ``timedelta``, a number of seconds): the grid point of its
  period nearest to now. So that beats started at different times tick together, an entry
  sent once per tick runs on that grid: its ``last_run_at`` is set to the grid point it was
  sent for, and beat is told to look again at the next one (without it beat's own delay
  between ticks adds up, and a tick would now and then fall to the next grid point);
- any other schedule (``crontab``, ``solar``, django-celery-beat's ``clocked``): the time it
  was due, from its ``last_run_at`` (so a late beat's publish of a tick another beat already
  sent is a duplicate, and a beat that was down publishes the tick it missed once, as Celery
  does).

``celery.beat.Scheduler``'s ``apply_async``, ``is_due`` and ``reserve`` are wrapped once per
process, which covers the schedulers built on it (django-celery-beat's among them).
"""

from __future__ import annotations

import contextvars
import threading
import time
from datetime import datetime, timezone
from typing import Any

from ..ticks import Tick, interval_slot, once_per_tick, slot_ms

_TICK: contextvars.ContextVar[Tick | None] = contextvars.ContextVar("taskdedup_beat", default=None)
_hooked = threading.Lock()
#: The publish option a beat entry may name its overlap with (``options={"overlap": ...}``).
OVERLAP_OPTION = "overlap"


def scheduled_tick() -> Tick | None:
    """The tick of the schedule entry beat is publishing in this context, if any."""
    return _TICK.get()


def _period(entry: Any) -> float | None:
    """An interval entry's period in seconds (None: any other schedule, or a relative one)."""
    from celery.schedules import schedule

    sched = entry.schedule
    if type(sched) is schedule and not sched.relative:
        return float(sched.run_every.total_seconds())
    return None


def _on_grid(scheduler: Any, entry: Any) -> float | None:
    """The period of an interval entry sent once per tick (its runs keep to the grid)."""
    period = _period(entry)
    if period is None or period <= 0:
        return None
    from .state import integration_for
    from .tasks import task_policy

    integ = integration_for(scheduler.app)
    task = scheduler.app.tasks.get(entry.task)
    if integ is None or task is None:
        return None
    if not once_per_tick(integ.settings, task_policy(task, integ.settings) is not None):
        return None
    return period


def tick_of(entry: Any) -> Tick:
    """The tick beat is publishing ``entry`` for (``entry`` as it was before this tick)."""
    overlap = (entry.options or {}).get(OVERLAP_OPTION)
    period = _period(entry)
    if period is not None and period > 0:
        return Tick(str(entry.name), interval_slot(time.time(), period), period, overlap)
    try:
        sched = entry.schedule
        due = sched.now() + sched.remaining_estimate(entry.last_run_at)
        return Tick(str(entry.name), slot_ms(_aware(due).timestamp()), None, overlap)
    except Exception:  # a schedule that cannot say when it was due: the overlap still applies
        return Tick(str(entry.name), None, None, overlap)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def hook_scheduler() -> None:
    """Wrap ``celery.beat.Scheduler`` (once per process)."""
    from celery.beat import Scheduler

    with _hooked:
        if getattr(Scheduler, "_taskdedup_hooked", False):
            return
        original_apply, original_due = Scheduler.apply_async, Scheduler.is_due
        original_reserve = Scheduler.reserve

        def apply_async(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
            token = _TICK.set(tick_of(entry))
            try:
                return original_apply(self, entry, *args, **kwargs)
            finally:
                _TICK.reset(token)

        def is_due(self: Any, entry: Any) -> Any:
            due, next_check = original_due(self, entry)
            period = _on_grid(self, entry) if due else None
            if period is not None:  # look again at the next grid point, not a period later
                now = time.time()
                next_check = max((round(now / period) + 1) * period - now, 0.001)
            return due, next_check

        def reserve(self: Any, entry: Any) -> Any:
            new_entry = original_reserve(self, entry)
            period = _on_grid(self, entry)
            if period is not None:  # ran for the grid point nearest now
                point = round(time.time() / period) * period
                new_entry.last_run_at = datetime.fromtimestamp(point, tz=timezone.utc)
            return new_entry

        Scheduler.apply_async = apply_async
        Scheduler.is_due = is_due
        Scheduler.reserve = reserve
        Scheduler._taskdedup_hooked = True
