"""The demo's Celery app: what ``celery -A examples.demo.celery_app worker`` runs, and what the
demo imports to submit jobs.

Broker, result backend and taskdedup store are the private Redis, whose URL the demo passes in
``DEMO_REDIS_URL``. Each task records its runs in the :mod:`journal` so the demo can count them.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery, signals
from examples.demo.journal import PREFIX, Journal, url

from taskdedup.celery import deduplicate, install

app = Celery("demo", broker=url(), backend=url(), set_as_current=True)
app.conf.update(
    task_default_queue="demo-celery",
    worker_prefetch_multiplier=1,  # a pool process takes one job at a time
    broker_connection_retry_on_startup=True,
    result_expires=600,
    taskdedup_key_prefix=PREFIX,  # the store: the broker's Redis (the default)
)
install(app)
journal = Journal()


@signals.worker_ready.connect
def ready(**_: Any) -> None:
    """Tell the demo this worker takes jobs now."""
    journal.ready("celery")


@deduplicate("until_executed", keys=["order_id"])
@app.task(name="shop.send_receipt", bind=True)
def send_receipt(self: Any, order_id: int, email: str) -> str:
    """Check 1: a double click. Runs until the demo opens its gate (so it is surely still
    going when the second click arrives)."""
    journal.record("send_receipt", "start", self.request.id, order_id, email)
    journal.wait_gate("send_receipt")
    journal.record("send_receipt", "end", self.request.id, order_id, email)
    return f"receipt for order {order_id} sent to {email}"


@deduplicate("until_executed", keys=["doc"], on_conflict="reschedule_once")
@app.task(name="docs.render", bind=True)
def render(self: Any, doc: str, version: int) -> str:
    """Check 2: submissions while it runs owe one more run, with the latest arguments."""
    journal.record("render", "start", self.request.id, doc, version)
    journal.wait_gate("render")
    journal.record("render", "end", self.request.id, doc, version)
    return f"{doc} v{version} rendered"


@deduplicate("until_executed", lease=2, keys=["account"])
@app.task(name="ledger.sync", bind=True, acks_late=True, reject_on_worker_lost=True)
def sync_ledger(self: Any, account: str) -> str:
    """Check 3: killed with kill -9 mid-run. ``acks_late`` and ``reject_on_worker_lost`` make
    the broker deliver the job again; the 2 s lease frees the dead run's hold within seconds
    (a live run renews it every lease/3)."""
    journal.record("sync_ledger", "start", self.request.id, account)
    journal.wait_gate("sync_ledger")
    time.sleep(0.5)  # the work
    journal.record("sync_ledger", "end", self.request.id, account)
    return f"ledger {account} synced"


@deduplicate("until_executed", keys=["report"])
@app.task(name="reports.build", bind=True)
def build_report(self: Any, report: str) -> str:
    """Check 6: holds its key while ``taskdedup locks`` looks."""
    journal.record("build_report", "start", self.request.id, report)
    journal.wait_gate("build_report")
    journal.record("build_report", "end", self.request.id, report)
    return f"report {report} built"
