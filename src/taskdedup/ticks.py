"""A scheduler's ticks that find their key held: skipped, and said once per schedule entry.

A scheduler (Celery beat, taskiq's scheduler) sends a due entry on every tick whatever became
of the last run. When that run still holds its key, the tick is a duplicate: it is skipped
(never DuplicateJob, whatever ``on_conflict`` says), counted in ``stats["beat.skipped"]``,
and logged at INFO once per entry while it stays skipped (DEBUG after that); the next tick that
is sent starts over. Both adapters name the entry in :attr:`submission.Call.scheduled`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decide import Notes, Ticket

#: Entries remembered as skipping; past it the memory starts over.
MAX_ENTRIES = 10_000


class ScheduledTicks:
    """Which schedule entries are being skipped (each is logged once while it stays so)."""

    def __init__(self, note: Notes) -> None:
        self._note = note
        self._skipping: dict[tuple[str, str], str] = {}  # (task, entry) -> the holder
        self._mutex = threading.Lock()

    def saw(self, task: str, entry: str, ticket: Ticket) -> None:
        """The enqueue decision of one tick of ``entry``."""
        with self._mutex:
            if not ticket.deduplicated:
                self._skipping.pop((task, entry), None)
                return
            first = (task, entry) not in self._skipping
            if first and len(self._skipping) >= MAX_ENTRIES:  # one-off schedules, each new
                self._skipping.clear()  # (at worst an entry is said once more)
            self._skipping[(task, entry)] = ticket.job_id
        level = logging.INFO if first else logging.DEBUG
        self._note(
            "beat", "skipped", level, task, entry=entry, holder=ticket.job_id, key=ticket.key
        )
