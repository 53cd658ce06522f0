"""RecordStore: a Store that runs every operation as a transition over its records.

A subclass provides :meth:`RecordStore.transact`, which runs a piece of work atomically over
a :class:`~taskdedup.stores.records.Records` view of its records; every operation of
``base.py`` then works (see ``MemoryStore``, and ``tests/test_record_seam.py`` for a store in a
few lines).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, TypeVar, cast

from . import history, slots, transitions
from .base import (
    Acquire,
    Claim,
    Confirm,
    Consume,
    Finish,
    ForceUnlock,
    Heartbeat,
    History,
    Inspect,
    JobState,
    ListScopes,
    ListSlots,
    MarkTick,
    Op,
    Pace,
    Peek,
    R,
    Release,
    Remember,
    Reserve,
    ReserveAll,
    Retry,
    Scan,
    Store,
    UnmarkTick,
    Unreserve,
)
from .records import Records

T = TypeVar("T")

TRANSITIONS: dict[type[Any], Callable[[Any, Records], Any]] = {
    Acquire: transitions.acquire,
    Peek: transitions.peek,
    Claim: transitions.claim,
    Heartbeat: transitions.heartbeat,
    Retry: transitions.retry,
    Finish: transitions.finish,
    Release: transitions.release,
    Confirm: transitions.confirm,
    JobState: transitions.job_state,
    Inspect: transitions.inspect,
    Scan: transitions.scan,
    ForceUnlock: transitions.force_unlock,
    History: history.history,
    Remember: slots.remember,
    Reserve: slots.reserve,
    ReserveAll: slots.reserve_all,
    Consume: slots.consume,
    Unreserve: slots.unreserve,
    ListSlots: slots.list_slots,
    ListScopes: slots.list_scopes,
    Pace: slots.pace,
    MarkTick: slots.mark_tick,
    UnmarkTick: slots.unmark_tick,
}


class RecordStore(Store):
    """A store on the record seam: subclasses implement :meth:`transact`."""

    @abc.abstractmethod
    def transact(self, work: Callable[[Records], T]) -> T:
        """Run ``work`` on a view of the records, atomically, and return its answer."""

    #: Whether the key's decision history is written (the ``history`` setting).
    history = True

    _issued = 0  # the last fencing token given (see Records.next_fence)

    def run(self, op: Op[R]) -> R:
        transition = TRANSITIONS[type(op)]

        def work(records: Records) -> Any:
            records.history, records.issued = self.history, self._issued
            try:
                return transition(op, records)
            finally:
                self._issued = records.issued  # (inside the transaction)

        return cast(R, self.transact(work))

    async def arun(self, op: Op[R]) -> R:
        return self.run(op)
