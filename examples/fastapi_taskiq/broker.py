"""The taskiq broker: Redis (taskiq-redis' ListQueueBroker on REDIS_URL) with taskdedup's
middleware, or, under the tests, taskiq's InMemoryBroker (``ENVIRONMENT=pytest``, the switch
taskiq's testing guide recommends), so the tests need no Redis.

Run a worker with ``taskiq worker broker:broker tasks`` (from this directory)."""

from __future__ import annotations

import os

from taskiq import AsyncBroker, InMemoryBroker
from taskiq_redis import ListQueueBroker

from taskdedup.taskiq import DedupMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

broker: AsyncBroker
if os.environ.get("ENVIRONMENT") == "pytest":
    broker = InMemoryBroker()  # kicked tasks run in this process, in the caller's event loop
else:
    # socket_timeout=None: the list broker's BRPOP waits with no timeout of its own, and
    # redis-py 8's default 5 s socket timeout would stop an idle worker
    broker = ListQueueBroker(REDIS_URL, queue_name="shop-receipts", socket_timeout=None)

# Before the tasks are declared. The store defaults to the broker's own Redis (the lock and the
# message go out in one round trip); for InMemoryBroker, an in-memory store.
broker = broker.with_middlewares(DedupMiddleware())
