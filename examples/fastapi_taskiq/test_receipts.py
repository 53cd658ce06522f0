"""The receipt endpoint, through FastAPI's TestClient, with taskdedup's pytest plugin
(``taskdedup_install`` in conftest.py) and the helpers of ``taskdedup.testing``."""

from __future__ import annotations

import threading
from typing import Any

from broker import broker
from fastapi.testclient import TestClient
from httpx import Response
from tasks import outbox

from taskdedup.testing import check_policies


def run_jobs(client: TestClient) -> None:
    """Wait until the jobs the requests kicked have run: InMemoryBroker runs them as tasks of
    the app's event loop, which TestClient runs in a thread of its own, so wait there."""
    assert client.portal is not None, "use the client inside `with TestClient(app)`"
    client.portal.call(broker.wait_all)


def post(client: TestClient, order_id: int, email: str, key: str | None = None) -> Response:
    """POST /orders/{order_id}/receipt, with an Idempotency-Key header when ``key`` is given."""
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(f"/orders/{order_id}/receipt", json={"email": email}, headers=headers)


def receipt(client: TestClient, order_id: int, email: str, key: str | None = None) -> Any:
    """The same, accepted (202): the job's ``task_id``, ``deduplicated``, ``idempotent_hit``."""
    response = post(client, order_id, email, key)
    assert response.status_code == 202, response.text
    return response.json()


def test_every_task_policy_is_sound() -> None:
    assert set(check_policies(broker)) == {"shop.send_receipt"}


def test_a_retried_request_gets_the_same_task_and_the_receipt_goes_once(
    client: TestClient,
) -> None:
    first = receipt(client, 1, "ada@example.com", key="req-7f3a")
    run_jobs(client)  # the receipt went out; the client timed out all the same, and retries
    again = receipt(client, 1, "ada@example.com", key="req-7f3a")
    run_jobs(client)
    assert not first["idempotent_hit"]
    assert again["idempotent_hit"] and again["task_id"] == first["task_id"]
    assert outbox == [(1, "ada@example.com")]


def test_a_key_reused_for_another_request_is_refused(client: TestClient) -> None:
    receipt(client, 2, "lin@example.com", key="req-91c0")
    assert post(client, 2, "other@example.com", key="req-91c0").status_code == 422  # other body
    assert post(client, 2, "lin@example.com", key="has space").status_code == 400  # malformed
    run_jobs(client)
    assert outbox == [(2, "lin@example.com")]


def test_a_new_key_is_a_new_request(client: TestClient) -> None:
    first = receipt(client, 3, "kim@example.com", key="req-1")
    run_jobs(client)  # the first receipt went out and let go of the order's key
    second = receipt(client, 3, "kim@example.com", key="req-2")  # "send it again", on purpose
    run_jobs(client)
    assert not second["idempotent_hit"] and not second["deduplicated"]
    assert second["task_id"] != first["task_id"]
    assert outbox == [(3, "kim@example.com"), (3, "kim@example.com")]


def test_a_double_click_without_a_key_sends_one_receipt(
    client: TestClient, slow_mail: threading.Event
) -> None:
    first = receipt(client, 4, "ada@example.com")
    again = receipt(client, 4, "ada@example.org")  # while the first job still runs
    assert not first["deduplicated"]
    assert again["deduplicated"] and again["task_id"] == first["task_id"]
    slow_mail.set()
    run_jobs(client)
    assert outbox == [(4, "ada@example.com")]  # one job: the first click's


def test_another_key_while_the_receipt_is_being_sent_gets_that_job(
    client: TestClient, slow_mail: threading.Event
) -> None:
    first = receipt(client, 7, "ada@example.com", key="req-a")
    other = receipt(client, 7, "ada@example.com", key="req-b")  # the order's key is held
    assert other["deduplicated"] and other["task_id"] == first["task_id"]
    slow_mail.set()
    run_jobs(client)
    again = receipt(client, 7, "ada@example.com", key="req-b")  # req-b now answers that job
    run_jobs(client)
    assert again["idempotent_hit"] and again["task_id"] == first["task_id"]
    assert outbox == [(7, "ada@example.com")]


def test_different_orders_get_receipts_of_their_own(
    client: TestClient, slow_mail: threading.Event
) -> None:
    five = receipt(client, 5, "ada@example.com")
    six = receipt(client, 6, "ada@example.com")  # while order 5's job still runs
    assert not five["deduplicated"] and not six["deduplicated"]
    assert five["task_id"] != six["task_id"]
    slow_mail.set()
    run_jobs(client)
    assert sorted(outbox) == [(5, "ada@example.com"), (6, "ada@example.com")]
