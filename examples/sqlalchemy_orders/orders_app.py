"""A FastAPI-style shop on SQLAlchemy (asyncio) and taskiq, whose PostgreSQL is taskdedup's store.

``create_order`` is what an endpoint would do: in one ``taskdedup.atransaction(session)`` it
adds the order and kicks its receipt, keyed by the request's idempotency header. The lock row
is written in the order's transaction; the message is kicked once the transaction commits. A
request that fails after the kick rolls back the order, the lock and the job together.
"""

from __future__ import annotations

import os

from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from taskiq import InMemoryBroker

import taskdedup
from taskdedup.taskiq import DedupMiddleware

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
KEY_PREFIX = os.environ.get("ORDERS_KEY_PREFIX", "taskdedup")
TABLE = os.environ.get("ORDERS_TABLE", "shop_orders")

# (InMemoryBroker runs each kicked task in this process: swap in taskiq-redis or
# taskiq-aio-pika for a real deployment; nothing else changes)
broker = InMemoryBroker().with_middlewares(DedupMiddleware(DATABASE_URL, key_prefix=KEY_PREFIX))
receipts: list[str] = []  # what send_receipt did (a real shop sends an e-mail)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = TABLE
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    email: Mapped[str] = mapped_column(String(200))


@broker.task(deduplicate="until_executed")
async def send_receipt(order_id: str) -> None:
    receipts.append(order_id)


def engine() -> AsyncEngine:
    return create_async_engine(DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1))


async def create_order(
    db: AsyncEngine, order_id: str, email: str, idempotency_key: str, declined: bool = False
) -> str:
    """POST /orders (Idempotency-Key header): the order and its receipt's job, in one
    transaction; answers the job's id. A retried request with the same key gets the same job."""
    async with AsyncSession(db) as session, taskdedup.atransaction(session):
        session.add(Order(id=order_id, email=email))
        task = (
            await send_receipt.kicker().with_labels(idempotency_key=idempotency_key).kiq(order_id)
        )
        if declined:
            raise RuntimeError("payment declined")  # the order and the job roll back together
    return task.task_id
