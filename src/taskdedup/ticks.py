"""A scheduler's ticks: each sent once, whatever the number of schedulers, and each that finds
the last run still holding its key skipped, buffered or let through (the task's ``overlap``).

A scheduler (Celery beat, taskiq's scheduler) sends a due entry on every tick whatever became
of the last run, and two schedulers (or one restarted mid-tick) send it twice. Both adapters
name the entry and the tick's scheduled time, its slot, in a :class:`Tick`
(:attr:`submission.Call.tick`); the core decides the rest, once for Celery and taskiq alike:

- **One send per tick.** The first send of a slot takes it (:class:`~taskdedup.stores.base.
  MarkTick`: the entry keeps one record, its latest slot and that slot's job); a second send
  of it, or a late send of an earlier slot, is answered with the job of the latest slot, and
  nothing is published. On by default for the entries of deduplicated tasks; the setting
  ``once_per_tick="all"`` extends it to every entry.
- **Overlap.** A tick whose key the last run still holds is a duplicate: skipped (never
  DuplicateJob, whatever ``on_conflict`` says), or buffered as the one run after it
  (``overlap="buffer_one"``); ``"allow"`` sends it under a key of its own. Each skipped or
  buffered tick is counted (``stats["beat.skipped"]``, ``stats["beat.buffered"]`` and the
  decisions metric), counted on the holder's lock (``explain`` shows it), and logged at INFO
  once per entry while its ticks keep being skipped (DEBUG after that).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, StoreUnavailable
from .policy import Overlap, TaskPolicy, check_overlap
from .stores.base import MarkTick, UnmarkTick, ms

if TYPE_CHECKING:
    from .decide import Notes, Ticket
    from .flow import Flow
    from .settings import Settings

log = logging.getLogger("taskdedup")
#: Entries remembered as skipping; past it the memory starts over.
MAX_ENTRIES = 10_000
#: How long an entry's latest slot is kept at least (a late scheduler's send of a slot older
#: than this is sent again).
KEEP_SLOT = 86400.0


@dataclasses.dataclass(frozen=True, slots=True)
class Tick:
    """One send of a schedule entry by a scheduler. ``slot_ms``: the tick's scheduled time
    (epoch ms, the same in every scheduler of the entry), None when the scheduler did not say
    (then only the overlap applies). ``period``: seconds between the entry's ticks, if known.
    ``overlap``: the entry's own overlap, over the task's. ``same_as``: what makes two
    schedulers' entries one, when their names may differ (taskiq's label-based schedules get a
    random id in each scheduler): the schedule and its call; else the name."""

    entry: str
    slot_ms: int | None = None
    period: float | None = None
    overlap: str | None = None
    same_as: str | None = None


def grid_point(period: float, now: float | None = None) -> float:
    """The grid point of ``period`` nearest to ``now`` (epoch seconds): the tick an interval
    schedule's send at ``now`` is for, the same in schedulers started at different times or
    sending a little early or late."""
    now = time.time() if now is None else now
    return round(now / period) * period


def interval_tick(entry: str, period: float, overlap: Any = None, same_as: Any = None) -> Tick:
    """The tick an interval schedule (or a cron one, period 60) sends now."""
    return Tick(entry, round(grid_point(period) * 1000), period, overlap, same_as)


def due_tick(entry: str, due: float, overlap: Any = None, same_as: Any = None) -> Tick:
    """The tick of a schedule that was due at ``due`` (epoch seconds)."""
    return Tick(entry, math.floor(due * 1000), None, overlap, same_as)


def identity(*what: Any) -> str:
    """What makes two schedulers' entries one when their names may differ: a digest of what
    they schedule."""
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


_SENDING: contextvars.ContextVar[Tick | None] = contextvars.ContextVar(
    "taskdedup_tick", default=None
)
_wrapping = threading.Lock()


@contextlib.contextmanager
def sending(tick: Tick) -> Iterator[None]:
    """A scheduler sends ``tick`` in this context (the publish it makes reads it)."""
    token = _SENDING.set(tick)
    try:
        yield
    finally:
        _SENDING.reset(token)


def sent_now(entry: Any = None) -> Tick | None:
    """The tick a scheduler is sending in this context, if any. ``entry``: the entry the
    message names (taskiq's ``schedule_id`` label): a tick of it without a slot when the
    scheduler sent it without saying (its ``on_ready`` replaced, not wrapped)."""
    tick = _SENDING.get(None)
    if entry is None or (tick is not None and tick.entry == str(entry)):
        return tick
    return Tick(str(entry))


def wrap_once(owner: Any, method: str, wrap: Callable[[Any], Any]) -> None:
    """Replace ``owner.method`` by ``wrap(original)``, once per process (a scheduler class)."""
    with _wrapping:
        if getattr(getattr(owner, method), "_taskdedup_wrapped", False):
            return
        wrapped = wrap(getattr(owner, method))
        wrapped._taskdedup_wrapped = True
        setattr(owner, method, wrapped)


def once_per_tick(
    settings: Settings, tick: Tick | None, policy: TaskPolicy | None, task: str
) -> bool:
    """Whether a send is a scheduler's ``tick`` that is sent once per tick (False: not a
    scheduler's send, or not once per tick). An entry that names an overlap for a task
    without a dedup policy is a ConfigError naming both (there is no lock to overlap)."""
    if tick is None:
        return False
    if tick.overlap is not None and policy is None:
        raise ConfigError(
            f"task {task!r}: schedule entry {tick.entry!r} names overlap={tick.overlap!r}, "
            "but the task has no dedup policy here (none is declared, or this scheduler's "
            "process does not import the task's module), so no run holds a lock to overlap; "
            'declare one on the task (@deduplicate("until_executed", ...)) and import it '
            "where the scheduler runs, or drop the option"
        )
    mode = settings.once_per_tick
    return mode == "all" or (mode == "deduplicated" and policy is not None)


def tick_overlap(tp: TaskPolicy, tick: Tick) -> Overlap:
    """A tick's overlap: the entry's, else the task's. An entry's value that does not exist,
    or ``buffer_one`` of a task whose duplicates owe no run, is a ConfigError naming the
    task and the entry (checked before the tick is taken, so a fixed entry's next send of
    it goes out)."""
    if tick.overlap is None:
        return tp.policy.overlap
    check_overlap(tick.overlap, f"overlap of schedule entry {tick.entry!r}")
    if tick.overlap == "buffer_one" and not tp.policy.owes_runs:
        raise ConfigError(
            f"task {tp.task!r}: schedule entry {tick.entry!r} asks overlap='buffer_one', but "
            "the task's duplicates owe no run after the running one; declare overlap="
            "'buffer_one' on the task (with strategy='until_executed')"
        )
    return tick.overlap  # type: ignore[return-value]


def tick_key(tp: TaskPolicy, tick: Tick, key: str) -> tuple[str, bool]:
    """The key a tick's enqueue takes, and whether a duplicate is counted, by its overlap:
    ``allow`` gives the tick a key of its own; ``skip`` does not count it on a lock whose
    duplicates owe a run (so it owes none); ``buffer_one`` counts it (it owes the run after
    the running one)."""
    overlap = tick_overlap(tp, tick)
    if overlap == "allow":
        slot = tick.slot_ms if tick.slot_ms is not None else "unslotted"
        return f"{key}@tick:{slot}", True
    return key, overlap == "buffer_one" or not tp.policy.owes_runs


def mark_key(task: str, tick: Tick) -> str:
    """The store's name for the entry whose latest tick is kept."""
    return f"{task}\0{tick.same_as or tick.entry}"


def unmark_flow(entry: str, job_id: str) -> Flow[None]:
    """``job_id``'s publish failed: its tick is forgotten (if still its), so another
    scheduler's send of it goes out; a store that cannot answer leaves it (logged)."""
    try:
        yield UnmarkTick(entry, job_id)
    except StoreUnavailable as exc:
        log.warning("taskdedup: could not forget the tick of %s: %s", job_id, exc)


class ScheduledTicks:
    """Which slot of an entry was sent, and which entries are being skipped (each is logged
    once while it stays so)."""

    def __init__(self, note: Notes, settings: Settings) -> None:
        self._note = note
        self._settings = settings
        self._skipping: dict[tuple[str, str], str] = {}  # (task, entry) -> the holder
        self._mutex = threading.Lock()

    def claim_flow(self, mark: str, task: str, tick: Tick, job_id: str) -> Flow[str | None]:
        """Take the tick's slot for ``job_id`` in the entry's record ``mark`` (:func:`mark_key`):
        None when it is this send's (or the store could not answer and ``on_store_error`` is
        "enqueue": sent, at worst twice), else the job of the entry's latest tick, sent
        already."""
        if tick.slot_ms is None or not self._settings.enabled:
            return None
        keep = max(KEEP_SLOT, 3 * (tick.period or 0.0))
        try:
            sent: str | None = yield MarkTick(mark, tick.slot_ms, job_id, ms(keep))
        except StoreUnavailable as exc:
            entry = tick.entry
            self._note("tick", "store_unavailable", logging.WARNING, task, entry=entry, error=exc)
            if self._settings.on_store_error == "raise":
                raise
            return None
        if sent is not None:
            slot = tick.slot_ms
            self._note(
                "tick", "already_sent", logging.DEBUG, task, entry=tick.entry, slot=slot, job=sent
            )
        return sent

    def saw(self, task: str, entry: str, ticket: Ticket, *, buffers: bool = False) -> None:
        """The enqueue decision of one tick of ``entry`` (``buffers``: a duplicate of a
        running holder owes the one run after it)."""
        with self._mutex:
            if not ticket.deduplicated:
                self._skipping.pop((task, entry), None)
                return
            first = (task, entry) not in self._skipping
            if first and len(self._skipping) >= MAX_ENTRIES:  # one-off schedules, each new
                self._skipping.clear()  # (at worst an entry is said once more)
            self._skipping[(task, entry)] = ticket.job_id
        level = logging.INFO if first else logging.DEBUG
        outcome = "buffered" if buffers and ticket.running else "skipped"
        self._note("beat", outcome, level, task, entry=entry, holder=ticket.job_id, key=ticket.key)
