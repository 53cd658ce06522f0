"""Prometheus metrics for taskdedup (extra ``prometheus``: ``pip install taskdedup[prometheus]``).

Turned on by the ``metrics`` setting (``TASKDEDUP_METRICS=true``, ``app.conf.taskdedup_metrics``,
``DedupMiddleware(metrics=True)``) or by calling :func:`install_metrics` yourself, with a
registry of your own if you like. Every process counts its own decisions; expose them as you
expose your other metrics (``prometheus_client.start_http_server``, or its multiprocess mode
for Celery's prefork pool: set ``PROMETHEUS_MULTIPROC_DIR`` before the worker starts).

All counters carry a ``task`` label (the task's name) where a decision has one; keys, job ids
and scopes are never labels (one series per lock would grow without end).
"""

from __future__ import annotations

import threading
from typing import Any

from . import events
from .errors import ConfigError

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ConfigError(
        "taskdedup metrics need prometheus_client: pip install 'taskdedup[prometheus]'"
    ) from exc

#: Store round trips take well under a millisecond on loopback and tens over a WAN.
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """The counters and the histogram, registered on one registry."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"taskdedup_{name}", doc, labels, registry=registry)

        self.registry = registry
        self.decisions = counter(
            "decisions", "Every decision by task, moment and outcome", "task", "decision", "outcome"
        )
        self.deduplicated = counter(
            "deduplicated", "Submissions answered with the job that holds their key", "task"
        )
        self.newest_wins = counter(
            "newest_wins",
            "Duplicates that did more than wait: debounced, superseded, cancel_requested",
            "task",
            "effect",
        )
        self.reschedules = counter(
            "reschedules", "Owed runs of reschedule_once sent after a job ended", "task"
        )
        self.copies_skipped = counter(
            "stale_copies_skipped",
            "Delivered copies dropped: their job finished, ran out of attempts or moved on",
            "task",
        )
        self.copies_deferred = counter(
            "copies_deferred",
            "Delivered copies sent back to wait: their job, or their key's holder, runs",
            "task",
        )
        self.recovered = counter(
            "recovered", "Copies run in place of a run whose worker died (lease lapsed)", "task"
        )
        self.lease_renewals = counter("lease_renewals", "Leases renewed by heartbeats")
        self.lease_losses = counter(
            "lease_losses", "Running jobs that found their lock or slot gone", "task"
        )
        self.quota_rejections = counter(
            "quota_rejections", "Submissions refused because their scope was full", "task"
        )
        self.idempotent_hits = counter(
            "idempotent_hits", "Submissions answered with the job of their idempotency key", "task"
        )
        self.store_unavailable = counter(
            "store_unavailable", "Decisions the store could not answer", "task", "decision"
        )
        self.store_errors = counter(
            "store_errors", "Store commands that failed (timeouts, lost connections)", "operation"
        )
        self.store_latency = Histogram(
            "taskdedup_store_latency_seconds",
            "Time of the store commands decisions waited for",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._by_kind = {
            "deduplicated": self.deduplicated,
            "rescheduled": self.reschedules,
            "copy_skipped": self.copies_skipped,
            "copy_deferred": self.copies_deferred,
            "recovered": self.recovered,
            "lease_lost": self.lease_losses,
            "quota_rejected": self.quota_rejections,
            "idempotent_hit": self.idempotent_hits,
        }

    def decision(self, event: events.Decision) -> None:
        """Count one decision (a listener of :data:`taskdedup.events.everywhere`)."""
        if event.decision == "heartbeat" and event.outcome == "renewed":
            self.lease_renewals.inc(event.fields.get("count", 1))
            return
        self.decisions.labels(event.task, event.decision, event.outcome).inc()
        kind = event.kind
        if kind == "store_unavailable":
            self.store_unavailable.labels(event.task, event.decision).inc()
        elif kind in events.ALSO:  # (and a deduplicated one too)
            self.newest_wins.labels(event.task, kind).inc()
            self.deduplicated.labels(event.task).inc()
        elif kind is not None and kind in self._by_kind:
            self._by_kind[kind].labels(event.task).inc()

    def store_call(self, call: events.StoreCall) -> None:
        """Time one store command (a listener of :data:`taskdedup.events.store_calls`)."""
        self.store_latency.labels(call.operation).observe(call.seconds)
        if call.failed:
            self.store_errors.labels(call.operation).inc()

    def stop(self) -> None:
        """Stop counting (the metrics stay registered, with what they counted)."""
        events.everywhere.remove(self.decision)
        events.store_calls.remove(self.store_call)


_installed: dict[int, Metrics] = {}
_lock = threading.Lock()


def install_metrics(registry: Any = None) -> Metrics:
    """Count this process's decisions on ``registry`` (prometheus_client's default one when
    None); calling it again for the same registry returns the same Metrics."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        metrics = _installed.get(id(registry))
        if metrics is None or metrics.registry is not registry:
            metrics = _installed[id(registry)] = Metrics(registry)
        events.everywhere.add(metrics.decision)
        events.store_calls.add(metrics.store_call)
        return metrics
