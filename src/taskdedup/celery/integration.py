"""``install(app)``: one call that wires taskdedup into a Celery app, idempotently.

The settings are read when the app finalizes, as Celery reads its own (a ``config_from_object``
after ``install()`` counts), and every task's declaration is checked then: ``app.finalize`` is
wrapped, so an error reaches whoever finalized the app (a worker refuses to start) instead of
being logged and dropped by Celery's signal dispatch.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

from celery import signals

from ..background import Heartbeat
from ..core import Deduplicator
from ..errors import ConfigError
from ..idempotency import IdempotencyKeys
from ..reservations import ReservationGuard
from ..settings import Settings
from ..stores import RedisStore, Store
from .beat import BeatSkips, hook_scheduler
from .config import settings_from_app, store_for_app
from .publish import Publisher
from .redis_push import install_hooks
from .revoke import install_revoke_command, on_received, on_revoked
from .worker import Worker, wrap_task


class CeleryDedup:
    """taskdedup's state for one Celery app: settings, store, Deduplicator and hooks."""

    def __init__(self, app: Any, store: Store | None, overrides: dict[str, Any]) -> None:
        self.app = app
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        Settings.load(self.overrides)  # a misspelled argument fails here, at install()
        self._settings: Settings | None = None
        self._store = store
        self._dedup: Deduplicator | None = None
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_pid = 0
        self._fused: bool | None = None
        self._ready = False  # the finalized app's settings were read and its tasks checked
        self._finalizing = False
        self.publisher: Publisher | None = None
        self._mutex = threading.RLock()  # heartbeat() makes the Deduplicator under it
        self.worker = Worker(self)
        self.beat = BeatSkips(self)

    @property
    def settings(self) -> Settings:
        """The settings: ``app.conf.taskdedup_*`` and ``install()``'s arguments, read when the
        app finalizes (or when first needed, if that comes earlier)."""
        if self._settings is None:
            with self._mutex:
                if self._settings is None:
                    self._settings = settings_from_app(self.app, self.overrides)
        return self._settings

    def same_install(self, store: Store | None, overrides: dict[str, Any]) -> bool:
        """Whether a later ``install()`` asks for nothing else: no arguments, or the same."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if store is None and not given:
            return True
        return store is self._store and given == self.overrides

    def finalized(self) -> None:
        """The app is finalized: read the settings (unless a Deduplicator already uses them),
        then check and wrap every task. A bad setting or policy raises one ConfigError;
        until it is fixed, every later ``app.finalize()`` (``app.tasks``) raises it again."""
        with self._mutex:
            if self._ready or self._finalizing:
                return
            self._finalizing = True
            try:
                if self._dedup is None:
                    self._settings = settings_from_app(self.app, self.overrides)
                errors = self._prepare_all()
                if errors:
                    raise ConfigError("\n".join(errors))
                self._ready = True
            finally:
                self._finalizing = False

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
        settings = self.dedup.settings
        return ReservationGuard(
            self.dedup.store, enabled=settings.enabled, dry_run=settings.dry_run
        )

    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat thread (a fresh one in each forked pool child)."""
        if self._heartbeat is None or self._heartbeat_pid != os.getpid():
            with self._mutex:
                if self._heartbeat is None or self._heartbeat_pid != os.getpid():
                    self._heartbeat = Heartbeat(self.dedup)
                    self._heartbeat_pid = os.getpid()
        return self._heartbeat

    def wrap_tasks(self, **_: Any) -> None:
        """Prepare tasks registered after finalize (worker signals; a bad declaration was
        raised at finalize, or is raised when the task is published)."""
        if self.app.finalized:
            self._prepare_all()

    def _prepare_all(self) -> list[str]:
        errors = []
        for task in list(self.app._tasks.values()):
            try:
                self.prepare(task)
            except ConfigError as exc:
                errors.append(str(exc))
        return errors

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

    ``settings`` override ``app.conf.taskdedup_*`` (``TASKDEDUP_*`` variables override both);
    the configuration is read when the app finalizes. Calling it again without arguments or
    with the same ones returns the same integration; with other arguments it is a ConfigError.
    """
    integ = _installed.get(app)
    if integ is not None:
        if integ.same_install(store, settings):
            return integ
        raise ConfigError(
            f"install() was already called for app {app.main!r} with other arguments; "
            "call it once per app, with all of its settings (or set app.conf.taskdedup_*)"
        )
    integ = CeleryDedup(app, store, settings)
    _installed[app] = integ
    install_hooks()
    hook_scheduler(integration_for)
    integ.publisher = Publisher(integ, app.send_task)
    app.send_task = integ.publisher
    _hook_finalize(app, integ)
    if app.finalized:
        integ.finalized()
    for ready in (signals.worker_init, signals.worker_process_init, signals.celeryd_after_setup):
        ready.connect(integ.wrap_tasks, weak=False)  # tasks registered after finalize
    signals.task_revoked.connect(integ.revoked, weak=False)
    signals.task_received.connect(integ.received, weak=False)
    install_revoke_command()  # an ETA job a worker holds frees its key when it is revoked
    return integ


def _hook_finalize(app: Any, integ: CeleryDedup) -> None:
    """Run ``integ.finalized()`` at the end of every ``app.finalize()``, outside Celery's
    signal dispatch (which would log a ConfigError and carry on)."""
    original = app.finalize

    @functools.wraps(original)
    def finalize(auto: bool = False) -> None:
        original(auto)
        integ.finalized()

    app.finalize = finalize


def integration_for(app: Any) -> CeleryDedup | None:
    return _installed.get(app)
