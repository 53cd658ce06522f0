"""taskdedup's state for one Celery app: its settings, store, Deduplicator and helpers, and
the registry of installed apps. The parts that hook into Celery (publisher, worker, revoke,
beat) each take this state; ``integration.install`` wires them together.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..background import Heartbeat
from ..core import Deduplicator
from ..errors import ConfigError
from ..features import Features
from ..settings import Settings
from ..stores import Store, pushes_with_lock, sends_early
from . import signals
from .config import settings_from_app, store_for_app
from .redis_push import hook_send_task_message, install_hooks
from .tasks import task_policy

log = logging.getLogger("taskdedup")


class Handles(Protocol):
    """The publisher, as the other parts see it: it makes the handle of an existing job, and
    maps what a call took to Celery (the holder's handle, or the publish)."""

    def existing(
        self, job_id: str, options: dict[str, Any], *, deduplicated: bool = False, hit: bool = False
    ) -> Any: ...

    @property
    def answer(self) -> Callable[..., Any]:
        """(taken, call, publish, name, args, kwargs, options): the holder's handle, or the
        publish (see publish.Publisher.answer)."""


class CeleryDedup(Features):
    """taskdedup's state for one Celery app: settings, store, Deduplicator and hooks."""

    made_from_store = ("_dedup", "_heartbeat", "_fused", "_early")

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
        self._early: bool | None = None
        self._ready = False  # the finalized app's settings were read and its tasks checked
        self._finalizing = False
        self.publisher: Handles | None = None
        #: what prepares each task for taskdedup (wraps its run and apply_async): set by install()
        self.preparers: list[Callable[[Any], None]] = []
        self._mutex = threading.RLock()  # heartbeat() makes the Deduplicator under it

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
                    self._dedup = self.new_dedup(store, self.settings, signals.send)
        return self._dedup

    def policy_sources(self, strict: bool) -> Iterable[tuple[str, Callable[[], Any]]]:
        """The app's tasks so far, each with how to bind its policy."""
        settings = self.settings
        return [
            (t.name, functools.partial(task_policy, t, settings)) for t in self.app._tasks.values()
        ]

    @property
    def fused_publish(self) -> bool:
        """Whether a fresh key's lock is taken in the broker's own push (one round trip):
        ``fused_publish`` is on, the store was made from the broker's URL and the broker is
        kombu's Redis transport. Only then is kombu's ``Channel._put`` hooked."""
        if self._fused is None:
            from kombu.transport.redis import Transport

            store = self.dedup.store
            fused = (
                self.settings.fused_publish
                and pushes_with_lock(store)
                and getattr(store, "url", None) is not None
                and getattr(store, "url", None) == self.app.conf.broker_url
                and not self.settings.dry_run
                and isinstance(self.app.connection_for_write().transport, Transport)
            )
            if fused:
                install_hooks()  # before any thread can see the answer
            self._fused = fused
        return self._fused

    @property
    def sends_early(self) -> bool:
        """Whether an enqueue that is not fused writes its acquire before Celery builds the
        message and reads the reply just before the publish (a Redis store; see redis_push)."""
        if self._early is None:
            with self._mutex:  # hooked before any thread can see the answer
                early = sends_early(self.dedup.store) and not self.fused_publish
                if early:
                    hook_send_task_message(self.app.amqp)
                self._early = early
        return self._early

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
        for prepare in self.preparers:
            prepare(task)


_installed: weakref.WeakKeyDictionary[Any, CeleryDedup] = weakref.WeakKeyDictionary()


def integration_for(app: Any) -> CeleryDedup | None:
    return _installed.get(app)
