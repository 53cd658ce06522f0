"""The shop's background job: a receipt per order, deduplicated per order."""

from __future__ import annotations

import logging

from broker import broker

log = logging.getLogger(__name__)

outbox: list[tuple[int, str]] = []  # the receipts this process sent (a real shop e-mails them)


async def mail_receipt(order_id: int, email: str) -> None:
    """Render the receipt and hand it to the mail server (here: append it to ``outbox``)."""
    outbox.append((order_id, email))
    log.info("receipt of order %s sent to %s", order_id, email)


# until_executed, keyed on the order: while an order's receipt is queued or being sent, another
# submission for that order (a double click, whatever its e-mail) gets that job, not a new one.
@broker.task(
    task_name="shop.send_receipt",
    deduplicate={"strategy": "until_executed", "keys": ["order_id"], "ttl": 600},
)
async def send_receipt(order_id: int, email: str) -> str:
    await mail_receipt(order_id, email)
    return f"receipt of order {order_id} sent to {email}"
