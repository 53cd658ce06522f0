"""The shop's Celery tests: only taskdedup's pytest fixtures (taskdedup_install,
taskdedup_clock) and the helpers of ``taskdedup.testing``; no Redis needed (the plugin's
in-memory store), or pass --taskdedup-redis redis://... to run them on Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from shop_celery import app, audit_order, db, nightly_report, send_receipt

from taskdedup.testing import (
    assert_deduplicated,
    assert_idempotent,
    assert_not_deduplicated,
    check_policies,
    crash,
    deliver,
)


@pytest.fixture
def shop(taskdedup_install: Any) -> Any:
    return taskdedup_install(app)  # the app on this test's own, empty store


@pytest.fixture
def eager() -> Iterator[None]:
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def receipts() -> list[tuple[int, str]]:
    return db.execute("SELECT order_id, email FROM receipts ORDER BY order_id").fetchall()


def audit_rows() -> list[tuple[int, str]]:
    return db.execute("SELECT order_id, event FROM audit ORDER BY rowid").fetchall()


def test_every_task_policy_is_sound() -> None:
    policies = check_policies(app)
    assert set(policies) == {"shop.send_receipt", "shop.audit_order", "shop.nightly_report"}


def test_a_double_click_publishes_one_receipt_job(shop: Any) -> None:
    first = send_receipt.delay(7, "ada@example.com")
    again = send_receipt.delay(7, email="ada@example.org")  # keys=["order_id"]: the same job
    assert_deduplicated(first, again)
    assert_not_deduplicated(first, send_receipt.delay(8, "ada@example.com"))


def test_send_receipt_is_safe_to_run_twice() -> None:
    assert_idempotent(send_receipt, 9, "grace@example.com", snapshot=receipts)


def test_audit_order_is_not_safe_to_run_twice() -> None:
    with pytest.raises(AssertionError, match="not idempotent"):
        assert_idempotent(audit_order, 9, snapshot=audit_rows)


def test_eager_mode_deduplicates_as_production_does(shop: Any, eager: None) -> None:
    assert_deduplicated(nightly_report.delay(), nightly_report.delay())  # throttled for an hour
    first = send_receipt.delay(10, "a@example.com")  # ran at once, in this process...
    assert first.get() is None and (10, "a@example.com") in receipts()
    assert_not_deduplicated(first, send_receipt.delay(10, "a@example.com"))  # ...and let go


def test_a_redelivered_copy_waits_and_recovers_after_a_crash(
    shop: Any, taskdedup_clock: Any
) -> None:
    job = send_receipt.delay(11, "lin@example.com")
    assert deliver(send_receipt, job, 11, "lin@example.com").outcome == "run"  # a worker has it
    assert deliver(send_receipt, job, 11, "lin@example.com").outcome == "running"  # the copy waits
    crash(send_receipt, job, taskdedup_clock)  # kill -9 of that worker: its lease runs out
    assert deliver(send_receipt, job, 11, "lin@example.com").outcome == "run"  # the copy takes over
