"""Helpers for testing code that uses taskdedup (the pytest plugin's fixtures are in
``taskdedup.testing.plugin``; ``pip install 'taskdedup[pytest]'`` registers it)."""

from __future__ import annotations

from .clock import FakeClock
from .helpers import (
    aassert_idempotent,
    assert_deduplicated,
    assert_idempotent,
    assert_not_deduplicated,
    check_policies,
    crash,
    deliver,
)

__all__ = [
    "FakeClock",
    "aassert_idempotent",
    "assert_deduplicated",
    "assert_idempotent",
    "assert_not_deduplicated",
    "check_policies",
    "crash",
    "deliver",
]
