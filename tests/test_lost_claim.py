"""A claim whose reply is lost: the job runs once, soon, and frees its key (G13, G14).

The store can run a worker's claim and then fail to answer (a timeout after the write, a
connection cut). The worker treats it as a store it could not reach and sends the job back;
the job's record now says RUNNING with a live lease, written by a claim whose run never
started. The copy names that claim as lost, so it is not taken for a copy of a job running
elsewhere (which would wait a whole lease for nothing, or be dropped).
"""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker

from taskdedup import RedisStore, StoreUnavailable
from taskdedup.celery import deduplicate, install
from taskdedup.stores.base import Claim, Op
from test_celery import make_app
from test_celery_revoke import accepted

LEASE = 60  # a copy mistaken for one of a running job would wait this long


class LosesOneClaimReply(RedisStore):
    """Runs the first claim, then answers as if the store had not: its reply is lost."""

    lost = threading.Event()

    def run(self, op: Op[Any]) -> Any:
        reply = super().run(op)
        if isinstance(op, Claim) and not self.lost.is_set():
            self.lost.set()
            raise StoreUnavailable("the reply of the claim was lost (test)")
        return reply


def test_a_job_whose_claim_reply_was_lost_runs_once_soon_and_frees_its_key(
    redis_url: str, key_prefix: str
) -> None:
    app: Celery = make_app(redis_url, key_prefix)
    store = LosesOneClaimReply.from_url(redis_url, key_prefix=key_prefix)
    install(app, store=store)
    runs: list[str] = []

    @deduplicate("until_executed", lease=LEASE)
    @app.task(shared=False)
    def build(sha: str) -> str:
        runs.append(sha)
        return sha

    with start_worker(app, pool="solo", perform_ping_check=False):
        job = build.delay("abc")
        # sent back after 1 s (the store "could not answer"), then claimed and run: well
        # before the lease of the lost claim's record would lapse
        assert job.get(timeout=LEASE / 4) == "abc"
        assert store.lost.is_set()
    assert runs == ["abc"]
    fresh = accepted(build, "def")
    assert fresh is not None  # another key, as a control
    assert accepted(build, "abc") is not None  # the job's key is free again
