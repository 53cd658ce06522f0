"""taskdedup with Celery: one ``install(app)``, one decorator per task.

Run it with a Redis at REDIS_URL (default redis://127.0.0.1:6379/0)::

    python examples/celery_app.py

It starts an in-process worker, double-submits jobs the ways production does (a user's
double-click, a CI retry, a retrying task) and prints what ran.
"""

from __future__ import annotations

import os
import uuid

from celery import Celery
from celery.contrib.testing.worker import start_worker

from taskdedup import DuplicateJob
from taskdedup.celery import deduplicate, install

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = f"example-{uuid.uuid4().hex[:8]}"  # this run's keys, removed at the end

app = Celery("example", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=PREFIX,
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
    worker_hijack_root_logger=False,
    taskdedup_key_prefix=PREFIX,  # the store defaults to the broker, as it is Redis
)
install(app)


@deduplicate("until_executed", ttl=600, keys=["order_id"])
@app.task
def send_receipt(order_id: int, email: str) -> str:
    return f"receipt for order {order_id} sent to {email}"


@deduplicate("until_executed", on_conflict="raise")
@app.task
def charge(order_id: int) -> str:
    return f"order {order_id} charged"


@deduplicate("until_executed", lease=10)
@app.task(bind=True, max_retries=3)
def flaky_export(self, day: str) -> str:  # type: ignore[no-untyped-def]
    if self.request.retries < 2:
        raise self.retry(countdown=0.2)
    fence = self.request.taskdedup_fence  # the lock's fencing token, for writes that must not race
    return f"export {day} done after {self.request.retries} retries (fence {fence})"


def main() -> None:
    first = send_receipt.delay(1, "ada@example.com")
    again = send_receipt.delay(1, email="ada@example.com")  # a double-click
    same = again.id == first.id
    print(f"send_receipt twice -> same job: {same}, deduplicated: {again.deduplicated}")

    charge.delay(7)
    try:
        charge.delay(7)
    except DuplicateJob as dup:
        print(f"charge(7) twice -> DuplicateJob, holder {dup.job_id[:8]}")

    export = flaky_export.delay("2026-11-22")
    with start_worker(app, pool="solo", perform_ping_check=False):
        print(first.get(timeout=30))
        retried = flaky_export.delay("2026-11-22")  # while it retries: still one job
        print(f"export resubmitted while retrying -> same job: {retried.id == export.id}")
        print(export.get(timeout=30))
    fresh = send_receipt.delay(1, "ada@example.com")
    print(f"send_receipt after the job finished -> new job: {not fresh.deduplicated}")
    fresh.forget()

    client = app.broker_connection().default_channel.client
    for key in client.scan_iter(match=f"{PREFIX}*"):
        client.unlink(key)


if __name__ == "__main__":
    main()
