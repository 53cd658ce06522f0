"""The shop's taskiq tests: taskdedup's pytest fixtures and helpers on taskiq's InMemoryBroker."""

from __future__ import annotations

import asyncio
from typing import Any

from shop_taskiq import broker, restock, stock

from taskdedup.testing import aassert_idempotent, assert_deduplicated, check_policies


def test_every_task_policy_is_sound() -> None:
    assert set(check_policies(broker)) == {"shop.restock"}


def test_a_repeated_restock_is_sent_once(taskdedup_install: Any) -> None:
    taskdedup_install(broker)

    async def body() -> None:
        await broker.startup()
        first = await restock.kiq("sku-1", 5)
        assert_deduplicated(first, await restock.kiq("sku-1", 5))
        await broker.wait_all()
        await broker.shutdown()

    asyncio.run(body())
    assert stock["sku-1"] == 5


def test_restock_is_safe_to_run_twice() -> None:
    asyncio.run(aassert_idempotent(restock, "sku-2", 3, snapshot=lambda: dict(stock)))
