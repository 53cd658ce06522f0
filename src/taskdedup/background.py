"""Work that can wait, sent as one batch per process (G2): lease renewals and confirmations.

- :class:`Heartbeat` renews the lease of every job running in the process, in one store call
  every lease/3, from a daemon thread (sync workers such as Celery's).
- :class:`AsyncHeartbeat` does the same from an asyncio task (taskiq).
- :class:`Confirmer` extends freshly published locks from their short grace to their ttl (G11),
  in one call for everything published since the last flush, and flushes at exit.
- :class:`Releaser` sends again the releases the store could not take (a revoked job's lock,
  a failed publish's), until it answers (G13).
- :class:`LateReplies` reads the replies of calls written without waiting (a worker's finish).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, Protocol

from . import cancel
from .errors import StoreUnavailable
from .settings import Settings
from .stores.base import SUPERSEDED, Confirm, Lease, Release, Sent, Store


class StoreUser(Protocol):
    """What the confirmer and the releaser need of their runner: its store and settings."""

    store: Store
    settings: Settings


class LeaseKeeper(Protocol):
    """What a heartbeat needs of its runner: batched renewals and a way to report a loss."""

    settings: Settings

    def heartbeat(self, leases: Iterable[Lease]) -> tuple[int, ...] | None: ...

    async def aheartbeat(self, leases: Iterable[Lease]) -> tuple[int, ...] | None: ...

    def lease_lost(self, lease: Lease) -> None: ...


log = logging.getLogger("taskdedup")


def _fresh_after_fork(batcher: Any) -> None:
    """A forked child (Celery's prefork pool) starts ``batcher`` afresh: a lock the parent held
    at the fork would block the child for ever, and the parent's pending work is the
    parent's to send. (A weak reference: registering must not keep the object alive.)"""
    ref = weakref.ref(batcher)

    def reset() -> None:
        obj = ref()
        if obj is not None:
            obj._reset()

    os.register_at_fork(after_in_child=reset)


def _thread_of_this_process(batcher: Any, name: str, at_exit: Any) -> None:
    """Start ``batcher._loop`` on a daemon thread the first time it is used in this process (a
    forked child starts its own) and have ``at_exit`` run when the process exits. Call it
    holding the batcher's mutex."""
    if batcher._pid == os.getpid():
        return
    batcher._pid = os.getpid()
    batcher._thread = threading.Thread(target=batcher._loop, name=name, daemon=True)
    batcher._thread.start()
    if not getattr(batcher, "_flushed_at_exit", False):  # (a forked child inherits it)
        atexit.register(at_exit)
        batcher._flushed_at_exit = True


def _stop_thread(batcher: Any) -> None:
    """End ``batcher``'s daemon thread, whose loop runs while it is ``batcher._thread``; the
    next use starts another (:func:`_thread_of_this_process`)."""
    thread, batcher._thread, batcher._pid = batcher._thread, None, 0
    batcher._wake.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(5.0)


class _Leases:
    """The leases held in this process, and how often they need renewing."""

    def __init__(self, default_lease: float) -> None:
        self._held: dict[tuple[str, str, bool], Lease] = {}
        self._mutex = threading.Lock()
        self._default = default_lease
        self._due = math.inf  # when the next beat is planned (the beating loop's clock)

    def plan(self, now: float, due: float = math.inf) -> float:
        """When to beat next: a third of the shortest lease held from ``now``, and no later
        than ``due``. (Unknown while it is computed: a lease added meanwhile wakes the loop.)"""
        self._due = math.inf
        self._due = min(due, now + self.interval())
        return self._due

    def sooner(self, lease: Lease, now: float) -> bool:
        """Whether ``lease`` needs a beat before the one planned: only then is the beating
        loop woken (waking it for every job would cost each job a thread switch)."""
        return now + lease.lease_ms / 3000 < self._due

    def add(self, lease: Lease) -> None:
        """Renew ``lease`` from now on; a job's lock lease is added in the context that runs
        the job, which is how :mod:`taskdedup.cancel` knows which job runs there."""
        if not lease.slot:
            cancel.running(lease.key, lease.job_id)
        with self._mutex:
            self._held[(lease.key, lease.job_id, lease.slot)] = lease

    def discard(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (only that one: a retry of the job may hold an equal one)."""
        if not lease.slot:
            cancel.ended(lease.key, lease.job_id)
        with self._mutex:
            ident = (lease.key, lease.job_id, lease.slot)
            if self._held.get(ident) is lease:
                del self._held[ident]

    def snapshot(self) -> list[Lease]:
        with self._mutex:
            return list(self._held.values())

    def lost(self, batch: list[Lease], reply: tuple[int, ...] | None) -> list[Lease]:
        """The leases of ``batch`` the store no longer knew and that are still held: they are
        no longer renewed. A lease given up while its renewal was on the way (its job ended
        or retried) is not lost; nor is any while the store does not answer (``None``)."""
        if reply is None:
            return []
        gone = []
        with self._mutex:
            for lease, alive in zip(batch, reply, strict=True):
                if alive == SUPERSEDED:
                    cancel.ask_to_stop(lease.key, lease.job_id)
                ident = (lease.key, lease.job_id, lease.slot)
                if not alive and self._held.get(ident) is lease:
                    del self._held[ident]
                    gone.append(lease)
        return gone

    def interval(self) -> float:
        """A third of the shortest lease held (or of the default lease when none is)."""
        with self._mutex:
            shortest = min((lease.lease_ms for lease in self._held.values()), default=None)
        return (shortest / 1000 if shortest else self._default) / 3


class Heartbeat(_Leases):
    """Renews every lease held in this process from a daemon thread; ``stop()`` ends it."""

    def __init__(self, dedup: LeaseKeeper) -> None:
        super().__init__(dedup.settings.default_lease)
        self.dedup = dedup
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        super().add(lease)
        if self._thread is None or not self._thread.is_alive():
            self.start()
        elif self.sooner(lease, time.monotonic()):  # a shorter lease: an earlier beat
            self._wake.set()

    def start(self) -> None:
        self._stop.clear()
        self._due = math.inf  # wake on every add until the new thread plans its first beat
        self._thread = threading.Thread(target=self._loop, name="taskdedup-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def beat(self) -> None:
        """Renew every held lease now, in one batch."""
        leases = self.snapshot()
        if leases:
            for lease in self.lost(leases, self.dedup.heartbeat(leases)):
                self.dedup.lease_lost(lease)

    def _loop(self) -> None:
        due = self.plan(time.monotonic())
        while not self._stop.is_set():
            self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                break
            if self._wake.is_set():  # a shorter lease was added: it may be due sooner, not now
                self._wake.clear()
                due = self.plan(time.monotonic(), due)
                if time.monotonic() < due:
                    continue
            try:
                self.beat()
            except Exception:  # keep beating: a lost beat costs a lease, a dead thread all
                log.exception("taskdedup heartbeat failed")
            due = self.plan(time.monotonic())


class AsyncHeartbeat(_Leases):
    """Renews every lease held in this event loop from an asyncio task; ``await stop()``."""

    def __init__(self, dedup: LeaseKeeper) -> None:
        super().__init__(dedup.settings.default_lease)
        self.dedup = dedup
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False

    def add(self, lease: Lease) -> None:
        super().add(lease)
        if self._task is None or self._task.done():
            self.start()
        elif self._wake is not None and self.sooner(lease, asyncio.get_running_loop().time()):
            self._wake.set()

    def start(self) -> None:
        self._stopping = False
        self._due = math.inf
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """End the task (cancelled; the flag also ends a loop that is between awaits)."""
        if self._task is not None:
            self._stopping = True
            if self._wake is not None:
                self._wake.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def beat(self) -> None:
        leases = self.snapshot()
        if leases:
            for lease in self.lost(leases, await self.dedup.aheartbeat(leases)):
                self.dedup.lease_lost(lease)

    async def _loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        due = self.plan(loop.time())
        while not self._stopping:
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow the cancel that ends us
            waiter = loop.create_task(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=max(0.0, due - loop.time()))
            finally:
                waiter.cancel()
            if self._stopping:
                break
            if self._wake.is_set():  # a shorter lease was added: it may be due sooner
                self._wake.clear()
                due = self.plan(loop.time(), due)
                if loop.time() < due:
                    continue
            try:
                await self.beat()
            except Exception:
                log.exception("taskdedup heartbeat failed")
            due = self.plan(loop.time())


class _Confirmation(NamedTuple):
    """A published lock waiting in :class:`Confirmer` for its batch."""

    key: str
    job_id: str
    give_up: float  # (monotonic) past this, the lock's grace is over: no use sending it
    duplicates: int  # answered with the job here since the last batch (counted by the batch)


class Confirmer:
    """Confirms published locks in batches from a daemon thread started on first use.

    A batch the store could not take is tried again while its locks' grace lasts: a lock
    left unconfirmed would lapse after the grace (a missed dedup), and an idempotency key
    would keep its repeats waiting until then.
    """

    def __init__(self, dedup: StoreUser, interval: float = 0.25) -> None:
        self.dedup = dedup
        self.interval = interval
        self._pending: list[_Confirmation] = []
        self._sending: dict[str, str] = {}  # job id -> key, of the batch on its way
        self._failing = False
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        _fresh_after_fork(self)

    def _reset(self) -> None:
        self._pending, self._failing, self._mutex = [], False, threading.Lock()
        self._sending = {}
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread, self._pid = None, 0

    def add(self, key: str, job_id: str) -> None:
        give_up = time.monotonic() + self.dedup.settings.grace
        with self._mutex:
            self._pending.append(_Confirmation(key, job_id, give_up, 0))
            if self._pid != os.getpid():  # first use, or a forked child
                self._stop.clear()
                _thread_of_this_process(self, "taskdedup-confirm", self.flush)
            first = len(self._pending) == 1
        if first:  # the thread sleeps while nothing is pending
            self._wake.set()

    def queued(self, job_id: str) -> bool:
        """Whether ``job_id``'s confirmation waits here or is on its way: its publish
        succeeded in this process (a duplicate in this process need not wait for the batch)."""
        with self._mutex:
            if self._pid != os.getpid():
                return False
            return job_id in self._sending or any(item.job_id == job_id for item in self._pending)

    def count_duplicate(self, job_id: str) -> None:
        """A duplicate this process answered with ``job_id`` while the job's confirmation
        waited here (the store saw a holder not yet confirmed, and counted nothing): it is
        counted on the lock by the confirmation's own call, which costs the store no call."""
        with self._mutex:
            for index, item in enumerate(self._pending):
                if item.job_id == job_id:
                    self._pending[index] = item._replace(duplicates=item.duplicates + 1)
                    return
            sent = self._sending.get(job_id)
            if sent is None:
                return
            give_up = time.monotonic() + self.dedup.settings.grace
            # (confirming again is a no-op)
            self._pending.append(_Confirmation(sent, job_id, give_up, 1))
        self._wake.set()

    def _take(self) -> list[_Confirmation]:
        with self._mutex:
            batch, self._pending = self._pending, []
            self._sending = {item.job_id: item.key for item in batch}
        return batch

    def flush(self) -> int:
        """Confirm everything pending now; returns how many locks were extended."""
        batch = self._take()
        if not batch:
            return 0
        try:
            items = tuple((item.key, item.job_id) for item in batch)
            counts = tuple(item.duplicates for item in batch)
            confirmed = self.dedup.store.run(Confirm(items, counts if any(counts) else ()))
        except Exception as exc:  # a missed confirmation costs a dedup window, never a job
            return self._failed(batch, exc)
        finally:
            with self._mutex:
                self._sending = {}  # (a failed batch is back in _pending by now)
        self._failing = False
        return confirmed

    def _failed(self, batch: list[_Confirmation], exc: Exception) -> Literal[0]:
        """Keep for another try what the store did not take, while its grace lasts."""
        now = time.monotonic()
        again = [item for item in batch if item.give_up > now]
        if not self._failing:
            log.warning(
                "taskdedup: could not confirm %d lock(s), trying again while their grace lasts: %s",
                len(batch),
                exc,
            )
        self._failing = True
        with self._mutex:
            self._pending[:0] = again
        if again:
            self._wake.set()
        return 0

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._pid == os.getpid():
            self._thread.join(5.0)
        self._thread = None
        self._pid = 0
        self.flush()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            self._stop.wait(self.interval)  # let a batch gather
            self.flush()


class Releaser:
    """Owner-checked releases the store missed (it was down or stalled), sent again every
    ``interval`` seconds from a daemon thread until the store takes them, for ``patience``
    seconds at most. Without it a revoked or expired job's lock would outlive the outage by its
    whole ttl (G13). A late release frees only ``job_id``'s lock, never one taken since."""

    def __init__(self, dedup: StoreUser, interval: float = 1.0, patience: float = 3600.0):
        self.dedup = dedup
        self.interval = interval
        self.patience = patience
        self._pending: dict[Release, float] = {}  # the release -> give up at
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        _fresh_after_fork(self)

    def _reset(self) -> None:
        self._pending, self._mutex, self._wake = {}, threading.Lock(), threading.Event()
        self._thread, self._pid = None, 0

    def add(self, op: Release) -> None:
        with self._mutex:
            self._pending[op] = time.monotonic() + self.patience
            # (at exit, one last try: it stops at the first failure)
            _thread_of_this_process(self, "taskdedup-release", self.flush)
        self._wake.set()

    def pending(self) -> int:
        with self._mutex:
            return len(self._pending)

    def flush(self) -> int:
        """Send every pending release once; returns how many the store took."""
        with self._mutex:
            now = time.monotonic()
            self._pending = {item: end for item, end in self._pending.items() if end > now}
            batch = list(self._pending)
        taken = 0
        for op in batch:
            try:
                self.dedup.store.run(op)
            except Exception:  # still down: the rest would fail alike
                break
            taken += 1
            with self._mutex:
                self._pending.pop(op, None)
        if taken:
            log.info("taskdedup: %d release(s) missed while the store was down are done", taken)
        return taken

    def stop(self) -> None:
        """One last try for what is pending, then end the thread (a later release starts it
        again; what the store did not take stays pending for it)."""
        self.flush()
        _stop_thread(self)

    def _loop(self) -> None:
        me = threading.current_thread()
        while self._thread is me:
            self._wake.wait()
            if self._thread is not me:
                return
            time.sleep(self.interval)
            self.flush()
            with self._mutex:
                if not self._pending:
                    self._wake.clear()


class LateReplies:
    """The replies of store calls written without waiting for them: a worker's finish, whose
    effect (the key freed) is the store's at once and whose reply only feeds the notes, so the
    job's end need not wait a round trip. The worker reads them when its next job starts; a
    daemon thread reads what is left after ``interval`` seconds (an idle worker), so a
    connection is never held for long and every reply is counted."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._unread: list[tuple[Sent[Any], Any]] = []  # the call, and the Step that reads it
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        _fresh_after_fork(self)

    def _reset(self) -> None:
        self._unread, self._mutex, self._wake = [], threading.Lock(), threading.Event()
        self._thread, self._pid = None, 0

    def add(self, sent: Sent[Any], step: Any) -> None:
        """Read ``sent``'s reply later with ``step`` (its ``done``, or ``failed``)."""
        with self._mutex:
            self._unread.append((sent, step))
            _thread_of_this_process(self, "taskdedup-replies", self.read)
        self._wake.set()  # cheap while the thread sleeps its interval (no one waits on it)

    def read(self) -> None:
        """Read every reply still unread, in the order the calls were written."""
        if not self._unread:  # (read without the lock: the common case, and the thread's)
            return
        with self._mutex:
            batch, self._unread = self._unread, []
        for sent, step in batch:
            try:
                step.done(sent.reply())
            except StoreUnavailable as exc:
                step.failed(exc)
            except Exception:  # a reply that cannot be read must not stop the others
                log.exception("taskdedup: could not read a store reply")

    def stop(self) -> None:
        """Read what is unread and end the thread (a later call written late starts it)."""
        self.read()
        _stop_thread(self)

    def _loop(self) -> None:
        me = threading.current_thread()
        while self._thread is me:
            self._wake.wait()
            if self._thread is not me:
                return
            time.sleep(self.interval)  # the worker's next job usually reads them first
            self._wake.clear()
            self.read()
