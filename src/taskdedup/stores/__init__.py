"""Lock stores: the protocol, an in-memory store, and the Redis, PostgreSQL and SQLite stores
(each imported when first asked for).

:func:`from_url` builds any of them from its URL; an adapter asks a store what it can do by
protocol (:func:`sends_early`, :func:`pushes_with_lock`), never by its class.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import urlsplit

from ..errors import ConfigError
from .base import PushesWithLock, SendsEarly, Store
from .memory import MemoryStore

if TYPE_CHECKING:
    from .postgres import PostgresStore
    from .redis import RedisStore
    from .sqlite import SqliteStore

__all__ = [
    "MemoryStore",
    "PostgresStore",
    "RedisStore",
    "SqliteStore",
    "Store",
    "from_url",
    "pushes_with_lock",
    "sends_early",
]

#: The URL schemes :func:`from_url` knows, and the store each one makes.
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")
POSTGRES_SCHEMES = ("postgresql", "postgres")
SCHEMES = (*REDIS_SCHEMES, *POSTGRES_SCHEMES, "sqlite", "memory")


def from_url(url: str, **options: Any) -> Store:
    """The store for ``url``: ``memory://`` (one process), Redis (``redis://``,
    ``rediss://``, ``unix://``, ``redis+cluster://``, ``redis+sentinel://``), PostgreSQL
    (``postgresql://``) or SQLite (``sqlite:///path.db``). ``options`` are the store's own
    (``key_prefix``, ``history``, a Redis client's options)."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return MemoryStore(**options)
    if scheme in REDIS_SCHEMES:
        from .redis import RedisStore

        return RedisStore.from_url(url, **options)
    if scheme in POSTGRES_SCHEMES:
        try:
            from .postgres import PostgresStore
        except ImportError as exc:
            raise ConfigError(
                f"the store url {url!r} needs psycopg 3: pip install 'taskdedup[postgres]'"
            ) from exc
        return PostgresStore.from_url(url, **options)
    if scheme == "sqlite":
        from .sqlite import SqliteStore

        return SqliteStore.from_url(url, **options)
    raise ConfigError(
        f"unsupported store url {url!r}: use one of " + ", ".join(f"{s}://" for s in SCHEMES)
    )


_capabilities: weakref.WeakKeyDictionary[Store, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def _capabilities_of(store: Store) -> tuple[bool, bool]:
    try:
        found = _capabilities.get(store)
    except TypeError:  # a store that cannot be a weak key (unhashable): asked each time
        return isinstance(store, SendsEarly), isinstance(store, PushesWithLock)
    if found is None:  # (a protocol check is slow-ish: once per store)
        found = _capabilities[store] = (
            isinstance(store, SendsEarly),
            isinstance(store, PushesWithLock),
        )
    return found


def sends_early(store: Store) -> TypeGuard[SendsEarly]:
    """Whether ``store`` can write an operation now and read its reply later."""
    return _capabilities_of(store)[0]


def pushes_with_lock(store: Store) -> TypeGuard[PushesWithLock]:
    """Whether ``store`` can take a lock and push a message in one atomic step."""
    return _capabilities_of(store)[1]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    if name == "PostgresStore":
        from .postgres import PostgresStore

        return PostgresStore
    if name == "SqliteStore":
        from .sqlite import SqliteStore

        return SqliteStore
    raise AttributeError(name)
