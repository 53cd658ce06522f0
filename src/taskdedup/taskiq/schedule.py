"""taskiq's scheduler: each send is a tick of its schedule (:mod:`taskdedup.ticks` decides).

``TaskiqScheduler.on_ready``, which every schedule source's due task goes through, is wrapped
once per process. The slot: a ``cron`` schedule's minute, an ``interval`` one's grid point, a
``time`` one's time. Entries are one across schedulers by what they schedule (a label-based
schedule gets a random ``schedule_id`` in each). A scheduler whose ``on_ready`` does not call
the original sends ticks without a slot (:func:`taskdedup.ticks.sent_now`): only overlap applies.
"""

from __future__ import annotations

from datetime import timedelta, timezone
from typing import Any

from ..ticks import Tick, due_tick, identity, interval_tick, sending, wrap_once


def tick_of(task: Any) -> Tick:
    """The tick of a ``ScheduledTask`` being sent now."""
    entry, every = str(task.schedule_id), task.interval
    what = (task.task_name, task.cron, task.cron_offset, every, task.time, task.args, task.kwargs)
    if task.time is not None:
        at = task.time if task.time.tzinfo else task.time.replace(tzinfo=timezone.utc)
        return due_tick(entry, at.timestamp(), same_as=identity(*what))
    period = every.total_seconds() if isinstance(every, timedelta) else float(every or 60)
    return interval_tick(entry, period, same_as=identity(*what))  # cron: its minute


def hook_scheduler() -> None:
    """Wrap ``TaskiqScheduler.on_ready`` (once per process)."""
    from taskiq.scheduler.scheduler import TaskiqScheduler

    def wrap(original: Any) -> Any:
        async def on_ready(self: Any, source: Any, task: Any) -> None:
            with sending(tick_of(task)):
                await original(self, source, task)

        return on_ready

    wrap_once(TaskiqScheduler, "on_ready", wrap)
