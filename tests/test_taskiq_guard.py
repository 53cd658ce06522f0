"""taskiq: idempotency keys and the reservation guard, on InMemoryBroker and on a real Redis
(a taskiq-redis ListQueueBroker whose messages are counted in Redis, without a worker)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from taskiq import Context, InMemoryBroker
from taskiq_redis import ListQueueBroker

from taskdedup import (
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    MemoryStore,
    QuotaExceeded,
    ReservationGuard,
)
from taskdedup.taskiq import DedupMiddleware, deduplicate, reserve
from test_taskiq import CONTEXT, Deliveries, delivered, run, started, until


@pytest.fixture
def list_broker(redis_url: str, key_prefix: str) -> Iterator[ListQueueBroker]:
    broker = ListQueueBroker(redis_url, queue_name=f"{key_prefix}-q").with_middlewares(
        DedupMiddleware(key_prefix=key_prefix)
    )
    yield broker


def queued(redis_url: str, key_prefix: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(f"{key_prefix}-q"))
    finally:
        client.close()


# ---------------------------------------------------------------- idempotency keys


def test_a_retried_kick_gets_the_original_job_back() -> None:
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()), Deliveries())

    @broker.task
    async def build(sha: str, target: str = "all") -> str:
        return f"{sha}:{target}"

    async def body() -> None:
        kicker = build.kicker().with_labels(idempotency_key="gh-org/repo-4f2a9c1")
        first = await kicker.kiq("4f2a9c1")
        again = (
            await build.kicker()
            .with_labels(idempotency_key="gh-org/repo-4f2a9c1")
            .kiq(sha="4f2a9c1")
        )
        assert first.idempotent_hit is False and first.deduplicated is False
        assert again.idempotent_hit is True and again.task_id == first.task_id
        assert (await first.wait_result(timeout=5)).return_value == "4f2a9c1:all"
        assert delivered(broker) == [first.task_id]

    run(started(broker, body))


def test_the_same_key_with_other_arguments_is_a_mismatch_and_a_bad_key_an_error() -> None:
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()), Deliveries())

    @broker.task
    async def build(sha: str) -> None: ...

    async def body() -> None:
        first = await build.kicker().with_labels(idempotency_key="build-17").kiq("abc")
        with pytest.raises(IdempotencyKeyMismatch) as raised:
            await build.kicker().with_labels(idempotency_key="build-17").kiq("def")
        assert raised.value.job_id == first.task_id and raised.value.key == "build-17"
        with pytest.raises(InvalidIdempotencyKey, match="printable ASCII"):
            await build.kicker().with_labels(idempotency_key="has space").kiq("abc")
        await first.wait_result(timeout=5)
        assert delivered(broker) == [first.task_id]

    run(started(broker, body))


def test_after_its_ttl_the_same_key_makes_a_new_job(
    list_broker: ListQueueBroker, redis_url: str, key_prefix: str
) -> None:
    @list_broker.task
    async def build(sha: str) -> None: ...

    async def body() -> None:
        await list_broker.startup()
        try:
            labels = {"idempotency_key": "nightly-1", "idempotency_ttl": 1}
            first = await build.kicker().with_labels(**labels).kiq("abc")
            again = await build.kicker().with_labels(**labels).kiq("abc")
            assert again.idempotent_hit and again.task_id == first.task_id

            async def fresh() -> Any:
                handle = await build.kicker().with_labels(**labels).kiq("abc")
                return None if handle.idempotent_hit else handle

            async def poll() -> Any:
                for _ in range(300):
                    handle = await fresh()
                    if handle is not None:
                        return handle
                    await asyncio.sleep(0.02)
                raise AssertionError("the key did not expire within 6 s")

            later = await poll()
            assert later.task_id != first.task_id
        finally:
            await list_broker.shutdown()

    run(body())
    assert queued(redis_url, key_prefix) == 2


def test_32_concurrent_kicks_with_one_key_make_one_job(
    list_broker: ListQueueBroker, redis_url: str, key_prefix: str
) -> None:
    @list_broker.task
    async def build(sha: str) -> None: ...

    async def body() -> list[Any]:
        await list_broker.startup()
        try:
            kicker = build.kicker().with_labels(idempotency_key="pipeline-9")
            return await asyncio.gather(*(kicker.kiq("abc") for _ in range(32)))
        finally:
            await list_broker.shutdown()

    handles = run(body())
    assert len({h.task_id for h in handles}) == 1
    assert sum(h.idempotent_hit for h in handles) == 31
    assert queued(redis_url, key_prefix) == 1


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_retry_during_the_first_kick_waits_for_its_outcome(first_fails: bool) -> None:
    """A resubmission while the first kick with its key is still being sent: if that kick
    fails, the retry makes the job (not a handle of a job that never existed); if it goes
    out, the retry gets it back."""
    from taskiq.exceptions import SendTaskError

    from taskdedup.stores.base import Remember

    entered, release = asyncio.Event(), asyncio.Event()

    class SlowBroker(InMemoryBroker):
        kicks = 0

        async def kick(self, message: Any) -> None:
            SlowBroker.kicks += 1
            if SlowBroker.kicks == 1:
                entered.set()
                await release.wait()
                if first_fails:
                    raise ConnectionError("broker went away")
            await super().kick(message)

    store = MemoryStore()
    asked: list[Any] = []
    arun = store.arun

    async def counting(op: Any) -> Any:
        if isinstance(op, Remember):
            asked.append(op)
        return await arun(op)

    store.arun = counting  # type: ignore[method-assign]
    broker = SlowBroker().with_middlewares(DedupMiddleware(store), Deliveries())

    @broker.task
    async def build(sha: str) -> str:
        return sha

    async def body() -> None:
        kicker = build.kicker().with_labels(idempotency_key="ci-retry-2")
        first = asyncio.create_task(kicker.kiq("abc"))
        await entered.wait()
        retry = asyncio.create_task(kicker.kiq("abc"))
        await until(lambda: len(asked) >= 3, what="the retry to ask about the key again")
        assert not retry.done()  # it waits for the first kick, unanswered
        release.set()
        again = await retry
        if first_fails:
            with pytest.raises(SendTaskError):
                await first
            assert again.idempotent_hit is False
        else:
            assert again.idempotent_hit is True and again.task_id == (await first).task_id
        await again.wait_result(timeout=5)
        assert delivered(broker) == [again.task_id]

    run(started(broker, body))


# ---------------------------------------------------------------- reservations


def test_a_scope_publishes_at_most_its_cap_and_frees_slots_when_jobs_end() -> None:
    store = MemoryStore()
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(store), Deliveries())
    release = asyncio.Event()

    @reserve(max_concurrent=2, scope="user_id")
    @broker.task
    async def export(user_id: int, n: int) -> int:
        await release.wait()
        return n

    async def body() -> None:
        first = await export.kiq(42, 1)
        await export.kiq(42, 2)
        with pytest.raises(QuotaExceeded, match="maximum 2 concurrent jobs for scope user_id=42"):
            await export.kiq(42, 3)
        await export.kiq(7, 1)  # another scope
        guard = ReservationGuard(store)
        assert len(guard.active("user_id=42")) == 2
        release.set()
        assert (await first.wait_result(timeout=5)).return_value == 1
        await until(lambda: not guard.active("user_id=42"), 5, "the slots to be freed")
        await export.kiq(42, 4)

    run(started(broker, body))


def test_a_duplicate_or_a_hit_takes_no_slot_and_a_refusal_gives_back_the_lock() -> None:
    store = MemoryStore()
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(store), Deliveries())
    release = asyncio.Event()

    @deduplicate("until_executed")
    @reserve(max_concurrent=2, scope=lambda tenant, **_: f"tenant-{tenant}")
    @broker.task
    async def sync(tenant: str, part: int) -> None:
        await release.wait()

    async def body() -> None:
        first = await sync.kiq("acme", 1)
        assert (await sync.kiq("acme", 1)).deduplicated
        await sync.kicker().with_labels(idempotency_key="sync-2").kiq("acme", 2)
        hit = await sync.kicker().with_labels(idempotency_key="sync-2").kiq("acme", 2)
        assert hit.idempotent_hit
        guard = ReservationGuard(store)
        assert len(guard.active("tenant-acme")) == 2
        with pytest.raises(QuotaExceeded):
            await sync.kicker().with_labels(idempotency_key="sync-3").kiq("acme", 3)
        guard.release("tenant-acme", first.task_id)  # a slot frees up
        fresh = await sync.kicker().with_labels(idempotency_key="sync-3").kiq("acme", 3)
        assert not fresh.deduplicated and fresh.idempotent_hit is False  # key and lock were free
        release.set()

    run(started(broker, body))


def test_a_bad_scope_fails_when_the_task_is_defined() -> None:
    from taskdedup import ConfigError

    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()))
    with pytest.raises(ConfigError, match="user"):

        @reserve(max_concurrent=2, scope="user")
        @broker.task(task_name=f"t-{uuid.uuid4().hex}")
        async def export(user_id: int) -> None: ...


def test_a_store_outage_with_on_store_error_raise_reaches_the_caller_as_itself(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from taskdedup import RedisStore, StoreUnavailable

    broker = ListQueueBroker(redis_url, queue_name=f"{key_prefix}-q").with_middlewares(
        DedupMiddleware(key_prefix=key_prefix, on_store_error="raise")
    )

    @broker.task(deduplicate="until_executed")
    async def job(x: int) -> None: ...

    async def down(*_: Any, **__: Any) -> None:
        raise StoreUnavailable("Redis did not answer: injected")

    monkeypatch.setattr(RedisStore, "arun", down)
    monkeypatch.setattr(RedisStore, "aacquire_and_push", down)

    async def body() -> None:
        await broker.startup()
        try:
            with pytest.raises(StoreUnavailable, match="injected"):
                await job.kiq(1)
        finally:
            await broker.shutdown()

    run(body())
    assert queued(redis_url, key_prefix) == 0


def test_a_job_whose_reservation_lapsed_waits_for_a_slot_when_the_scope_is_full() -> None:
    """Queued longer than its reservation's ttl, a job starts without a slot: it takes one
    if the scope has room, else it is sent again later instead of running over the cap."""
    deliver = asyncio.Event()

    class HeldBroker(InMemoryBroker):
        """Delivers what is kicked only once the test says so (a queue with no worker yet)."""

        async def kick(self, message: Any) -> None:
            await deliver.wait()
            await super().kick(message)

    store = MemoryStore()
    broker = HeldBroker().with_middlewares(DedupMiddleware(store), Deliveries())
    guard = ReservationGuard(store)
    runs: list[list[str]] = []

    @reserve(max_concurrent=1, scope="tenant", ttl=0.3)
    @broker.task
    async def sync(tenant: str) -> None:
        runs.append([slot.member for slot in guard.active(f"tenant={tenant}")])

    async def body() -> None:
        kick = asyncio.create_task(sync.kiq("acme"))
        await until(lambda: guard.active("tenant=acme"), what="the reservation")
        await until(lambda: not guard.active("tenant=acme"), what="the reservation to lapse")
        outsider = guard.reserve("tenant=acme", 1, ttl=60)  # the scope is full again
        deliver.set()
        job = await kick
        await until(lambda: job.task_id in delivered(broker), what="the delivery")
        await asyncio.sleep(0)
        assert runs == []  # not run over the cap
        outsider.release()
        await until(lambda: runs, what="the job to run once the slot is free")
        assert runs == [[job.task_id]]
        assert delivered(broker).count(job.task_id) >= 2  # a copy sent again ran

    run(started(broker, body))


def test_a_rescheduled_run_takes_its_own_slot_of_the_scope() -> None:
    """reschedule_once owes one more run: it is sent with the scope's slot the first run has
    just freed, so the cap holds for it too."""
    store = MemoryStore()
    broker = InMemoryBroker().with_middlewares(DedupMiddleware(store), Deliveries())
    guard = ReservationGuard(store)
    gate = asyncio.Event()
    runs: list[tuple[str, str, list[str]]] = []

    @reserve(max_concurrent=1, scope="user")
    @deduplicate("until_executed", keys=["user"], on_conflict="reschedule_once")
    @broker.task
    async def sync_user(user: int, note: str, context: Context = CONTEXT) -> None:
        slots = [slot.member for slot in guard.active(f"user={user}")]
        runs.append((note, context.message.task_id, slots))
        if note == "first":
            await gate.wait()

    async def body() -> None:
        first = await sync_user.kiq(1, "first")
        await until(lambda: runs, what="the first run")
        assert (await sync_user.kiq(1, "second")).task_id == first.task_id
        gate.set()
        await until(lambda: len(runs) == 2, what="the rescheduled run")
        await until(lambda: not guard.active("user=1"), what="its slot to be freed")

    run(started(broker, body))
    (_, first_id, first_slots), (note, second_id, second_slots) = runs
    assert first_slots == [first_id] and note == "second" and second_slots == [second_id]
