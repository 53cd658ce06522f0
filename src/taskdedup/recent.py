"""Keys this process saw held lately, so an adapter can ask about a likely duplicate before it
builds a message.

Both adapters take a fresh key's lock inside the broker's push when they can (one round trip),
which means a duplicate is found only after the message was built and serialized. A key seen
held a moment ago is likely still held (a double-click, a retried CI step), so for those the
adapter asks the store first: a duplicate then costs one round trip and little else. This is a
guess about speed only: every answer still comes from the store.
"""

from __future__ import annotations

import time

from .decide import Ticket

RECENT_SECONDS = 10.0
RECENT_KEYS = 10_000


class RecentKeys:
    """A bounded map of key -> until when it counts as recently held."""

    def __init__(self, seconds: float = RECENT_SECONDS, size: int = RECENT_KEYS) -> None:
        self.seconds = seconds
        self.size = size
        self._until: dict[str, float] = {}

    def note(self, ticket: Ticket) -> None:
        """Remember a key that was just taken or found held."""
        if ticket.key is None or not (ticket.acquired or ticket.outcome == "duplicate"):
            return
        self.mark(ticket.key)

    def mark(self, key: str) -> None:
        """Remember ``key`` as held now."""
        if len(self._until) >= self.size:
            self._until.clear()
        self._until[key] = time.monotonic() + self.seconds

    def seen(self, key: str) -> bool:
        """Whether ``key`` was taken or found held within the last ``seconds``."""
        until = self._until.get(key)
        return until is not None and until >= time.monotonic()
