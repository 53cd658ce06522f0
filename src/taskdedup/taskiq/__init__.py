"""taskdedup for taskiq: one middleware, then a policy per task.

from taskdedup.taskiq import DedupMiddleware, deduplicate

broker = ListQueueBroker("redis://localhost:6379/0").with_middlewares(DedupMiddleware())

@broker.task(deduplicate={"strategy": "until_executed", "keys": ["user_id"]})
async def rebuild(user_id: int, force: bool = False) -> None: ...

handle = await rebuild.kiq(1)      # handle.deduplicated: False, or True for the holder's job
"""

from __future__ import annotations

from .middleware import DedupMiddleware
from .options import FENCE_LABEL, KEY_LABEL, deduplicate, pace, reserve
from .producer import DedupKicker, DedupTask

__all__ = [
    "FENCE_LABEL",
    "KEY_LABEL",
    "DedupKicker",
    "DedupMiddleware",
    "DedupTask",
    "deduplicate",
    "pace",
    "reserve",
]
