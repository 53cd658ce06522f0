"""Run by tests/test_pytest_plugin.py in a pytest of its own: a project overrides
``taskdedup_celery_app`` to test its own app (one that installs taskdedup at import, as a
project's ``celery.py`` does), and ``taskdedup_celery_worker`` runs that app's tasks."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from taskdedup.celery import deduplicate, install
from taskdedup.testing import assert_deduplicated

app = Celery("project", broker="memory://", backend="cache+memory://", set_as_current=False)
install(app)


@deduplicate("until_executed", keys=["order_id"])
@app.task(name="project.receipt")
def receipt(order_id: int, email: str) -> str:
    return f"{order_id}:{email}"


@pytest.fixture
def taskdedup_celery_app(taskdedup_install: Any) -> Celery:
    return taskdedup_install(app)  # type: ignore[no-any-return]


def test_the_projects_own_app_runs_on_the_worker_fixture(taskdedup_celery_worker: Any) -> None:
    first = receipt.delay(7, "ada@example.com")
    assert_deduplicated(first, receipt.delay(7, "ada@example.org"))
    assert first.get(timeout=20) == "7:ada@example.com"
