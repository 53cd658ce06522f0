"""One copy of a multi-step store conversation for sync and asyncio callers.

A *flow* is a generator that yields what it needs done, a store operation (answered with its
reply, or with the store's exception thrown into the flow) or a :class:`Pause`, and returns its
result. :func:`drive` runs it with blocking calls (Celery), :func:`adrive` from asyncio
(taskiq): the rules are written once, in the flow. Anything else a flow yields goes to the
driver's ``act`` (a planned decision, a request for the framework), answered the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from .decide import Step
from .stores.base import Op, Store

T = TypeVar("T")
Flow = Generator[Any, Any, T]  # yields an Op, a Pause, or what the driver's ``act`` takes


@dataclasses.dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` before the flow goes on."""

    seconds: float


def drive(flow: Flow[T], store: Store, act: Callable[[Any], Any] | None = None) -> T:
    """Run ``flow`` with blocking store calls and sleeps."""
    try:
        step = next(flow)
        while True:
            if isinstance(step, Pause):
                time.sleep(step.seconds)
                step = flow.send(None)
                continue
            try:
                reply = store.run(step) if act is None or isinstance(step, Op) else act(step)
            except Exception as exc:
                step = flow.throw(exc)
            else:
                step = flow.send(reply)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def adrive(
    flow: Flow[T], store: Store, act: Callable[[Any], Awaitable[Any]] | None = None
) -> T:
    """Run ``flow`` from asyncio: store calls awaited, pauses without blocking the loop."""
    try:
        step = next(flow)
        while True:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
                step = flow.send(None)
                continue
            try:
                if act is None or isinstance(step, Op):
                    reply = await store.arun(step)
                else:
                    reply = await act(step)
            except Exception as exc:
                step = flow.throw(exc)
            else:
                step = flow.send(reply)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def ask(plan: T | Step[T]) -> Flow[T]:
    """The answer of a planned decision (the driver runs the Step), or the decision itself
    when planning settled it without the store."""
    if isinstance(plan, Step):
        answer: T = yield plan
        return answer
    return plan
