"""A CI pipeline that resubmits on every retry, made safe with an idempotency key.

Run it with a Redis at REDIS_URL (default redis://127.0.0.1:6379/0)::

    python examples/ci_submit.py

The build of one commit is submitted with a key derived from its SHA, so a retried
submission (the CI job restarted, the HTTP call to the submitter timed out and was repeated)
gets the original build back instead of starting a second one. Builds are also capped at two
in flight per repository by the reservation guard.
"""

from __future__ import annotations

import os
import uuid

from celery import Celery
from celery.contrib.testing.worker import start_worker

from taskdedup import IdempotencyKeyMismatch, QuotaExceeded
from taskdedup.celery import install, reserve

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = f"example-ci-{uuid.uuid4().hex[:8]}"  # this run's keys, removed at the end

app = Celery("ci", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=PREFIX,
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
    worker_hijack_root_logger=False,
    taskdedup_key_prefix=PREFIX,
)
install(app)


@reserve(max_concurrent=2, scope="repo", ttl=600)
@app.task
def build(repo: str, sha: str) -> str:
    return f"built {repo}@{sha[:7]}"


def submit(repo: str, sha: str) -> object:
    """What the CI step runs, as often as CI likes: one build per commit."""
    return build.apply_async((repo, sha), idempotency_key=f"gh-{repo}-{sha}")


def main() -> None:
    sha = "4f2a9c1d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39"
    first = submit("acme/shop", sha)
    retried = submit("acme/shop", sha)  # the CI job was restarted
    print(f"first submission: job {first.id[:8]}, idempotent_hit={first.idempotent_hit}")
    print(f"retried submission: job {retried.id[:8]}, idempotent_hit={retried.idempotent_hit}")
    print(f"same build: {retried.id == first.id}")
    try:
        build.apply_async(("acme/shop", "0" * 40), idempotency_key=f"gh-acme/shop-{sha}")
    except IdempotencyKeyMismatch as err:
        print(f"same key, other commit -> IdempotencyKeyMismatch (original {err.job_id[:8]})")
    submit("acme/shop", "1" * 40)
    try:
        submit("acme/shop", "2" * 40)  # a third build of the repository while two are queued
    except QuotaExceeded as err:
        print(f"third build -> {err}")
    with start_worker(app, pool="solo", perform_ping_check=False):
        print(first.get(timeout=30))
    client = app.broker_connection().default_channel.client
    for key in client.scan_iter(match=f"{PREFIX}*"):
        client.unlink(key)


if __name__ == "__main__":
    main()
