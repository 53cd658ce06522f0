"""A clock you move by hand, for :class:`~taskdedup.MemoryStore` (``MemoryStore(clock=...)``)."""

from __future__ import annotations

import threading


class FakeClock:
    """Returns seconds like ``time.time``, but only moves when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._mutex = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        with self._mutex:
            self._now += seconds
