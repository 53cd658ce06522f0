"""The shop's API: ``POST /orders/{order_id}/receipt`` sends an order's receipt in the
background and answers the job's task id (``uvicorn app:app``).

- With an ``Idempotency-Key`` header, a retried request (a client that timed out and sent it
  again) gets the same task id and sends nothing new, for 24 hours. The same key with another
  body is refused (422); a malformed key too (400).
- Without one, the task's policy still holds: while the order's receipt is queued or being
  sent, a second request (a double click) gets that job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from broker import broker
from fastapi import FastAPI, Header, HTTPException, status
from pydantic import BaseModel
from tasks import send_receipt

from taskdedup import IdempotencyKeyInProgress, IdempotencyKeyMismatch, InvalidIdempotencyKey


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    if not broker.is_worker_process:  # (a worker that imports this app starts it itself)
        await broker.startup()
    yield
    if not broker.is_worker_process:
        await broker.shutdown()


app = FastAPI(title="shop", lifespan=lifespan)


class ReceiptRequest(BaseModel):
    email: str


class ReceiptJob(BaseModel):
    task_id: str
    deduplicated: bool  # answered with the job already queued or running for this order
    idempotent_hit: bool  # answered with the job this Idempotency-Key made before


@app.post("/orders/{order_id}/receipt", status_code=status.HTTP_202_ACCEPTED)
async def send_order_receipt(
    order_id: int,
    body: ReceiptRequest,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> ReceiptJob:
    kicker = send_receipt.kicker()
    if idempotency_key is not None:
        kicker = kicker.with_labels(idempotency_key=idempotency_key)
    try:
        task = await kicker.kiq(order_id, body.email)
    except InvalidIdempotencyKey as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
    except IdempotencyKeyMismatch as exc:  # the key was used for another request
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    except IdempotencyKeyInProgress as exc:  # its first request is still being submitted
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    return ReceiptJob(
        task_id=task.task_id,
        deduplicated=task.deduplicated,
        idempotent_hit=task.idempotent_hit,
    )
