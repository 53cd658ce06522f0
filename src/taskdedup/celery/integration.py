"""``install(app)``: one call that wires taskdedup into a Celery app, idempotently."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

from celery import signals

from ..background import Heartbeat
from ..core import Deduplicator
from ..idempotency import IdempotencyKeys
from ..reservations import ReservationGuard
from ..stores import RedisStore, Store
from .config import settings_from_app, store_for_app
from .publish import Publisher
from .redis_push import install_hooks
from .revoke import install_revoke_command, on_received, on_revoked
from .worker import Worker, wrap_task


class CeleryDedup:
    """taskdedup's state for one Celery app: settings, store, Deduplicator and hooks."""

    def __init__(self, app: Any, store: Store | None, overrides: dict[str, Any]) -> None:
        self.app = app
        self.settings = settings_from_app(app, overrides)
        self._store = store
        self._dedup: Deduplicator | None = None
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_pid = 0
        self._fused: bool | None = None
        self.publisher: Publisher | None = None
        self._mutex = threading.RLock()  # heartbeat() makes the Deduplicator under it
        self.worker = Worker(self)

    @property
    def dedup(self) -> Deduplicator:
        """The Deduplicator, made on first use (so a bad URL fails where it is used)."""
        if self._dedup is None:
            with self._mutex:
                if self._dedup is None:
                    store = self._store or store_for_app(self.app, self.settings)
                    self._dedup = Deduplicator(store, self.settings)
        return self._dedup

    @property
    def fused_publish(self) -> bool:
        """Whether a fresh key's lock is taken in the broker's own push (one round trip):
        the store was made from the broker's URL and the broker is kombu's Redis transport."""
        if self._fused is None:
            from kombu.transport.redis import Transport

            store = self.dedup.store
            self._fused = (
                isinstance(store, RedisStore)
                and store.url is not None
                and store.url == self.app.conf.broker_url
                and not self.settings.dry_run
                and isinstance(self.app.connection_for_write().transport, Transport)
            )
        return self._fused

    @functools.cached_property
    def idempotency(self) -> IdempotencyKeys:
        return IdempotencyKeys(self.dedup)

    @functools.cached_property
    def reservations(self) -> ReservationGuard:
        return ReservationGuard(self.dedup.store)

    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat thread (a fresh one in each forked pool child)."""
        if self._heartbeat is None or self._heartbeat_pid != os.getpid():
            with self._mutex:
                if self._heartbeat is None or self._heartbeat_pid != os.getpid():
                    self._heartbeat = Heartbeat(self.dedup)
                    self._heartbeat_pid = os.getpid()
        return self._heartbeat

    def wrap_tasks(self, **_: Any) -> None:
        for task in list(self.app.tasks.values()):
            self.prepare(task)

    def prepare(self, task: Any) -> None:
        """Wrap a deduplicated task's ``run`` (worker side) and ``apply_async`` (fast answers
        for likely duplicates); other tasks are left untouched."""
        wrap_task(self, task)
        if self.publisher is not None:
            self.publisher.wrap_apply_async(task)

    def revoked(
        self,
        sender: Any = None,
        request: Any = None,
        terminated: bool = False,
        expired: bool = False,
        **_: Any,
    ) -> None:
        """``task_revoked``: a discarded, expired or terminated job frees its key and slot."""
        if request is not None:
            why = "terminated" if terminated else "expired" if expired else "revoked"
            on_revoked(self, sender, request, why)

    def received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """``task_received``: a job that expires before its ETA frees its key and slot now."""
        if request is not None:
            on_received(self, sender, request)


_installed: weakref.WeakKeyDictionary[Any, CeleryDedup] = weakref.WeakKeyDictionary()


def install(app: Any, store: Store | None = None, **settings: Any) -> CeleryDedup:
    """Wire taskdedup into ``app``: every publish path and every end of a job on the worker.

    ``settings`` override ``app.conf.taskdedup_*`` (``TASKDEDUP_*`` variables override both).
    Calling it again returns the same integration and changes nothing.
    """
    integ = _installed.get(app)
    if integ is not None:
        return integ
    integ = CeleryDedup(app, store, settings)
    _installed[app] = integ
    install_hooks()
    integ.publisher = Publisher(integ, app.send_task)
    app.send_task = integ.publisher
    if app.finalized:
        integ.wrap_tasks()
    else:
        app.on_after_finalize.connect(integ.wrap_tasks, weak=False)
    for ready in (signals.worker_init, signals.worker_process_init, signals.celeryd_after_setup):
        ready.connect(integ.wrap_tasks, weak=False)  # tasks registered after finalize
    signals.task_revoked.connect(integ.revoked, weak=False)
    signals.task_received.connect(integ.received, weak=False)
    install_revoke_command()  # an ETA job a worker holds frees its key when it is revoked
    return integ


def integration_for(app: Any) -> CeleryDedup | None:
    return _installed.get(app)
