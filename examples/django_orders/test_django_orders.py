"""A request that fails after its enqueue leaves no order, no lock and no job; one that
commits runs its job once; a double click on "send my confirmation again" enqueues one job.

Written with taskdedup's pytest plugin: ``taskdedup_celery_worker`` is a real in-process
Celery worker on the project's app (conftest.py overrides ``taskdedup_celery_app``), and the
helpers come from ``taskdedup.testing``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from orders.models import Confirmation, Order
from orders_project.celery import app

from taskdedup.stores import from_url
from taskdedup.stores.base import Scan
from taskdedup.testing import check_policies


def locks() -> list[object]:
    """The live locks in the project's store (its PostgreSQL, under the session's prefix)."""
    store = from_url(os.environ["DATABASE_URL"], key_prefix=os.environ["ORDERS_KEY_PREFIX"])
    try:
        return store.run(Scan())
    finally:
        store.close()  # (a pool left to the garbage collector may be collected in its own thread)


def wait_until(predicate: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def confirmations(order_id: int) -> int:
    return Confirmation.objects.filter(order_id=order_id).count()


def test_every_task_policy_is_sound() -> None:
    app.loader.import_default_modules()  # as a worker starts: autodiscover imports orders.tasks
    assert set(check_policies(app)) == {"orders.tasks.send_confirmation"}


def test_a_declined_order_leaves_no_order_no_lock_and_no_job(taskdedup_celery_worker: Any) -> None:
    with pytest.raises(RuntimeError, match="declined"):
        Client().post("/orders/", {"sku": "book", "declined": "1"})
    assert locks() == []  # the rolled-back lock was never committed
    assert not Order.objects.filter(sku="book").exists()
    ok = Client().post("/orders/", {"sku": "pen"}).json()  # a job after it, to drain the queue
    wait_until(lambda: confirmations(ok["order"]) == 1)
    wait_until(lambda: not locks())  # until_executed: freed once the job ran
    # no confirmation of an order that does not exist (the declined one's job never went out)
    assert not Confirmation.objects.exclude(order_id__in=Order.objects.values("id")).exists()


def test_a_committed_order_runs_its_confirmation_once(taskdedup_celery_worker: Any) -> None:
    answer = Client().post("/orders/", {"sku": "lamp"}).json()
    wait_until(lambda: confirmations(answer["order"]) == 1)
    wait_until(lambda: not locks())
    assert confirmations(answer["order"]) == 1


def test_a_double_click_on_resend_enqueues_one_job(request: pytest.FixtureRequest) -> None:
    order = Order.objects.create(sku="mug")
    url = f"/orders/{order.id}/confirmation/"
    first = Client().post(url).json()
    again = Client().post(url).json()  # the second click, while the first job is queued
    assert not first["deduplicated"]
    assert again["deduplicated"] and again["job"] == first["job"]

    request.getfixturevalue("taskdedup_celery_worker")  # now a worker drains the queue
    wait_until(lambda: confirmations(order.id) == 1)
    wait_until(lambda: not locks())
    assert confirmations(order.id) == 1  # one job, run once
