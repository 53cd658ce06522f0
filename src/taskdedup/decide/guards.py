"""A guard key an enqueue also takes, for a caller that passes through an adapter's publish.

:mod:`taskdedup.compat` publishes through the Celery adapter like any task, and wants the
peer library's lock key taken in the same atomic step as taskdedup's lock (one round trip
instead of two). It says so with :func:`guarding` around its publish; the enqueue planned
inside it (:func:`~taskdedup.decide.enqueue.plan_enqueue`) carries the
:class:`~taskdedup.stores.base.Guard` on its :class:`~taskdedup.stores.base.Acquire`, marks it
used, and answers a guard that is not ours by raising :class:`GuardHeld` or
:class:`GuardFree`, which the caller catches. No adapter reads or passes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from ..stores.base import Guard


@dataclasses.dataclass(slots=True)
class Guarding:
    """The guard of the enqueue in progress, and whether an acquire carried it."""

    guard: Guard
    used: bool = False


_GUARDING: contextvars.ContextVar[Guarding | None] = contextvars.ContextVar(
    "taskdedup_guarding", default=None
)


@contextlib.contextmanager
def guarding(guard: Guard) -> Iterator[Guarding]:
    """The enqueue planned inside this block also takes ``guard`` (once: the first acquire)."""
    state = Guarding(guard)
    token = _GUARDING.set(state)
    try:
        yield state
    finally:
        _GUARDING.reset(token)


def current_guard() -> Guard | None:
    """The guard for an acquire planned now: that of the block, until an acquire carrying it
    was answered (a plan made and dropped before it ran leaves it to the next; an enqueue
    after it, from an eager run's body, takes none)."""
    state = _GUARDING.get()
    return None if state is None or state.used else state.guard


def guard_answered() -> None:
    """The acquire that carried the block's guard was answered (or met a store that is down)."""
    state = _GUARDING.get()
    if state is not None:
        state.used = True


class GuardHeld(Exception):
    """The guard key is another's: nothing was taken or published. ``answer``: its remaining
    ms or its value (as the guard asked)."""

    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.answer = answer


class GuardFree(Exception):
    """The guard key was free but taskdedup's lock is ``holder``'s: nothing was taken or
    published (the caller decides the usual way, apart)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder
