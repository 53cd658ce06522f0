"""A declined request leaves no order, no lock and no job; a committed one kicks its receipt
once, after the commit; a retried request (same idempotency key) gets the same job."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import closing

import pytest
from orders_app import DATABASE_URL, KEY_PREFIX, Base, Order, broker, create_order, engine, receipts
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from taskdedup.stores import from_url
from taskdedup.stores.base import Scan


@pytest.fixture(scope="module")
def shop() -> Iterator[None]:
    async def up() -> None:
        db = engine()
        async with db.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        await db.dispose()
        await broker.startup()

    async def down() -> None:
        await broker.shutdown()
        db = engine()
        async with db.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await db.dispose()

    asyncio.run(up())
    yield
    asyncio.run(down())
    with closing(from_url(DATABASE_URL, key_prefix=KEY_PREFIX)) as store:
        store.drop_tables()  # type: ignore[attr-defined]


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_a_declined_request_leaves_no_order_no_lock_and_no_job(shop: None) -> None:
    async def scenario() -> None:
        db = engine()
        try:
            with pytest.raises(RuntimeError, match="declined"):
                await create_order(db, "o-1", "a@example.com", "req-1", declined=True)
            await broker.wait_all()
            async with AsyncSession(db) as session:
                assert (await session.scalars(select(Order))).all() == []
        finally:
            await db.dispose()

    run(scenario())
    assert "o-1" not in receipts
    with closing(from_url(DATABASE_URL, key_prefix=KEY_PREFIX)) as store:
        assert store.run(Scan()) == []


def test_a_committed_request_kicks_once_and_a_retry_gets_the_same_job(shop: None) -> None:
    async def scenario() -> tuple[str, str]:
        db = engine()
        try:
            first = await create_order(db, "o-2", "b@example.com", "req-2")
            await broker.wait_all()
            assert receipts.count("o-2") == 1
            with pytest.raises(Exception):  # noqa: B017 - the order row exists already
                await create_order(db, "o-2", "b@example.com", "req-2")
            again = await send_receipt_again("req-2")
            return first, again
        finally:
            await db.dispose()

    first, again = run(scenario())  # type: ignore[misc]
    assert again == first and receipts.count("o-2") == 1


async def send_receipt_again(key: str) -> str:
    """The retried request's kick alone (its order insert failed): the idempotency key
    answers with the first job."""
    from orders_app import send_receipt

    task = await send_receipt.kicker().with_labels(idempotency_key=key).kiq("o-2")
    await broker.wait_all()
    return task.task_id
