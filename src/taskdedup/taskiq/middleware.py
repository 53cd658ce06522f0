"""``DedupMiddleware``: one taskiq middleware for both sides of a broker, on what they share
(``state.py``): the producer side (``pre_send`` and the wrapped kick) is ``producer.py``'s, the
worker side (``pre_execute``, ``on_error``, ``post_execute``) ``worker.py``'s."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from taskiq.message import TaskiqMessage
from taskiq.result import TaskiqResult

from ..stores import Store
from .producer import Producer
from .schedule import hook_scheduler
from .state import DedupState
from .worker import Worker

if TYPE_CHECKING:
    from taskiq.abc.broker import AsyncBroker


class DedupMiddleware(DedupState):
    """Deduplicates the tasks of one broker that declare a policy.

    ``store_or_url``: a :class:`~taskdedup.Store`, or a store URL (``redis://...``,
    ``memory://``); by default ``TASKDEDUP_URL``, else the broker's own Redis (taskiq-redis
    brokers), else an in-memory store for ``InMemoryBroker``. ``settings`` are the
    :class:`~taskdedup.Settings` fields (``enabled``, ``dry_run``, ``default_ttl``, ...);
    ``TASKDEDUP_*`` environment variables win over them.
    """

    #: (the worker's heartbeat and the producer's answer about the fused kick too)
    made_from_store = ("_dedup", "worker._heartbeat", "producer._fusable_broker")

    def __init__(self, store_or_url: Store | str | None = None, **settings: Any) -> None:
        super().__init__(store_or_url, **settings)
        hook_scheduler()  # a scheduler's sends know their tick
        self.worker = Worker(self)
        self.producer = Producer(self, self.worker.retried)

    def set_broker(self, broker: AsyncBroker) -> None:
        super().set_broker(broker)
        self.producer.install(broker)
        self.worker.resender.watch(broker)  # a stopping worker sends its waiting copies at once

    # ------------------------------------------------------------------ taskiq hooks

    async def startup(self) -> None:
        self.check_declarations()  # (a task declared before this middleware was added)

    async def shutdown(self) -> None:
        await self.worker.close()
        if self._dedup is not None:
            await asyncio.to_thread(self._dedup.close)  # flush pending confirmations

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        return await self.producer.pre_send(message)

    async def pre_execute(self, message: TaskiqMessage) -> TaskiqMessage:
        return await self.worker.pre_execute(message)

    def on_error(
        self, message: TaskiqMessage, result: TaskiqResult[Any], exception: BaseException
    ) -> None:
        self.worker.on_error(message, exception)

    async def post_execute(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        await self.worker.post_execute(message, result)
