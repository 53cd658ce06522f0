"""What an adapter's state offers beside its Deduplicator: the idempotency keys and the
reservation guard, each made on first use over the same store and settings."""

from __future__ import annotations

import functools

from .core import Deduplicator
from .idempotency import IdempotencyKeys
from .reservations import ReservationGuard


class Features:
    """Mixed into an adapter's state, which provides :attr:`dedup`."""

    @property
    def dedup(self) -> Deduplicator:
        raise NotImplementedError

    @functools.cached_property
    def idempotency(self) -> IdempotencyKeys:
        return IdempotencyKeys(self.dedup)

    @functools.cached_property
    def reservations(self) -> ReservationGuard:
        return ReservationGuard.under(self.dedup.store, self.dedup.settings)
