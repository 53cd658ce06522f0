"""A claim whose reply is lost: the job runs once, soon, and frees its key (G13, G14).

The store can run a worker's claim and then fail to answer (a timeout after the write, a
connection cut). The worker treats it as a store it could not reach and sends the job back;
the job's record now says RUNNING with a live lease, written by a claim whose run never
started. The copy names that claim as lost, so it is not taken for a copy of a job running
elsewhere (which would wait a whole lease for nothing, or be dropped), and the lost claim is
no attempt of the job (with ``max_attempts=1`` it used to be dropped as exhausted).

Celery with a real worker (``start_worker``) and taskiq through its real receiver; the store is
a RedisStore on the test's Redis (claim.lua) that runs the first claim and then raises.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from taskiq import InMemoryBroker

from taskdedup import RedisStore, StoreUnavailable
from taskdedup.celery import deduplicate, install
from taskdedup.stores.base import Claim, Op
from taskdedup.taskiq import DedupMiddleware
from test_celery import make_app
from test_celery_revoke import accepted
from test_taskiq import run

LEASE = 60  # a copy mistaken for one of a running job would wait this long
SOON = LEASE / 4  # the copy is sent back after 1 s and runs: well before the lease lapses


class LosesOneClaimReply(RedisStore):
    """Runs the first claim, then answers as if the store had not: its reply is lost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost = threading.Event()

    def _lose(self, op: Op[Any]) -> None:
        if isinstance(op, Claim) and not self.lost.is_set():
            self.lost.set()
            raise StoreUnavailable("the reply of the claim was lost (test)")

    def run(self, op: Op[Any]) -> Any:
        reply = super().run(op)
        self._lose(op)
        return reply

    async def arun(self, op: Op[Any]) -> Any:
        reply = await super().arun(op)
        self._lose(op)
        return reply


@pytest.mark.parametrize("max_attempts", [None, 1])
def test_a_job_whose_claim_reply_was_lost_runs_once_soon_and_frees_its_key(
    redis_url: str, key_prefix: str, max_attempts: int | None
) -> None:
    app: Celery = make_app(redis_url, key_prefix)
    store = LosesOneClaimReply.from_url(redis_url, key_prefix=key_prefix)
    assert isinstance(store, LosesOneClaimReply)
    install(app, store=store)
    runs: list[str] = []

    @deduplicate("until_executed", lease=LEASE, max_attempts=max_attempts)
    @app.task(shared=False)
    def build(sha: str) -> str:
        runs.append(sha)
        return sha

    with start_worker(app, pool="solo", perform_ping_check=False):
        job = build.delay("abc")
        assert job.get(timeout=SOON) == "abc"
        assert store.lost.is_set()
    assert runs == ["abc"]
    fresh = accepted(build, "def")
    assert fresh is not None  # another key, as a control
    assert accepted(build, "abc") is not None  # the job's key is free again


@pytest.mark.parametrize("max_attempts", [None, 1])
def test_a_taskiq_job_whose_claim_reply_was_lost_runs_once_soon_and_frees_its_key(
    redis_url: str, key_prefix: str, max_attempts: int | None
) -> None:
    store = LosesOneClaimReply.from_url(redis_url, key_prefix=key_prefix)
    assert isinstance(store, LosesOneClaimReply)
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(store))
    runs: list[str] = []
    options = {"strategy": "until_executed", "lease": LEASE, "max_attempts": max_attempts}

    @broker.task(deduplicate=options)
    async def build(sha: str) -> str:
        runs.append(sha)
        return sha

    async def body() -> tuple[Any, Any]:
        await broker.startup()
        try:
            job = await build.kiq("abc")
            result = await job.wait_result(timeout=SOON)
            await broker.wait_all()
            again = await build.kiq("abc")  # the job's key is free again
            await again.wait_result(timeout=SOON)
            return result, again
        finally:
            await broker.wait_all()
            await broker.shutdown()
            await store.aclose()

    result, again = run(body())
    assert store.lost.is_set()
    assert not result.is_err and result.return_value == "abc"
    assert not again.deduplicated
    assert runs == ["abc", "abc"]  # the first job once, then the fresh one
