"""Celery beat: a scheduled run whose key a job still holds is skipped, and said so once.

Beat publishes a due entry on every tick whatever became of the last run. When that run still
holds its key, the publish is deduplicated: with ``on_conflict="raise"`` beat would log the
DuplicateJob as an ERROR with a stack trace on every tick, and with ``"drop"`` the decision log
repeats it at INFO. Here both are one INFO line per schedule entry while it stays
deduplicated (the next tick that publishes starts over), and each skipped tick is counted in
``stats["beat.skipped"]``. ``celery.beat.Scheduler.apply_async`` is wrapped once per process,
which covers the schedulers built on it.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import DuplicateJob
from .state import CeleryDedup

log = logging.getLogger("taskdedup")
_IN_BEAT: contextvars.ContextVar[bool] = contextvars.ContextVar("taskdedup_beat", default=False)
_hooked = threading.Lock()
_skips: weakref.WeakKeyDictionary[Any, BeatSkips] = weakref.WeakKeyDictionary()  # app -> skips


class BeatSkips:
    """Which schedule entries of one app are being skipped, so each is logged once."""

    def __init__(self, integ: CeleryDedup) -> None:
        self.integ = integ
        self._skipping: dict[str, str] = {}  # entry name -> the holder it was skipped for
        self._mutex = threading.Lock()

    def send(
        self, original: Callable[..., Any], scheduler: Any, entry: Any, *a: Any, **kw: Any
    ) -> Any:
        """Beat's ``Scheduler.apply_async`` for one entry; a deduplicated run is skipped."""
        token = _IN_BEAT.set(True)
        try:
            result = original(scheduler, entry, *a, **kw)
        except Exception as exc:  # beat's SchedulingError, raised while handling the cause
            duplicate = exc if isinstance(exc, DuplicateJob) else exc.__context__
            if not isinstance(duplicate, DuplicateJob):
                raise
            self.skipped(entry, duplicate.job_id, duplicate.key)
            publisher = self.integ.publisher
            assert publisher is not None
            return publisher.existing(duplicate.job_id, {}, deduplicated=True)
        finally:
            _IN_BEAT.reset(token)
        if getattr(result, "deduplicated", False):
            self.skipped(entry, result.id, None)
        else:
            with self._mutex:
                self._skipping.pop(entry.name, None)
        return result

    def skipped(self, entry: Any, holder: str, key: str | None) -> None:
        with self._mutex:
            first = entry.name not in self._skipping
            self._skipping[entry.name] = holder
        level = logging.INFO if first else logging.DEBUG
        self.integ.dedup.note(
            "beat", "skipped", level, entry.task, entry=entry.name, holder=holder, key=key
        )


class _QuietInBeat(logging.Filter):
    """The decision log's ``enqueue duplicate`` line, once per tick, is left to BeatSkips."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _IN_BEAT.get() or record.levelno != logging.INFO:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if args[:2] != ("enqueue", "duplicate"):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


def hook_scheduler(app: Any, skips: BeatSkips) -> None:
    """Skip ``app``'s deduplicated runs with ``skips``: wrap ``celery.beat.Scheduler.apply_async``
    (once per process)."""
    from celery.beat import Scheduler

    _skips[app] = skips
    with _hooked:
        if getattr(Scheduler, "_taskdedup_hooked", False):
            return
        original = Scheduler.apply_async

        def apply_async(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
            skips = _skips.get(self.app)
            if skips is None:
                return original(self, entry, *args, **kwargs)
            return skips.send(original, self, entry, *args, **kwargs)

        Scheduler.apply_async = apply_async
        Scheduler._taskdedup_hooked = True
        log.addFilter(_QuietInBeat())
