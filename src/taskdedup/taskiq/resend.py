"""Sending a taskiq delivery again: later, for one the worker does not run now (busy, its
holder running, its scope full), and the one more run owed by reschedule_once.

These sends bypass taskdedup's producer side (the worker has settled their lock and slot), so
they are never deduplicated against themselves. The delivery is held (not acknowledged) until
its copy is in the broker, however long the wait: a broker with acknowledgements (taskiq-redis'
RedisStreamBroker) then redelivers it if the worker dies meanwhile, so the job is never lost
to a worker killed between the two. A worker stopping gracefully sends the copies still waiting
at once, so it is not kept waiting. A broker without acknowledgements (ListQueueBroker) has
taken the message off its queue before the worker sees it: there a worker killed while a copy
waits loses that job, as it would lose any message it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from taskiq.kicker import AsyncKicker
from taskiq.message import TaskiqMessage

from .. import submission
from ..decide import STORE_RETRY_MAX
from ..decide.envelope import TICK, Waits
from ..delivery import HandOff
from .options import (
    ATTEMPT_LABEL,
    FENCE_LABEL,
    RETRIES_LABEL,
    RUN_KWARG,
    SCOPE_LABEL,
    SKIP_KWARG,
    call_shape,
    task_function,
    task_limits,
)
from .sends import PASS_THROUGH, load_call
from .state import DedupState

log = logging.getLogger("taskdedup")
_NOT_HANDED_ON = (RETRIES_LABEL, FENCE_LABEL, ATTEMPT_LABEL, SCOPE_LABEL, "schedule_id", TICK)


class Resender:
    """The worker's own sends, for the deliveries of one broker's worker."""

    def __init__(self, middleware: DedupState) -> None:
        self.mw = middleware
        self._later: set[asyncio.Task[None]] = set()  # copies waiting to be sent again
        self._stopping = False
        self._stop = asyncio.Event()  # set when the worker stops: send every copy now

    async def later(
        self,
        message: TaskiqMessage,
        delay: float,
        waits: Waits | None = None,
    ) -> None:
        """Send a copy of this delivery (same id) after ``delay``, holding the delivery until
        then; a copy the broker refuses is tried again, with back-off, until it is taken or the
        worker stops. ``waits``: the claims the store could not answer, carried on the copy
        (None: as the delivery carries them)."""
        copy = message.model_copy(deep=True)
        copy.kwargs.pop(SKIP_KWARG, None)
        copy.kwargs.pop(RUN_KWARG, None)
        if waits is not None:
            waits.write(copy.labels)
        later = asyncio.get_running_loop().create_task(self._send_later(copy, delay))
        self._later.add(later)
        later.add_done_callback(self._later.discard)
        await asyncio.shield(later)

    async def _send_later(self, message: TaskiqMessage, delay: float) -> None:
        pause = delay
        while True:
            if not self._stopping:
                with contextlib.suppress(asyncio.TimeoutError):  # the worker stops: send now
                    await asyncio.wait_for(self._stop.wait(), pause)
            try:
                await self.send(
                    message.task_name, message.labels, message.task_id, message.args, message.kwargs
                )
                return
            except Exception as exc:
                if self._stopping:
                    log.exception(
                        "taskdedup: the worker stops and could not send %s[%s] again: this "
                        "delivery is not run",
                        message.task_name,
                        message.task_id,
                    )
                    return
                pause = min(max(pause, 0.5) * 2, STORE_RETRY_MAX)
                log.warning(
                    "taskdedup: could not send %s[%s] again (%s); trying again in %gs",
                    message.task_name,
                    message.task_id,
                    exc,
                    pause,
                )

    async def send(
        self, task: str, labels: dict[str, Any], job_id: str, args: Any, kwargs: Any
    ) -> None:
        """Send a job as it is: taskdedup does not deduplicate it."""
        kicker: AsyncKicker[Any, Any] = AsyncKicker(task, self.mw.broker, dict(labels))
        token = PASS_THROUGH.set(True)
        try:
            await kicker.with_task_id(job_id).kiq(*args, **kwargs)
        finally:
            PASS_THROUGH.reset(token)

    async def hand_off(self, message: TaskiqMessage, owed: HandOff) -> None:
        """Publish the one rescheduled run (reschedule_once) under the id the lock now holds
        (:func:`~taskdedup.submission.publish_owed`), with the labels of ``message``."""
        mw, task = self.mw, self.mw.broker.find_task(message.task_name)
        run = submission.Call(
            message.task_name,
            call_shape(task_function(task)) if task is not None else None,
            list(message.args),
            {k: v for k, v in message.kwargs.items() if k != SKIP_KWARG},
            owed.handoff.job_id,
            None,
            task_limits(task) if task is not None else None,
            key=owed.key,
        )
        load = functools.partial(load_call, mw.broker)
        flow = submission.publish_owed(
            mw.dedup, mw.idempotency, mw.reservations, run, owed.handoff.payload, load
        )

        async def send(request: submission.SendOwed) -> None:
            labels = {k: v for k, v in message.labels.items() if k not in _NOT_HANDED_ON}
            if request.scope:
                labels[SCOPE_LABEL] = request.scope
            await self.send(message.task_name, labels, request.job_id, request.args, request.kwargs)

        await mw.dedup.adrive(flow, send)

    def watch(self, broker: Any) -> None:
        """Send the waiting copies at once when the worker stops reading ``broker`` (taskiq
        closes its ``listen()`` iterator at shutdown, before it waits for the deliveries in
        hand, which are held until their copies are out)."""
        original = broker.listen
        if getattr(original, "_taskdedup_watched", False):
            return

        async def listen(*args: Any, **kwargs: Any) -> Any:
            try:
                async for message in original(*args, **kwargs):
                    yield message
            finally:
                self.hurry()

        listen._taskdedup_watched = True  # type: ignore[attr-defined]
        broker.listen = listen

    def hurry(self) -> None:
        """The worker stops: every copy still waiting is sent now."""
        self._stopping = True
        self._stop.set()  # each waiting copy is sent now (a send under way is not cut off)

    async def close(self) -> None:
        """Send the copies still waiting now, so none is lost."""
        waiting = list(self._later)
        self.hurry()
        await asyncio.gather(*waiting, return_exceptions=True)
