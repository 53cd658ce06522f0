"""``DedupMiddleware``: one taskiq middleware for both sides of a broker.

broker = ListQueueBroker(url).with_middlewares(DedupMiddleware())

The producer side (``pre_send`` and the wrapped kick) lives in ``producer.py``, the worker side
(``pre_execute``, ``on_error``, ``post_execute``) in ``worker.py``; this module holds the settings,
the store and the Deduplicator they share.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from taskiq.abc.middleware import TaskiqMiddleware
from taskiq.message import TaskiqMessage
from taskiq.result import TaskiqResult

from ..core import Deduplicator
from ..errors import ConfigError
from ..idempotency import IdempotencyKeys
from ..reservations import ReservationGuard
from ..settings import Settings
from ..stores import MemoryStore, RedisStore, Store
from .options import Policies
from .producer import Producer
from .worker import Worker

if TYPE_CHECKING:
    from taskiq.abc.broker import AsyncBroker


class DedupMiddleware(TaskiqMiddleware):
    """Deduplicates the tasks of one broker that declare a policy.

    ``store_or_url``: a :class:`~taskdedup.Store`, or a store URL (``redis://...``,
    ``memory://``); by default ``TASKDEDUP_URL``, else the broker's own Redis (taskiq-redis
    brokers), else an in-memory store for ``InMemoryBroker``. ``settings`` are the
    :class:`~taskdedup.Settings` fields (``enabled``, ``dry_run``, ``default_ttl``, ...);
    ``TASKDEDUP_*`` environment variables win over them.
    """

    def __init__(self, store_or_url: Store | str | None = None, **settings: Any) -> None:
        super().__init__()
        values = dict(settings)
        if isinstance(store_or_url, str):
            values.setdefault("url", store_or_url)
        self.settings = Settings.load(values)
        self._store = store_or_url if isinstance(store_or_url, Store) else None
        self._dedup: Deduplicator | None = None
        self.policies = Policies(self.settings)
        self.producer = Producer(self)
        self.worker = Worker(self)

    def set_broker(self, broker: AsyncBroker) -> None:
        super().set_broker(broker)
        self.producer.install(broker)
        self.worker.resender.watch(broker)  # a stopping worker sends its waiting copies at once

    @functools.cached_property
    def idempotency(self) -> IdempotencyKeys:
        return IdempotencyKeys(self.dedup)

    @functools.cached_property
    def reservations(self) -> ReservationGuard:
        settings = self.dedup.settings
        return ReservationGuard(
            self.dedup.store, enabled=settings.enabled, dry_run=settings.dry_run
        )

    @property
    def dedup(self) -> Deduplicator:
        """The Deduplicator, made on first use (so a bad URL fails where it is used)."""
        if self._dedup is None:
            self._dedup = Deduplicator(self._store or self._default_store(), self.settings)
        return self._dedup

    def _default_store(self) -> Store:
        url, prefix = self.settings.url, self.settings.key_prefix
        if url is not None:
            if url.startswith("memory://"):
                return MemoryStore(key_prefix=prefix)
            return RedisStore.from_url(url, key_prefix=prefix)
        pool = getattr(self.broker, "connection_pool", None)
        if pool is not None and type(pool).__module__.startswith("redis.asyncio"):
            return RedisStore.from_url(_url_of(pool), key_prefix=prefix)
        from taskiq import InMemoryBroker

        if isinstance(self.broker, InMemoryBroker):
            return MemoryStore(key_prefix=prefix)
        raise ConfigError(
            f"taskdedup needs a store and the broker ({type(self.broker).__name__}) is not "
            "a taskiq-redis one: pass DedupMiddleware('redis://...') or set TASKDEDUP_URL "
            "(or memory:// for a single process)"
        )

    # ------------------------------------------------------------------ taskiq hooks

    async def shutdown(self) -> None:
        await self.worker.close()
        if self._dedup is not None:
            await asyncio.to_thread(self._dedup.close)  # flush pending confirmations

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        return await self.producer.pre_send(message)

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        return await self.worker.pre_execute(message)

    def on_error(
        self, message: TaskiqMessage, result: TaskiqResult[Any], exception: BaseException
    ) -> None:
        self.worker.on_error(message, exception)

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        await self.worker.post_execute(message, result)


def _url_of(pool: Any) -> str:
    """The URL of a taskiq-redis broker's server (the broker keeps only its pool's settings)."""
    kw = pool.connection_kwargs
    auth = ""
    if kw.get("password"):
        auth = f"{quote(kw.get('username') or '')}:{quote(kw['password'])}@"
    elif kw.get("username"):
        auth = f"{quote(kw['username'])}@"
    db = int(kw.get("db") or 0)
    if kw.get("path"):
        return f"unix://{auth}{kw['path']}?db={db}"
    scheme = "rediss" if "SSL" in pool.connection_class.__name__ else "redis"
    return f"{scheme}://{auth}{kw.get('host') or 'localhost'}:{kw.get('port') or 6379}/{db}"
