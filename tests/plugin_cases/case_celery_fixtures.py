"""Run by tests/test_pytest_plugin.py in a pytest of its own: with pytest-celery 1.x installed
(its ``celery_worker`` is a Docker container), with Celery's legacy fixtures only
(``-p celery.contrib.pytest``) and with no Celery fixtures at all (``-p no:celery``), a real
in-process worker runs on the test's store through ``taskdedup_celery_worker``."""

from __future__ import annotations

import time
from typing import Any

import pytest

from taskdedup.celery import deduplicate
from taskdedup.testing import assert_deduplicated


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    return {"broker_url": "memory://", "result_backend": "cache+memory://"}


def test_a_real_worker_runs_the_job_a_repeat_was_answered_with(
    taskdedup_celery_app: Any, taskdedup_celery_worker: Any
) -> None:
    app = taskdedup_celery_app

    @deduplicate("until_executed")
    @app.task(name="case.build", shared=False)
    def build(sha: str) -> str:
        return sha

    taskdedup_celery_worker.reload()  # the worker learns a task defined after it started
    first = build.delay("abc")
    assert_deduplicated(first, build.delay("abc"))
    assert first.get(timeout=20) == "abc"
    deadline = time.monotonic() + 10  # the finish frees the key just after the result is stored
    while build.delay("abc").deduplicated:
        assert time.monotonic() < deadline, "the key stayed held after the job ended"
        time.sleep(0.02)
