"""taskdedup with taskiq: one middleware, a policy per task.

Run it with a Redis at REDIS_URL (default redis://127.0.0.1:6379/0)::

    python examples/taskiq_app.py

It runs a receiver in-process (``taskiq worker examples.taskiq_app:broker`` does the same in
production), double-submits jobs the ways production does (a user's double-click, a CI retry,
a retrying task) and prints what ran.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import redis
from taskiq import SimpleRetryMiddleware
from taskiq.api import run_receiver_task
from taskiq_redis import ListQueueBroker, RedisAsyncResultBackend

from taskdedup import DuplicateJob
from taskdedup.taskiq import DedupMiddleware, deduplicate

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = f"example-{uuid.uuid4().hex[:8]}"  # this run's keys, removed at the end

broker = (
    # socket_timeout=None: redis-py 8's default 5 s would end an idle worker's BRPOP
    ListQueueBroker(REDIS_URL, queue_name=f"{PREFIX}-q", socket_timeout=None)
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, prefix_str=PREFIX, result_ex_time=60))
    .with_middlewares(
        DedupMiddleware(key_prefix=PREFIX),  # the store defaults to the broker's Redis
        SimpleRetryMiddleware(default_retry_count=3),
    )
)
attempts: dict[int, int] = {}


@deduplicate("until_executed", ttl=600, keys=["order_id"])
@broker.task
async def send_receipt(order_id: int, email: str) -> str:
    await asyncio.sleep(0.2)
    return f"receipt for order {order_id} sent to {email}"


@broker.task(deduplicate={"strategy": "until_executed", "on_conflict": "raise"})
def charge(order_id: int) -> str:  # a sync task: taskiq runs it in a thread
    time.sleep(0.5)
    return f"charged order {order_id}"


@broker.task(deduplicate={"strategy": "until_executed", "lease": 10}, retry_on_error=True)
async def sync_inventory(sku: str) -> str:
    attempts[len(attempts)] = 1
    await asyncio.sleep(0.3)  # the warehouse API is slow
    if len(attempts) < 3:
        raise ConnectionError("warehouse API timed out")
    return f"{sku} synced after {len(attempts) - 1} retries"


async def main() -> None:
    await broker.startup()
    worker = asyncio.create_task(run_receiver_task(broker))
    try:
        first = await send_receipt.kiq(1, "ada@example.com")
        again = await send_receipt.kiq(1, email="other@example.com")  # a double-click
        print(f"same job: {again.task_id == first.task_id}, deduplicated: {again.deduplicated}")
        print((await first.wait_result(timeout=10)).return_value)

        job = await charge.kiq(7)
        try:
            await charge.kiq(7)
        except DuplicateJob as dup:
            print(f"DuplicateJob: job {dup.job_id} already holds it ({dup.job_id == job.task_id})")
        print((await job.wait_result(timeout=10)).return_value)

        retrying = await sync_inventory.kiq("SKU-1")
        for _ in range(3):  # a CI pipeline resubmitting while the job retries
            assert (await sync_inventory.kiq("SKU-1")).task_id == retrying.task_id
            await asyncio.sleep(0.1)
        print((await retrying.wait_result(timeout=10)).return_value)

        later = await send_receipt.kiq(1, "ada@example.com")  # the first one has finished
        print(f"new job: {later.task_id != first.task_id}")
        await later.wait_result(timeout=10)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await broker.shutdown()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{PREFIX}*"):
            client.unlink(key)
        client.close()


if __name__ == "__main__":
    asyncio.run(main())
