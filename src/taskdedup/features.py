"""What an adapter's state offers beside its Deduplicator: the idempotency keys and the
reservation guard, each made on first use over the same store and settings."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .core import Deduplicator
from .errors import ConfigError
from .idempotency import IdempotencyKeys
from .policy import TaskPolicy
from .reservations import ReservationGuard
from .settings import Settings
from .startup import announce
from .stores.base import Store


class Features:
    """Mixed into an adapter's state, which provides :attr:`dedup` (made from ``_store``)."""

    #: The attributes an adapter's state makes from its store, its own or its parts' ("a.b"):
    #: each is made again when None.
    made_from_store: tuple[str, ...] = ("_dedup",)
    _store: Store | None

    @property
    def dedup(self) -> Deduplicator:
        raise NotImplementedError

    def new_dedup(
        self, store: Store, settings: Settings, listener: Callable[[Any], None]
    ) -> Deduplicator:
        """A Deduplicator on ``store`` whose decisions go to ``listener`` (the framework's
        signals or callbacks), announced by the startup line with the policies bound so far."""
        dedup = Deduplicator(store, settings)
        dedup.listeners.add(listener)
        announce(settings, store, self.bound_policies())
        return dedup

    def bound_policies(self, *, strict: bool = False) -> dict[str, TaskPolicy]:
        """The bound policies of the tasks known so far, by task name (the startup line, the
        CLI, check_policies). ``strict``: a bad declaration raises its ConfigError; else it is
        left out (it is reported where the task is checked)."""
        found = {}
        for name, bind in self.policy_sources(strict):
            try:
                policy = bind()
            except ConfigError:
                if strict:
                    raise
                continue
            if policy is not None:
                found[name] = policy
        return found

    def check_declarations(self) -> None:
        """Bind every known task's declaration now, as the app or broker starts: a bad one
        (a task declared before taskdedup was added to its broker, say) is a ConfigError
        here, so a worker refuses to start, not at the task's first submission."""
        self.bound_policies(strict=True)

    def policy_sources(self, strict: bool) -> Iterable[tuple[str, Callable[[], TaskPolicy | None]]]:
        """Each known task's name and how to bind its policy (the adapter's part)."""
        return ()

    @functools.cached_property
    def idempotency(self) -> IdempotencyKeys:
        return IdempotencyKeys(self.dedup)

    @functools.cached_property
    def reservations(self) -> ReservationGuard:
        return ReservationGuard.under(self.dedup.store, self.dedup.settings)

    def use_store(self, store: Store) -> Callable[[], None]:
        """Work on ``store`` from now until the returned function is called, which puts the
        store back as it was (the pytest plugin: one store per test, for an app or a broker
        that lives across tests). What was made from the store is made again from ``store``."""
        cached = ("idempotency", "reservations")
        saved = {path: _get(self, path) for path in ("_store", *self.made_from_store)}
        kept = {name: self.__dict__.pop(name) for name in cached if name in self.__dict__}
        for path in self.made_from_store:
            _set(self, path, None)
        self._store = store

        def restore() -> None:
            for path in self.made_from_store:
                _close(_get(self, path))
            for path, value in saved.items():
                _set(self, path, value)
            for name in cached:
                self.__dict__.pop(name, None)
            self.__dict__.update(kept)

        return restore


def _get(owner: Any, path: str) -> Any:
    """The attribute at ``path`` ("_dedup", or "worker._heartbeat" on a part of ``owner``)."""
    for name in path.split("."):
        owner = getattr(owner, name)
    return owner


def _set(owner: Any, path: str, value: Any) -> None:
    *parts, name = path.split(".")
    for part in parts:
        owner = getattr(owner, part)
    setattr(owner, name, value)


def _close(made: Any) -> None:
    """Stop what a store's user runs in the background (a Deduplicator, a heartbeat); the
    stop of an asyncio heartbeat cannot be awaited here (its loop is the test's, gone)."""
    for method in ("close", "stop"):
        stop = getattr(made, method, None)
        if callable(stop):
            result = stop()
            if inspect.iscoroutine(result):
                result.close()
            return
