"""taskdedup: make Celery and taskiq jobs safe to submit twice."""

from __future__ import annotations

from .background import AsyncHeartbeat, Heartbeat
from .core import Admission, Completion, Deduplicator, Ticket
from .errors import (
    ConfigError,
    DedupError,
    DuplicateJob,
    IdempotencyKeyMismatch,
    KeyEncodingError,
    QuotaExceeded,
    StoreUnavailable,
)
from .policy import Policy, TaskPolicy
from .settings import Settings
from .stores import MemoryStore, RedisStore, Store

__all__ = [
    "Admission",
    "AsyncHeartbeat",
    "Completion",
    "ConfigError",
    "DedupError",
    "Deduplicator",
    "DuplicateJob",
    "Heartbeat",
    "IdempotencyKeyMismatch",
    "KeyEncodingError",
    "MemoryStore",
    "Policy",
    "QuotaExceeded",
    "RedisStore",
    "Settings",
    "Store",
    "StoreUnavailable",
    "TaskPolicy",
    "Ticket",
]

__version__ = "0.1.0"
