"""What taskdedup decided, as events: one :class:`Decision` for each decision the library logs
and counts (G10), handed to listeners so users can wire their own alerts and metrics.

The Celery adapter turns them into Celery signals (``taskdedup.celery.signals``), the taskiq
middleware into its ``on_*`` callbacks, and ``taskdedup.metrics`` into Prometheus counters.
A listener is called synchronously where the decision is made (a producer's ``apply_async``,
a worker's claim): it must be quick, and an exception it raises is logged, never passed on to
the job.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from .errors import StoreUnavailable

R = TypeVar("R")

log = logging.getLogger("taskdedup")

#: The named kinds of decision users most often listen for, by (decision, outcome). A kind
#: is None for the rest (a lock acquired, a job claimed to run, a retry keeping its lock).
KINDS: Mapping[tuple[str, str], str] = {
    ("enqueue", "duplicate"): "deduplicated",
    ("enqueue", "debounced"): "debounced",  # a duplicate folded into its burst's one run
    ("enqueue", "superseded"): "superseded",  # its arguments replace the queued holder's
    ("enqueue", "cancel_requested"): "cancel_requested",  # the running holder asked to stop
    ("idempotency", "hit"): "idempotent_hit",
    ("claim", "recovered"): "recovered",  # a copy runs in place of a run whose worker died
    ("claim", "running"): "copy_deferred",  # a copy of a job that runs: sent back to wait
    ("claim", "busy"): "copy_deferred",  # the key is another job's, which runs: sent back
    ("claim", "done"): "copy_skipped",  # a copy of a job that already finished
    ("claim", "exhausted"): "copy_skipped",  # a copy past the policy's max_attempts
    ("finish", "stale"): "copy_skipped",  # a copy whose job moved on to a newer attempt
    ("finish", "handed_off"): "rescheduled",  # the owed run of reschedule_once is sent
    ("finish", "released"): "lock_released",
    ("release", "released"): "lock_released",
    ("heartbeat", "lost"): "lease_lost",
    ("reserve", "rejected"): "quota_rejected",
}
#: Kinds that are also a broader one: a debounced, superseding or cancel-requesting submission
#: is answered with its key's holder, so it is a ``deduplicated`` one too (its listeners, and
#: the ``taskdedup_deduplicated_total`` counter, see it as well).
ALSO: Mapping[str, str] = {
    "debounced": "deduplicated",
    "superseded": "deduplicated",
    "cancel_requested": "deduplicated",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One decision: ``decision`` is the moment (enqueue, claim, retry, finish, release,
    heartbeat, idempotency, reserve, beat) and ``outcome`` what was decided (acquired,
    duplicate, run, running, released, store_unavailable...). ``job_id`` is the job the
    decision is about; ``holder`` the job that holds the key when that is another one (the
    original job of a duplicate). ``fields`` has the rest of what the log line says."""

    decision: str
    outcome: str
    task: str
    key: str | None = None
    job_id: str | None = None
    holder: str | None = None
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str | None:
        """The event's name for listeners (see :data:`KINDS`); ``store_unavailable`` for any
        decision the store could not answer."""
        if self.outcome == "store_unavailable":
            return "store_unavailable"
        return KINDS.get((self.decision, self.outcome))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The event's kind and the broader kind it also is (see :data:`ALSO`), most specific
        first; empty for a decision of no named kind."""
        kind = self.kind
        if kind is None:
            return ()
        broader = ALSO.get(kind)
        return (kind, broader) if broader else (kind,)

    @classmethod
    def of(cls, decision: str, outcome: str, task: str, fields: Mapping[str, Any]) -> Decision:
        """A Decision from a log line's fields (``key``, ``job``, ``holder``, the rest)."""
        rest = {k: v for k, v in fields.items() if k not in ("key", "job", "holder")}
        return cls(
            decision,
            outcome,
            task,
            fields.get("key"),
            fields.get("job"),
            fields.get("holder"),
            rest,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StoreCall:
    """One store command a decision waited for: its operation (``acquire``, ``claim``...),
    how long the caller waited for its reply, and whether the store failed to answer."""

    operation: str
    seconds: float
    failed: bool = False


Listener = Callable[[Any], Any]


class Listeners:
    """A set of listeners; each decision is handed to every one of them, in order."""

    def __init__(self) -> None:
        self._items: tuple[Listener, ...] = ()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, listener: Listener) -> Listener:
        """Add ``listener`` (once: adding it again changes nothing); returns it, so this can
        be a decorator."""
        with self._lock:
            if listener not in self._items:
                self._items = (*self._items, listener)
        return listener

    def remove(self, listener: Listener) -> None:
        with self._lock:
            self._items = tuple(x for x in self._items if x != listener)

    def send(self, event: Any) -> None:
        for listener in self._items:
            try:
                listener(event)
            except Exception:
                log.exception("taskdedup: a listener of %r failed", event)


#: Listeners of every Decision in this process, whichever app or broker made it
#: (``taskdedup.metrics`` adds its own here).
everywhere = Listeners()
#: Listeners of every StoreCall in this process (timed only while one listens).
store_calls = Listeners()


def timed(operation: str, call: Callable[..., R], *args: Any) -> R:
    """``call(*args)``, its time handed to :data:`store_calls` while someone listens."""
    if not store_calls:
        return call(*args)
    began = time.perf_counter()
    try:
        result = call(*args)
    except StoreUnavailable:
        _took(operation, began, failed=True)
        raise
    _took(operation, began)
    return result


async def atimed(operation: str, call: Callable[..., Awaitable[R]], *args: Any) -> R:
    """The asyncio twin of :func:`timed`."""
    if not store_calls:
        return await call(*args)
    began = time.perf_counter()
    try:
        result = await call(*args)
    except StoreUnavailable:
        _took(operation, began, failed=True)
        raise
    _took(operation, began)
    return result


def _took(operation: str, began: float, *, failed: bool = False) -> None:
    store_calls.send(StoreCall(operation, time.perf_counter() - began, failed))


def timed_as(operation: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A method whose calls are :func:`timed` as ``operation``."""

    def wrap(method: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> R:
            return timed(operation, functools.partial(method, *args, **kwargs))

        return run

    return wrap
