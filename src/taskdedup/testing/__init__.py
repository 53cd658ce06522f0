"""Helpers for testing code that uses taskdedup."""

from __future__ import annotations

from .clock import FakeClock

__all__ = ["FakeClock"]
