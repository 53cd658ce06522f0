"""G1 (atomic), G2 (one round trip), G4 (crash-safe at core level) against real stores."""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from harness import race
from taskdedup import Deduplicator, Heartbeat, MemoryStore, Policy, RedisStore, Settings, Ticket
from taskdedup.stores import from_url
from taskdedup.stores.base import Confirm, Lease, Store
from taskdedup.testing import FakeClock


def build(user_id: int) -> None: ...


BUILD = Policy("until_executed").bind("ci.build", build)


@pytest.mark.parametrize("store_kind", ["memory", "redis", "postgres", "sqlite"])
def test_g1_64_threads_enqueue_one_key_and_exactly_one_acquires(
    store_kind: str, store_url: Callable[[str], str], key_prefix: str
) -> None:
    dedup = Deduplicator(from_url(store_url(store_kind), key_prefix=key_prefix))

    def publish(i: int) -> Ticket:  # a producer: the lock, the publish (assumed), confirmed
        ticket = dedup.enqueue(BUILD, (7,), job_id=f"job-{i}")
        dedup.published(ticket)
        return ticket

    tickets = race(64, publish)
    winners = [t for t in tickets if t.acquired]
    assert len(winners) == 1
    assert {t.job_id for t in tickets} == {winners[0].job_id}
    assert sum(t.deduplicated for t in tickets) == 63


def _enqueue_in_process(url: str, prefix: str, i: int, barrier: Any, out: Any) -> None:
    dedup = Deduplicator(from_url(url, key_prefix=prefix))
    barrier.wait()
    ticket = dedup.enqueue(BUILD, (7,), job_id=f"proc-{i}")
    dedup.published(ticket)
    dedup.close()  # sends the confirmation the other processes wait for
    out.put((ticket.acquired, ticket.job_id))


@pytest.mark.parametrize("store_kind", ["redis", "postgres", "sqlite"])
def test_g1_8_processes_enqueue_one_key_and_exactly_one_acquires(
    store_kind: str, store_url: Callable[[str], str], key_prefix: str
) -> None:
    url = store_url(store_kind)
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(8), ctx.Queue()
    procs = [
        ctx.Process(target=_enqueue_in_process, args=(url, key_prefix, i, barrier, out))
        for i in range(8)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(acquired for acquired, _ in results) == 1
    holder = next(job for acquired, job in results if acquired)
    assert {job for _, job in results} == {holder}


class CountingConnection(redis.Connection):
    """Counts what the client sends: one send is one round trip."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_g2_acquire_claim_and_finish_are_one_command_each(private_redis_url: str) -> None:
    client = redis.Redis.from_url(private_redis_url, connection_class=CountingConnection)
    observer = redis.Redis.from_url(private_redis_url)
    dedup = Deduplicator(RedisStore(client, key_prefix="g2"))
    warm = dedup.enqueue(BUILD, (0,), job_id="warm")  # loads the scripts
    assert warm.key is not None
    dedup.finish(BUILD, warm.key, "warm")
    dedup.claim(BUILD, "warm", key=warm.key)
    dedup.release(warm.key, "warm")
    dedup.store.run(Confirm(((warm.key, "warm"),)))
    dedup.heartbeat([Lease(warm.key, "warm", 1000)])

    def sent_by(action: Callable[[], Any]) -> tuple[int, int]:
        """(round trips our client made, EVALSHA calls the server ran) for one action."""
        sends, evals = CountingConnection.sends, evalsha_calls(observer)
        action()
        return CountingConnection.sends - sends, evalsha_calls(observer) - evals

    ticket: list[Ticket] = []
    assert sent_by(lambda: ticket.append(dedup.enqueue(BUILD, (1,), job_id="A"))) == (1, 1)
    key = ticket[0].key
    assert key is not None
    dedup.published(ticket[0])
    dedup.confirmer.flush()
    assert sent_by(lambda: dedup.enqueue(BUILD, (1,), job_id="B")) == (1, 1)
    assert sent_by(lambda: dedup.claim(BUILD, "A", key=key)) == (1, 1)
    assert sent_by(lambda: dedup.finish(BUILD, key, "A")) == (1, 1)
    # work that can wait goes out as one batch: ten jobs' heartbeats or confirmations
    dedup.confirmer.interval = 3600  # the test flushes by hand
    tickets = [dedup.enqueue(BUILD, (n,), job_id=f"J{n}") for n in range(100, 110)]
    for t in tickets:
        dedup.published(t)
    confirmed: list[int] = []
    assert sent_by(lambda: confirmed.append(dedup.confirmer.flush())) == (1, 1)  # one script
    assert confirmed == [10]  # ... confirms the ten locks
    leases = [dedup.claim(BUILD, t.job_id, key=t.key).lease for t in tickets if t.key]
    assert sent_by(lambda: dedup.heartbeat(lease for lease in leases if lease)) == (1, 10)
    client.close()
    observer.close()


def test_g2_scripts_reload_after_the_server_forgets_them(private_redis_url: str) -> None:
    client = redis.Redis.from_url(private_redis_url)
    dedup = Deduplicator(RedisStore(client, key_prefix="noscript"))
    first = dedup.enqueue(BUILD, (1,), job_id="A")
    assert first.acquired
    dedup.published(first)
    dedup.confirmer.flush()
    client.script_flush()
    assert dedup.enqueue(BUILD, (1,), job_id="B").job_id == "A"
    client.close()


def test_g4_core_heartbeat_keeps_a_job_and_a_dead_one_frees_its_key_after_the_lease(
    redis_url: str, key_prefix: str
) -> None:
    policy = Policy("until_executed", lease=0.6).bind("ci.build", build)
    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix))
    alive = dedup.enqueue(policy, (1,), job_id="alive")
    dead = dedup.enqueue(policy, (2,), job_id="dead")
    assert alive.key and dead.key
    run = dedup.claim(policy, "alive", key=alive.key)
    dedup.claim(policy, "dead", key=dead.key)  # its worker dies: nobody renews it
    beat = Heartbeat(dedup)
    assert run.lease is not None
    beat.add(run.lease)
    try:
        deadline = time.monotonic() + 5.6  # lease + 5 s
        while not dedup.enqueue(policy, (2,), job_id="next").acquired:
            assert time.monotonic() < deadline, "a dead worker's key was not freed in time"
            time.sleep(0.05)
        time.sleep(1.2)  # two leases' worth: the live job must still hold its key
        assert dedup.enqueue(policy, (1,), job_id="other").job_id == "alive"
    finally:
        beat.stop()
    assert beat._thread is None


def test_a_shorter_lease_added_while_the_heartbeat_waits_is_renewed_in_time(
    redis_url: str, key_prefix: str
) -> None:
    """The heartbeat thread is woken only by a lease that needs a beat sooner than the one it
    planned (not by every job): a 0.6 s lease added while it waits 10 s for a 30 s lease's
    beat is still renewed, and its job keeps its key for several leases."""
    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix))
    long = Policy("until_executed", lease=30).bind("ci.build", build)
    short = Policy("until_executed", lease=0.6).bind("ci.build", build)
    slow, quick = dedup.enqueue(long, (1,), job_id="slow"), dedup.enqueue(short, (2,), job_id="q")
    assert slow.key and quick.key
    slow_lease = dedup.claim(long, "slow", key=slow.key).lease
    quick_lease = dedup.claim(short, "q", key=quick.key).lease
    assert slow_lease is not None and quick_lease is not None
    beat = Heartbeat(dedup)
    try:
        beat.add(slow_lease)
        deadline = time.monotonic() + 5
        while beat._due == float("inf"):  # the thread has planned its first beat (in 10 s)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        beat.add(quick_lease)
        ends = time.monotonic() + 2.0  # more than three of its leases
        while time.monotonic() < ends:
            assert dedup.enqueue(short, (2,), job_id="other").job_id == "q", "lease lapsed"
            time.sleep(0.1)
    finally:
        beat.stop()


def test_g4_core_with_a_fake_clock(taskdedup_store: Store, taskdedup_clock: FakeClock) -> None:
    clock = taskdedup_clock  # the plugin's: the in-memory store runs on it
    dedup = Deduplicator(taskdedup_store)
    policy = Policy("until_executed", lease=30).bind("ci.build", build)
    t = dedup.enqueue(policy, (1,), job_id="A")
    assert t.key is not None
    dedup.claim(policy, "A", key=t.key)
    clock.advance(29)
    assert dedup.enqueue(policy, (1,)).job_id == "A"
    clock.advance(1.01)
    b = dedup.enqueue(policy, (1,), job_id="B")
    assert b.acquired
    # A's copy is stale now (G12): while B runs it waits, then runs after it
    assert dedup.claim(policy, "B", key=t.key).should_run
    stale = dedup.claim(policy, "A", key=t.key)
    assert stale.outcome == "busy" and stale.holder == "B" and not stale.should_run
    dedup.finish(policy, t.key, "B")
    again = dedup.claim(policy, "A", key=t.key)
    assert again.should_run and again.attempts == 2 and again.fence > b.fence


def test_async_heartbeat_renews_and_stops_cleanly() -> None:
    import asyncio

    from taskdedup import AsyncHeartbeat

    clock = FakeClock()
    dedup = Deduplicator(MemoryStore(clock=clock), Settings(default_lease=0.3))
    policy = Policy("until_executed", lease=0.3).bind("ci.build", build)

    async def scenario() -> None:
        t = await dedup.aenqueue(policy, (1,), job_id="A")
        assert t.key is not None
        run = await dedup.aclaim(policy, "A", key=t.key)
        assert run.lease is not None
        beat = AsyncHeartbeat(dedup)
        beat.add(run.lease)
        for _ in range(5):  # the fake clock moves a lease's worth; only beats keep the lock
            clock.advance(0.2)
            deadline = time.monotonic() + 5
            before = dedup.stats["heartbeat.renewed"]
            while dedup.stats["heartbeat.renewed"] == before:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        assert (await dedup.aenqueue(policy, (1,))).job_id == "A"
        await beat.stop()
        assert beat._task is None

    asyncio.run(scenario())


def test_heartbeats_go_out_every_lease_third_not_once_per_job() -> None:
    clock = FakeClock()
    dedup = Deduplicator(MemoryStore(clock=clock))
    policy = Policy("until_executed", lease=0.9).bind("ci.build", build)
    beat = Heartbeat(dedup)
    try:
        started = time.monotonic()
        for n in range(50):  # 50 jobs start within a fraction of the 0.3 s interval
            t = dedup.enqueue(policy, (n,), job_id=f"J{n}")
            run = dedup.claim(policy, t.job_id, key=t.key)
            assert run.lease is not None
            beat.add(run.lease)
        deadline = time.monotonic() + 5
        while dedup.stats["heartbeat.renewed"] < 50:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        elapsed = time.monotonic() - started
        assert dedup.stats["heartbeat.renewed"] == 50  # one batch renewed all 50
        assert elapsed >= 0.25  # and it waited for the interval instead of beating per job
    finally:
        beat.stop()


def test_g2_an_idempotency_key_and_a_reservation_are_one_command_each(
    private_redis_url: str,
) -> None:
    from taskdedup import IdempotencyKeys, ReservationGuard

    client = redis.Redis.from_url(private_redis_url, connection_class=CountingConnection)
    observer = redis.Redis.from_url(private_redis_url)
    dedup = Deduplicator(RedisStore(client, key_prefix="g2i"))
    keys, guard = IdempotencyKeys(dedup), ReservationGuard(dedup.store)
    keys.recall("warm", "t", "fp", "warm")  # loads the scripts
    guard.reserve("warm", 1).release()

    def sent_by(action: Callable[[], Any]) -> tuple[int, int]:
        sends, evals = CountingConnection.sends, evalsha_calls(observer)
        action()
        return CountingConnection.sends - sends, evalsha_calls(observer) - evals

    first: list[Any] = []
    assert sent_by(lambda: first.append(keys.recall("ci-1", "t", "fp", "A"))) == (1, 1)  # new
    keys.published(first[0])  # the job is out: its record is confirmed by the next batch
    dedup.confirmer.flush()
    assert sent_by(lambda: keys.recall("ci-1", "t", "fp", "B")) == (1, 1)  # hit
    assert sent_by(lambda: guard.reserve("user-1", 5, member="A")) == (1, 1)
    client.close()
    observer.close()


def test_an_async_heartbeat_ends_when_cancelled_as_it_is_woken() -> None:
    """asyncio.run cancels leftover tasks when it closes. A cancel that lands as the heartbeat
    is woken (a lease added) must still end it (wait_for on 3.11 could swallow it: a hang)."""
    import asyncio

    from taskdedup import AsyncHeartbeat, MemoryStore

    async def main() -> bool:
        beat = AsyncHeartbeat(Deduplicator(MemoryStore()))
        beat.add(Lease("k", "j", 60_000))
        await asyncio.sleep(0.01)  # the loop now waits to be woken or for its next beat
        task = beat._task
        assert task is not None
        beat.add(Lease("k2", "j", 60_000))  # wakes it...
        task.cancel()  # ...in the same turn as the cancel
        await asyncio.wait({task}, timeout=2)
        return task.done()

    assert asyncio.run(main()), "the heartbeat swallowed its cancel"


def test_heartbeat_reports_as_lost_only_a_lease_still_held_and_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job that ends while its renewal is on the way is not 'lost' (its record says done by
    then); a lease the store no longer knows, of a job still running, is reported once, with
    its task's name, and is no longer renewed."""
    from taskdedup.background import _Leases
    from taskdedup.stores.base import Heartbeat as HeartbeatOp

    class RacingStore(MemoryStore):
        before_beat: Callable[[], None] | None = None

        def run(self, op: Any) -> Any:
            if isinstance(op, HeartbeatOp) and self.before_beat is not None:
                self.before_beat()
            return super().run(op)

    store = RacingStore()
    dedup = Deduplicator(store, Settings(grace=86400))
    policy = Policy("until_executed", lease=30).bind("ci.build", build)
    ending = dedup.enqueue(policy, (1,), job_id="ending")
    assert ending.key is not None
    ending_lease = dedup.claim(policy, "ending", key=ending.key).lease
    assert ending_lease is not None
    orphan = Lease("some-key", "orphan", 30_000, task="ci.orphan")  # its lock lapsed meanwhile
    beat = Heartbeat(dedup)
    for lease in (ending_lease, orphan):  # held, with no thread: the test beats by hand
        _Leases.add(beat, lease)

    def job_ends() -> None:  # the job ends between the snapshot and the store's answer
        dedup.finish(policy, ending.key or "", "ending")
        beat.discard(ending_lease)

    store.before_beat = job_ends
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        beat.beat()
        store.before_beat = None
        beat.beat()
    lost = [r.getMessage() for r in caplog.records if "heartbeat lost" in r.getMessage()]
    assert len(lost) == 1 and "ci.orphan" in lost[0] and "orphan" in lost[0], lost
    assert beat.snapshot() == []
