"""What the two sides of one taskiq broker share: the settings, the store, the Deduplicator
and the declared policies. ``DedupMiddleware`` adds the producer and the worker on top.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

from taskiq.abc.middleware import TaskiqMiddleware

from ..callbacks import Callbacks
from ..core import Deduplicator
from ..errors import ConfigError
from ..features import Features
from ..policy import TaskPolicy
from ..settings import Settings
from ..stores import Store, from_url
from .options import Policies, declared


class DedupState(TaskiqMiddleware, Features, Callbacks):
    """What both sides of one broker share: settings, store, Deduplicator, policies (the
    arguments are :class:`~taskdedup.taskiq.DedupMiddleware`'s)."""

    def __init__(self, store_or_url: Store | str | None = None, **settings: Any) -> None:
        super().__init__()
        values = dict(settings)
        if isinstance(store_or_url, str):
            values.setdefault("url", store_or_url)
        self.settings = Settings.load(values)
        self._store = store_or_url if isinstance(store_or_url, Store) else None
        self._dedup: Deduplicator | None = None
        self.policies = Policies(self.settings)

    @property
    def dedup(self) -> Deduplicator:
        """The Deduplicator, made on first use (so a bad URL fails where it is used)."""
        if self._dedup is None:
            store = self._store or self._default_store()
            self._dedup = self.new_dedup(store, self.settings, self._tell)
        return self._dedup

    def policy_sources(self, strict: bool) -> Iterable[tuple[str, Callable[[], Any]]]:
        """The broker's tasks, each with how to bind its policy (``strict``: its declaration
        and labels checked first)."""
        tasks: dict[str, Any] = getattr(getattr(self, "broker", None), "get_all_tasks", dict)()
        return [(name, functools.partial(self._bind, task, strict)) for name, task in tasks.items()]

    def _bind(self, task: Any, strict: bool) -> TaskPolicy | None:
        if strict:
            self.policies.check(task)
        return self.policies.resolve(task, declared(task), ())

    def _default_store(self) -> Store:
        url, told = self.settings.url, self.settings.store_options()
        if url is not None:
            return from_url(url, **told)
        pool = getattr(self.broker, "connection_pool", None)
        if pool is not None and type(pool).__module__.startswith("redis.asyncio"):
            return from_url(_url_of(pool), **told)
        from taskiq import InMemoryBroker

        if isinstance(self.broker, InMemoryBroker):
            return from_url("memory://", **told)
        raise ConfigError(
            f"taskdedup needs a store and the broker ({type(self.broker).__name__}) is not "
            "a taskiq-redis one: pass DedupMiddleware('redis://...') or set TASKDEDUP_URL "
            "(or memory:// for a single process)"
        )


def _url_of(pool: Any) -> str:
    """The URL of a taskiq-redis broker's server (the broker keeps only its pool's settings)."""
    kw = pool.connection_kwargs
    user, password = quote(kw.get("username") or ""), kw.get("password")
    auth = f"{user}:{quote(password)}@" if password else f"{user}@" if user else ""
    db = int(kw.get("db") or 0)
    if kw.get("path"):
        return f"unix://{auth}{kw['path']}?db={db}"
    scheme = "rediss" if "SSL" in pool.connection_class.__name__ else "redis"
    return f"{scheme}://{auth}{kw.get('host') or 'localhost'}:{kw.get('port') or 6379}/{db}"
