"""A request that fails after its enqueue leaves no order, no lock and no job; one that
commits runs its job once. A real in-process Celery worker drains the queue."""

from __future__ import annotations

import os
import time

import pytest
from celery.contrib.testing.worker import start_worker
from django.test import Client
from orders.models import Confirmation, Order
from orders_project.celery import app

from taskdedup.stores import from_url
from taskdedup.stores.base import Scan


def locks() -> list[object]:
    store = from_url(os.environ["DATABASE_URL"], key_prefix=os.environ["ORDERS_KEY_PREFIX"])
    try:
        return store.run(Scan())
    finally:
        store.close()  # (a pool left to the garbage collector may be collected in its own thread)


def wait_until(predicate: object, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_declined_order_leaves_no_order_no_lock_and_no_job() -> None:
    with start_worker(app, pool="solo", perform_ping_check=False):
        with pytest.raises(RuntimeError, match="declined"):
            Client().post("/orders/", {"sku": "book", "declined": "1"})
        assert locks() == []  # the rolled-back lock was never committed
        ok = Client().post("/orders/", {"sku": "pen"}).json()  # a job after it, to drain
        wait_until(lambda: Confirmation.objects.filter(order_id=ok["order"]).exists())
        wait_until(lambda: not locks())  # until_executed: freed once the job ran
    assert list(Order.objects.values_list("sku", flat=True)) == ["pen"]
    assert list(Confirmation.objects.values_list("order_id", flat=True)) == [ok["order"]]


def test_a_committed_order_runs_its_confirmation_once() -> None:
    with start_worker(app, pool="solo", perform_ping_check=False):
        answer = Client().post("/orders/", {"sku": "lamp"}).json()
        result = app.AsyncResult(answer["job"])
        wait_until(lambda: Confirmation.objects.filter(order_id=answer["order"]).exists())
        assert result.id == answer["job"]
    assert Confirmation.objects.filter(order_id=answer["order"]).count() == 1
