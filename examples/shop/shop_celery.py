"""An example project's Celery app: the tasks a shop deduplicates. Its tests
(test_shop_celery.py) use only taskdedup's pytest plugin and ``taskdedup.testing``.

The broker and store default to in-process ones, so the example runs anywhere; point them at
Redis with SHOP_BROKER_URL and SHOP_STORE_URL to run it for real.
"""

from __future__ import annotations

import os
import sqlite3

from celery import Celery

from taskdedup.celery import deduplicate, install

app = Celery("shop", broker=os.environ.get("SHOP_BROKER_URL", "memory://"))
app.conf.update(
    taskdedup_url=os.environ.get("SHOP_STORE_URL", "memory://"),
    task_acks_late=True,  # a worker killed mid-job: the broker delivers the job again
    task_reject_on_worker_lost=True,
)
install(app)

db = sqlite3.connect(":memory:", check_same_thread=False)
db.execute("CREATE TABLE receipts (order_id INTEGER PRIMARY KEY, email TEXT)")
db.execute("CREATE TABLE audit (order_id INTEGER, event TEXT)")


@deduplicate("until_executed", keys=["order_id"])
@app.task(name="shop.send_receipt")
def send_receipt(order_id: int, email: str) -> None:
    """Idempotent: a receipt per order, whatever runs it twice."""
    db.execute("INSERT OR IGNORE INTO receipts VALUES (?, ?)", (order_id, email))


@deduplicate("until_executed", keys=["order_id"])
@app.task(name="shop.audit_order")
def audit_order(order_id: int) -> None:
    """Not idempotent: a second run writes a second row (what assert_idempotent catches)."""
    db.execute("INSERT INTO audit VALUES (?, 'checked')", (order_id,))


@deduplicate("until_expired", ttl=3600)
@app.task(name="shop.nightly_report")
def nightly_report() -> str:
    """At most once an hour, however often the scheduler fires."""
    return "report"
