"""One copy of a multi-step store conversation for sync and asyncio callers.

A *flow* is a generator that yields what it needs done, a store operation (answered with its
reply, or with the store's exception thrown into the flow) or a :class:`Pause`, and returns its
result. :func:`drive` runs it with blocking calls (Celery), :func:`adrive` from asyncio
(taskiq): the rules are written once, in the flow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Generator
from typing import Any, TypeVar

from .stores.base import Op, Store

T = TypeVar("T")
Flow = Generator["Op[Any] | Pause", Any, T]


@dataclasses.dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` before the flow goes on."""

    seconds: float


def drive(flow: Flow[T], store: Store) -> T:
    """Run ``flow`` with blocking store calls and sleeps."""
    try:
        step = next(flow)
        while True:
            if isinstance(step, Pause):
                time.sleep(step.seconds)
                step = flow.send(None)
                continue
            try:
                reply = store.run(step)
            except Exception as exc:
                step = flow.throw(exc)
            else:
                step = flow.send(reply)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def adrive(flow: Flow[T], store: Store) -> T:
    """Run ``flow`` from asyncio: store calls awaited, pauses without blocking the loop."""
    try:
        step = next(flow)
        while True:
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
                step = flow.send(None)
                continue
            try:
                reply = await store.arun(step)
            except Exception as exc:
                step = flow.throw(exc)
            else:
                step = flow.send(reply)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
