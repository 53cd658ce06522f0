"""taskiq's scheduler: each send it makes is a tick of its schedule, with the tick's slot.

``TaskiqScheduler.on_ready`` (which every schedule source's due task goes through) is wrapped
once per process, so the kick it makes knows the :class:`~taskdedup.ticks.Tick` it sends; the
core decides the rest (:mod:`taskdedup.ticks`). The slot, the same in every scheduler:

- a ``cron`` schedule: its minute (taskiq's cron resolution);
- an ``interval`` schedule: the grid point of its period nearest to now (taskiq sends on
  whole seconds, so schedulers started at different times name the same tick);
- a ``time`` schedule: that time.

A send whose scheduler was not wrapped (a subclass that replaces ``on_ready`` without calling
it) is still a tick by its ``schedule_id`` label, without a slot: only the overlap applies.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import threading
import time
from datetime import timedelta, timezone
from typing import Any

from ..ticks import Tick, interval_slot, slot_ms

_TICK: contextvars.ContextVar[Tick | None] = contextvars.ContextVar(
    "taskdedup_taskiq_tick", default=None
)
_hooked = threading.Lock()


def tick_of(task: Any) -> Tick:
    """The tick of a ``ScheduledTask`` being sent now. Its entry is one in every scheduler
    by what it schedules (a label-based schedule's id is random in each process)."""
    entry, now = str(task.schedule_id), time.time()
    what = [task.task_name, task.cron, task.cron_offset, task.interval, task.time, task.args]
    same_as = hashlib.sha256(
        json.dumps([*what, task.kwargs], sort_keys=True, default=str).encode()
    ).hexdigest()[:32]
    if task.time is not None:
        moment = task.time if task.time.tzinfo else task.time.replace(tzinfo=timezone.utc)
        return Tick(entry, slot_ms(moment.timestamp()), same_as=same_as)
    if task.interval is not None:
        interval = task.interval
        period = interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
        return Tick(entry, interval_slot(now, period), period, same_as=same_as)
    # cron: sent at its minute's start
    return Tick(entry, slot_ms(round(now / 60) * 60), 60.0, same_as=same_as)


def sent_tick(schedule_id: Any) -> Tick | None:
    """The tick the scheduler is sending in this context, if any (``schedule_id``: the
    message's label, a tick without a slot when the scheduler was not wrapped)."""
    tick = _TICK.get()
    if tick is not None and tick.entry == str(schedule_id):
        return tick
    return None if schedule_id is None else Tick(str(schedule_id))


def hook_scheduler() -> None:
    """Wrap ``taskiq.scheduler.scheduler.TaskiqScheduler.on_ready`` (once per process)."""
    from taskiq.scheduler.scheduler import TaskiqScheduler

    with _hooked:
        if getattr(TaskiqScheduler, "_taskdedup_hooked", False):
            return
        original = TaskiqScheduler.on_ready

        async def on_ready(self: Any, source: Any, task: Any) -> None:
            token = _TICK.set(tick_of(task))
            try:
                await original(self, source, task)
            finally:
                _TICK.reset(token)

        TaskiqScheduler.on_ready = on_ready  # type: ignore[method-assign]
        TaskiqScheduler._taskdedup_hooked = True  # type: ignore[attr-defined]
