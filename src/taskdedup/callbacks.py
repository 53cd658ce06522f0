"""Callbacks for taskdedup's decisions, one method per kind of event: taskiq's
``DedupMiddleware`` has them, so a user subclasses it and overrides the ones they need (each
may be a plain or an ``async`` method).

class Alerting(DedupMiddleware):
    async def on_deduplicated(self, event):
        await notify(f"{event.task}: duplicate answered with job {event.holder}")

The same events as the Celery adapter's signals (``taskdedup.celery.signals``). A callback
runs where the decision was made (a producer's ``kiq``, a worker's claim): a plain one must be
quick; an async one is scheduled on the running event loop and not awaited. One that raises is
logged, not passed on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from .events import Decision

log = logging.getLogger("taskdedup")


class Callbacks:
    """No-op callbacks, one per kind of decision (see :data:`taskdedup.events.KINDS`)."""

    def on_decision(self, event: Decision) -> Any:
        """Every decision, those below included."""

    def on_deduplicated(self, event: Decision) -> Any:
        """A submission was answered with the job that holds its key (``event.holder``)."""

    def on_debounced(self, event: Decision) -> Any:
        """A submission was folded into its burst's one run (``debounce``; ``event.holder``
        is the burst's job, whose run moved to ``delay`` after this one). Also
        ``on_deduplicated``."""

    def on_superseded(self, event: Decision) -> Any:
        """A submission's arguments replaced those of its key's job still queued (``supersede``;
        ``event.holder``). Also ``on_deduplicated``."""

    def on_cancel_requested(self, event: Decision) -> Any:
        """A submission asked its key's running job to stop (``running="cancel"``); its own run
        follows that job's end. Also ``on_deduplicated``."""

    def on_idempotent_hit(self, event: Decision) -> Any:
        """A submission was answered with the job of its idempotency key."""

    def on_copy_skipped(self, event: Decision) -> Any:
        """A delivered copy was dropped: its job finished, ran out of attempts, or moved on."""

    def on_copy_deferred(self, event: Decision) -> Any:
        """A delivered copy was sent back to wait: its job, or its key's holder, runs."""

    def on_recovered(self, event: Decision) -> Any:
        """A copy runs in place of an earlier run that ended without a word (a dead worker)."""

    def on_rescheduled(self, event: Decision) -> Any:
        """The run owed by reschedule_once was sent (``event.fields["next"]``)."""

    def on_lock_released(self, event: Decision) -> Any:
        """A job's end, a failed publish or a revoke freed its key."""

    def on_lease_lost(self, event: Decision) -> Any:
        """A running job found its lock or slot gone (its lease lapsed)."""

    def on_quota_rejected(self, event: Decision) -> Any:
        """A submission was refused because its scope's slots were all taken."""

    def on_store_unavailable(self, event: Decision) -> Any:
        """A decision the store could not answer."""

    def _tell(self, event: Decision) -> None:
        """Call ``on_decision`` and the callback of the event's kind (a Runner listener)."""
        self._call(self.on_decision, event)
        for kind in event.kinds:  # (a debounced submission is a deduplicated one too)
            self._call(getattr(self, f"on_{kind}"), event)

    def _call(self, callback: Any, event: Decision) -> None:
        try:
            result = callback(event)
        except Exception:  # one callback failing must not keep the next from running
            log.exception("taskdedup: %s failed for %s %s", callback, event.decision, event.outcome)
            return
        if inspect.isawaitable(result):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a thread of ours (a flush at exit): no loop to run it on
                log.warning("taskdedup: %s not run for %s: no event loop", callback, event)
                if inspect.iscoroutine(result):
                    result.close()
                return
            task: asyncio.Future[Any] = asyncio.ensure_future(result, loop=loop)
            _running.add(task)
            task.add_done_callback(_done)


_running: set[asyncio.Future[Any]] = set()  # (the loop keeps only weak references)


def _done(task: asyncio.Future[Any]) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("taskdedup: a callback failed", exc_info=task.exception())
