"""Lock stores: the protocol, an in-memory store and a Redis store (imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Store
from .memory import MemoryStore

if TYPE_CHECKING:
    from .redis import RedisStore

__all__ = ["MemoryStore", "RedisStore", "Store"]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis import RedisStore

        return RedisStore
    raise AttributeError(name)
