"""The same shop on taskiq. In-process by default; SHOP_TASKIQ_REDIS_URL runs it on Redis."""

from __future__ import annotations

import os

from taskiq import AsyncBroker, InMemoryBroker

from taskdedup.taskiq import DedupMiddleware

redis_url = os.environ.get("SHOP_TASKIQ_REDIS_URL")
broker: AsyncBroker
if redis_url:
    from taskiq_redis import ListQueueBroker

    broker = ListQueueBroker(redis_url, socket_timeout=None)
else:
    broker = InMemoryBroker()
broker = broker.with_middlewares(DedupMiddleware(redis_url or "memory://"))

stock: dict[str, int] = {}


@broker.task(task_name="shop.restock", deduplicate={"strategy": "until_executed", "keys": ["sku"]})
async def restock(sku: str, count: int) -> None:
    """Idempotent: sets the stock level, it does not add to it."""
    stock[sku] = count
