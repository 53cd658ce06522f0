"""Prometheus metrics, scraped after a scripted scenario run by real prefork workers: a job
accepted, a duplicate answered with it, a reschedule_once run owed and sent, and a worker
killed with kill -9 mid-job whose job a second worker recovers.

The producer counts on a registry of the test's own; the workers count in prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), as a prefork deployment does, so what the
killed worker counted before it died is still there to scrape.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import wait_for
from test_celery_prefork import start, worker_env  # noqa: F401 (fixtures)
from worker_process import WorkerProcess

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from taskdedup.metrics import install_metrics  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: Any) -> Samples:
    """What a Prometheus server would read from ``registry``, sample by sample."""
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def workers_scrape(directory: Path) -> Samples:
    registry = prometheus_client.CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return scrape(registry)


def test_metrics_count_accepted_duplicate_reschedule_and_crash(
    worker_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
    tmp_path: Path,
) -> None:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {
        "TD_VISIBILITY_TIMEOUT": "1",  # the killed worker's job comes back within seconds
        "TASKDEDUP_METRICS": "true",
        "PROMETHEUS_MULTIPROC_DIR": str(shared),
    }
    producer = prometheus_client.CollectorRegistry()
    metrics = install_metrics(producer)
    try:
        first = start(**env)
        # accepted, then a duplicate answered with the job the worker holds
        job = worker_env.late_job.delay("m-crash", 60)
        wait_for(lambda: first.mark("pid:m-crash"), 30, "the job to start")
        assert worker_env.late_job.delay("m-crash", 60).id == job.id

        # reschedule_once: a duplicate while it runs owes one more run, sent when it ends
        owed = worker_env.rescheduled_job.delay("m-resched", 2)
        wait_for(lambda: first.mark("pid:m-resched"), 30, "the rescheduled job to start")
        assert worker_env.rescheduled_job.delay("m-resched", 0).id == owed.id
        wait_for(lambda: int(first.mark("runs:m-resched") or 0) == 2, 30, "the owed run")

        # kill -9 of the whole worker while it holds m-crash; a second one recovers the job
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        first.client.delete(f"{first.prefix}:mark:ready")
        start(**env)
        assert job.get(timeout=60) == "m-crash"

        made = scrape(producer)
        done = "taskdedup_decisions_total"
        assert value(made, done, task="sub.late_job", decision="enqueue", outcome="acquired") == 1
        assert value(made, "taskdedup_deduplicated_total", task="sub.late_job") == 1
        assert value(made, "taskdedup_deduplicated_total", task="sub.rescheduled_job") == 1
        timed = {labels: n for (name, labels), n in made.items() if name.endswith("seconds_count")}
        assert sum(timed.values()) >= 4, timed  # 3 submissions: locks taken or asked about

        def recovered_and_finished() -> Samples | None:
            ran = workers_scrape(shared)
            finished = value(ran, done, task="sub.late_job", decision="finish", outcome="released")
            return ran if finished == 1 else None

        ran = wait_for(recovered_and_finished, 15, "the recovered job's finish to be counted")
        assert value(ran, "taskdedup_reschedules_total", task="sub.rescheduled_job") == 1
        assert value(ran, "taskdedup_recovered_total", task="sub.late_job") == 1
        # the killed worker's claim was counted before it died, and is still there
        assert value(ran, done, task="sub.late_job", decision="claim", outcome="run") == 1
        assert value(ran, "taskdedup_lease_renewals_total") >= 1
        assert value(ran, "taskdedup_store_latency_seconds_count", operation="claim") >= 3
    finally:
        metrics.stop()
