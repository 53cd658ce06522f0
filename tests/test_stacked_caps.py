"""Stacked caps (issue 27): several ``@reserve`` scopes on one task, all taken in one atomic
step or none, a refusal naming the scope that was full."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup import ConfigError, MemoryStore, QuotaExceeded, ReservationGuard
from taskdedup.celery import install, reserve
from taskdedup.reservations import ReservePolicy, stacked_scope
from test_celery import make_app
from test_taskiq import make_broker, run, started


def test_thirty_two_producers_over_200_jobs_never_pass_the_global_or_a_tenant_cap(
    redis_url: str, key_prefix: str
) -> None:
    """A global cap of 8 and a per-tenant cap of 2 over 4 tenants, a real worker (threads,
    concurrency 10): the bodies count who runs at each instant; every job runs or is refused
    naming the scope that was full."""
    app = make_app(redis_url, key_prefix)
    integ = install(app)
    lock = threading.Lock()
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()
    ran: list[int] = []

    @reserve(8, ttl=60)
    @reserve(2, scope="tenant", ttl=60)
    @app.task(shared=False, name=f"{key_prefix}.export")
    def export(tenant: str, n: int) -> None:
        with lock:
            for scope in ("global", tenant):
                running[scope] += 1
                most[scope] = max(most[scope], running[scope])
        time.sleep(0.05)
        with lock:
            for scope in ("global", tenant):
                running[scope] -= 1
            ran.append(n)

    refused: list[str] = []

    def submit(n: int) -> None:
        try:
            export.delay(f"t{n % 4}", n)
        except QuotaExceeded as full:
            with lock:
                refused.append(full.scope)

    with start_worker(app, pool="threads", concurrency=10, perform_ping_check=False):
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(submit, range(200)))
        wait_for(lambda: len(ran) + len(refused) == 200, 60, "every job to run or be refused")
        scopes = [export.name, *(f"tenant=t{i}" for i in range(4))]
        wait_for(lambda: not any(integ.reservations.active(s) for s in scopes), 10, "slots freed")
    assert most["global"] <= 8, most
    assert all(most[f"t{i}"] <= 2 for i in range(4)), most
    assert ran and refused, (len(ran), len(refused))  # both caps were reached
    assert set(refused) <= {export.name, *(f"tenant=t{i}" for i in range(4))}, set(refused)


def test_a_refusal_names_the_full_scope_and_takes_nothing_from_the_others(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix)
    integ = install(app)

    @reserve(3)
    @reserve(1, scope="tenant")
    @app.task(shared=False, name=f"{key_prefix}.sync")
    def sync(tenant: str) -> None: ...

    sync.delay("acme")
    with pytest.raises(QuotaExceeded, match="scope tenant=acme"):
        sync.delay("acme")
    assert len(integ.reservations.active(sync.name)) == 1  # the refused call took no slot
    sync.delay("umbrella")
    sync.delay("initech")
    with pytest.raises(QuotaExceeded, match=f"scope {sync.name}"):
        sync.delay("hooli")


@pytest.mark.parametrize("together", [True, False], ids=["one_step", "one_by_one"])
def test_a_guard_takes_and_frees_every_slot_of_a_stacked_scope(together: bool) -> None:
    """On a store that cannot reach every scope in one step (a Redis Cluster), the slots are
    taken one by one and given back when one is full: never over a cap either way."""
    store = MemoryStore()
    store.scopes_together = together  # type: ignore[attr-defined]
    guard = ReservationGuard(store)
    scope = stacked_scope([("global", 2), ("tenant=a", 1)])
    first = guard.reserve(scope, 0, member="J1")
    with pytest.raises(QuotaExceeded, match="scope tenant=a"):
        guard.reserve(scope, 0, member="J2")
    assert [s.member for s in guard.active("global")] == ["J1"]
    other = stacked_scope([("global", 2), ("tenant=b", 1)])
    guard.reserve(other, 0, member="J3")
    with pytest.raises(QuotaExceeded, match="scope global"):
        guard.reserve(stacked_scope([("global", 2), ("tenant=c", 1)]), 0, member="J4")
    assert guard.active("tenant=c") == []  # given back (one by one) or never taken
    first.release()
    assert guard.active("tenant=a") == [] and len(guard.active("global")) == 1


@pytest.mark.parametrize(
    "caps",
    [
        [{"max_concurrent": 2, "scope": "tenant"}, {"max_concurrent": 3, "scope": "tenant"}],
        [{"max_concurrent": 8}, {"max_concurrent": 2}],
    ],
    ids=["same_argument", "task_twice"],
)
def test_two_caps_of_one_scope_are_refused_at_definition_naming_the_task(
    caps: list[dict[str, Any]],
) -> None:
    app = Celery("bad-stack", set_as_current=False)
    install(app)
    with pytest.raises(ConfigError, match=r"task 'bad\.stacked': reserve: two caps of scope"):

        @app.task(shared=False, name="bad.stacked", reserve=caps)
        def stacked(tenant: str) -> None: ...

        app.finalize()


def test_stacked_taskiq_caps_refuse_by_the_full_scope() -> None:
    from taskdedup.taskiq import reserve as taskiq_reserve

    broker, _ = make_broker()

    @taskiq_reserve(2)
    @taskiq_reserve(1, scope="tenant")
    @broker.task
    async def backup(tenant: str) -> None:
        await __import__("asyncio").sleep(0.5)

    async def body() -> list[str]:
        refused = []
        for tenant in ("acme", "acme", "umbrella", "initech"):
            try:
                await backup.kiq(tenant)
            except QuotaExceeded as full:
                refused.append(full.scope)
        return refused

    assert run(started(broker, body)) == ["tenant=acme", backup.task_name]
    assert isinstance(ReservePolicy.from_options([{"max_concurrent": 1}]), ReservePolicy)
