"""taskdedup: make Celery and taskiq jobs safe to submit twice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .background import AsyncHeartbeat, Heartbeat
from .cancel import raise_if_superseded, superseded
from .core import Deduplicator
from .decide import Admission, Completion, Ticket
from .errors import (
    ConfigError,
    CorruptRecord,
    DedupError,
    DuplicateJob,
    IdempotencyKeyInProgress,
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    KeyEncodingError,
    PayloadTooLarge,
    QuotaExceeded,
    StoreUnavailable,
    Superseded,
)
from .idempotency import IdempotencyKeys, Recall
from .pacing import PacePolicy, Pacer
from .policy import Policy, TaskPolicy
from .reservations import Reservation, ReservationGuard, ReservePolicy
from .settings import Settings
from .stores import MemoryStore, Store
from .transactions import atransaction, transaction

if TYPE_CHECKING:
    from .stores.postgres import PostgresStore
    from .stores.redis import RedisStore
    from .stores.sqlite import SqliteStore

__all__ = [
    "Admission",
    "AsyncHeartbeat",
    "Completion",
    "ConfigError",
    "CorruptRecord",
    "DedupError",
    "Deduplicator",
    "DuplicateJob",
    "Heartbeat",
    "IdempotencyKeyInProgress",
    "IdempotencyKeyMismatch",
    "IdempotencyKeys",
    "InvalidIdempotencyKey",
    "KeyEncodingError",
    "MemoryStore",
    "PacePolicy",
    "Pacer",
    "PayloadTooLarge",
    "Policy",
    "PostgresStore",
    "QuotaExceeded",
    "Recall",
    "RedisStore",
    "Reservation",
    "ReservationGuard",
    "ReservePolicy",
    "Settings",
    "SqliteStore",
    "Store",
    "StoreUnavailable",
    "Superseded",
    "TaskPolicy",
    "Ticket",
    "atransaction",
    "raise_if_superseded",
    "superseded",
    "transaction",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``RedisStore``, ``PostgresStore`` and ``SqliteStore`` are imported on first use:
    ``import taskdedup`` does not load redis-py (about 170 ms) or psycopg for a user of the
    memory store or of the core alone."""
    if name in ("RedisStore", "PostgresStore", "SqliteStore"):
        from . import stores

        return getattr(stores, name)
    raise AttributeError(f"module 'taskdedup' has no attribute {name!r}")
