"""A planned decision: the store operation to run and how to read its reply.

Planning does no I/O: a plan names the operation and two pure readers, one for the reply and
one for a store that could not answer. A runner (``taskdedup.core.Deduplicator``) executes it,
synchronously or from asyncio, so both adapters share one copy of every rule. What a decision
wants logged and counted goes to the ``Notes`` sink the runner hands to the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ..errors import StoreUnavailable
from ..settings import Settings
from ..stores.base import Op

T = TypeVar("T")


class Notes(Protocol):
    """Where a decision is logged and counted: ``decision.outcome`` at ``level`` for ``task``."""

    def __call__(
        self, decision: str, outcome: str, level: int, task: str, **fields: Any
    ) -> None: ...


@dataclasses.dataclass(slots=True)
class Step(Generic[T]):
    """A planned decision: the store operation to run, how to read its reply, and what to do
    if the store is down. An adapter with a faster way to run ``op`` (the Celery adapter
    fuses an enqueue's acquire with the broker's push) runs it itself and calls ``done``,
    unless ``waits`` says that reply is not final yet: then it runs the Step as usual.

    ``waits``: for a reply that is not an answer yet (the key's holder is still being
    published, and may yet fail), the seconds to wait before asking again with ``again``;
    None for a final reply. The runners ask for a while at most, then take the last reply
    as it is.

    ``answer_now``: for a decision whose reply only feeds the notes (a finish that cannot
    hand a run on), the answer to act on at once: a runner may then write ``op`` now and read
    its reply later, so the caller does not wait a round trip for it."""

    op: Op[Any]
    done: Callable[[Any], T]
    failed: Callable[[StoreUnavailable], T]
    waits: Callable[[Any], float | None] | None = None
    again: Op[Any] | None = None
    answer_now: Callable[[], T] | None = None


def active(settings: Settings, task: str) -> bool:
    """Whether taskdedup decides anything for ``task`` (the kill switch and disabled_tasks)."""
    return settings.enabled and task not in settings.disabled_tasks
