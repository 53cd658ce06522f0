"""Deduplicator decisions as an adapter sees them, on the in-memory store and on Redis."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from taskdedup import (
    ConfigError,
    Deduplicator,
    DuplicateJob,
    MemoryStore,
    Policy,
    Settings,
    StoreUnavailable,
)
from taskdedup.stores.base import Op, Release, Store


def send_email(user_id: int, template: str = "welcome") -> None: ...


def make(strategy: str = "until_executed", **kw: Any) -> Any:
    return Policy(strategy=strategy, **kw).bind("mail.send", send_email)  # type: ignore[arg-type]


@pytest.fixture
def dedup(taskdedup_store: Store) -> Deduplicator:
    # taskdedup's own pytest plugin: the in-memory store on a fake clock, or Redis with
    # --taskdedup-redis. grace >= ttl: locks need no publish confirmation here (as with the
    # fused Redis push); waiting for one is tested on its own below
    return Deduplicator(taskdedup_store, Settings(grace=86400))


def test_a_duplicate_gets_the_holders_job_and_equal_calls_share_a_key(dedup: Deduplicator) -> None:
    tp = make()
    first = dedup.enqueue(tp, (42,), job_id="job-1")
    assert first.acquired and first.should_publish and not first.deduplicated
    for args, kwargs in [((42,), {}), ((), {"user_id": 42}), ((42, "welcome"), {})]:
        dup = dedup.enqueue(tp, args, kwargs, job_id="job-2")
        assert dup.deduplicated and dup.job_id == "job-1" and dup.key == first.key
    assert dedup.enqueue(tp, (43,), job_id="job-3").acquired


def test_on_conflict_raise_carries_the_holders_id(dedup: Deduplicator) -> None:
    tp = make(on_conflict="raise")
    dedup.enqueue(tp, (1,), job_id="job-1")
    with pytest.raises(DuplicateJob) as err:
        dedup.enqueue(tp, (1,), job_id="job-2")
    assert err.value.job_id == "job-1" and "mail.send" in str(err.value)


def test_lifecycle_until_executed(dedup: Deduplicator) -> None:
    tp = make()
    t = dedup.enqueue(tp, (1,), job_id="A")
    assert t.key is not None
    run = dedup.claim(tp, "A", key=t.key)
    assert run.should_run and run.fence == t.fence and run.lease is not None
    assert dedup.enqueue(tp, (1,)).deduplicated
    again = dedup.claim(tp, "A", key=t.key)  # a redelivery while it runs
    assert again.outcome == "running" and not again.should_run
    assert dedup.heartbeat([run.lease]) == (True,)
    assert dedup.finish(tp, t.key, "A").released
    assert dedup.claim(tp, "A", args=(1,)).outcome == "done"  # key recomputed from args
    assert dedup.enqueue(tp, (1,)).acquired


def test_reschedule_once_hands_off_with_the_latest_payload(dedup: Deduplicator) -> None:
    tp = make(on_conflict="reschedule_once")
    t = dedup.enqueue(tp, (1,), job_id="A", payload="first")
    assert t.key is not None
    dedup.claim(tp, "A", key=t.key)
    dedup.enqueue(tp, (1,), payload="second")
    dedup.enqueue(tp, (1,), payload="third")
    done = dedup.finish(tp, t.key, "A")
    assert done.handoff is not None and done.handoff.payload == "third"
    assert dedup.enqueue(tp, (1,)).job_id == done.handoff.job_id


def test_scheduled_jobs_are_deduplicated_only_when_asked(dedup: Deduplicator) -> None:
    plain, scheduled = make(), make(including_scheduled=True)
    assert dedup.enqueue(plain, (1,), delay=60).outcome == "skipped"
    assert dedup.enqueue(plain, (1,), delay=60).outcome == "skipped"
    first = dedup.enqueue(scheduled, (2,), delay=60, job_id="A")
    assert first.acquired
    assert dedup.enqueue(scheduled, (2,), delay=60).job_id == "A"


def test_kill_switch_disabled_tasks_and_dry_run() -> None:
    tp = make()
    off = Deduplicator(MemoryStore(), Settings(enabled=False))
    assert off.enqueue(tp, (1,)).outcome == off.enqueue(tp, (1,)).outcome == "skipped"
    some = Deduplicator(MemoryStore(), Settings(disabled_tasks=frozenset({"mail.send"})))
    assert some.enqueue(tp, (1,)).should_publish and some.enqueue(tp, (1,)).should_publish
    dry = Deduplicator(MemoryStore(), Settings(dry_run=True))
    a = dry.enqueue(make(on_conflict="raise"), (1,), job_id="A")
    b = dry.enqueue(make(on_conflict="raise"), (1,), job_id="B")
    assert a.acquired and b.outcome == "duplicate" and b.should_publish and b.job_id == "B"
    assert dry.stats["enqueue.would_deduplicate"] == 1
    assert a.key is not None
    dry.claim(tp, "A", key=a.key)
    assert dry.claim(tp, "A", key=a.key).should_run  # dry run skips nothing


class DownStore(Store):
    prefix = "down"

    def run(self, op: Op[Any]) -> Any:
        raise StoreUnavailable("connection refused")

    async def arun(self, op: Op[Any]) -> Any:
        raise StoreUnavailable("connection refused")


def test_store_outage_follows_on_store_error(caplog: pytest.LogCaptureFixture) -> None:
    tp = make()
    lenient = Deduplicator(DownStore())
    with caplog.at_level(logging.WARNING, logger="taskdedup"):
        t = lenient.enqueue(tp, (1,))
    assert t.outcome == "store_unavailable" and t.should_publish
    assert "store_unavailable" in caplog.text and "mail.send" in caplog.text
    strict = Deduplicator(DownStore(), Settings(on_store_error="raise"))
    with pytest.raises(StoreUnavailable):
        strict.enqueue(tp, (1,))
    # the worker side: an accepted job is neither failed nor run unguarded; it is sent back
    # with a growing delay, whatever on_store_error says (G14)
    for dedup in (lenient, strict):
        delays = []
        for waits in range(7):
            admission = dedup.claim(tp, "A", args=(1,), store_waits=waits)
            assert admission.outcome == "store_unavailable" and not admission.should_run
            delays.append(admission.retry_after)
        assert delays == [1, 2, 4, 8, 16, 30, 30]


def test_failed_publish_releases_the_lock(dedup: Deduplicator) -> None:
    tp = make()
    t = dedup.enqueue(tp, (1,), job_id="A")
    assert dedup.publish_failed(t)
    assert dedup.enqueue(tp, (1,), job_id="B").acquired


def test_one_log_line_per_decision(dedup: Deduplicator, caplog: pytest.LogCaptureFixture) -> None:
    tp = make()
    with caplog.at_level(logging.DEBUG, logger="taskdedup"):
        t = dedup.enqueue(tp, (1,), job_id="A")
        dedup.enqueue(tp, (1,), job_id="B")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "acquired mail.send" in lines[0] and f"key={t.key}" in lines[0]
    assert "duplicate mail.send" in lines[1] and "holder=A" in lines[1]
    assert dedup.stats["enqueue.acquired"] == 1 and dedup.stats["enqueue.duplicate"] == 1


def test_async_callers_share_the_logic(dedup: Deduplicator) -> None:
    tp = make()

    async def scenario() -> None:
        t = await dedup.aenqueue(tp, (7,), job_id="A")
        assert t.acquired and t.key is not None
        assert (await dedup.aenqueue(tp, (7,))).job_id == "A"
        run = await dedup.aclaim(tp, "A", key=t.key)
        assert run.should_run and run.lease is not None
        assert await dedup.aheartbeat([run.lease]) == (True,)
        assert await dedup.aretry(tp, t.key, "A")
        assert (await dedup.aclaim(tp, "A", key=t.key, attempt=1)).should_run
        assert (await dedup.afinish(tp, t.key, "A")).released

    asyncio.run(scenario())


def test_grace_is_confirmed_in_the_background(redis_url: str, key_prefix: str) -> None:
    from taskdedup import RedisStore

    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store, Settings(grace=30, key_prefix=key_prefix))
    tp = make(ttl=3600)
    t = dedup.enqueue(tp, (1,), job_id="A")
    assert t.confirm and t.key is not None
    from taskdedup.stores.base import Inspect

    info = store.run(Inspect(t.key))
    assert info is not None and not info.confirmed and info.ttl_ms <= 30_000
    dedup.published(t)
    dedup.close()  # flushes pending confirmations
    info = store.run(Inspect(t.key))
    assert info is not None and info.confirmed and info.ttl_ms > 3_000_000


def test_bad_policies_are_refused_when_the_task_is_defined() -> None:
    for bad in [
        {"strategy": "until_done"},
        {"on_conflict": "ignore"},
        {"ttl": 0},
        {"lease": -1},
        {"keys": ["user_id"], "key": lambda user_id: user_id},
        {"strategy": "until_expired", "on_conflict": "reschedule_once"},
        {"max_attempts": 0},
    ]:
        with pytest.raises(ConfigError):
            Policy(**bad).bind("mail.send", send_email)
    with pytest.raises(ConfigError, match=r"'user'.*user_id, template"):
        Policy(keys=["user"]).bind("mail.send", send_email)


def test_a_repeat_of_an_idempotency_key_still_being_published_gives_up_after_the_wait() -> None:
    """The first submission neither published nor failed within ``idempotency_wait``: the
    repeat is told so (sync and asyncio) instead of getting a job that may never exist."""
    from taskdedup import IdempotencyKeyInProgress, IdempotencyKeys

    dedup = Deduplicator(MemoryStore(), Settings(idempotency_wait=0.2))
    keys = IdempotencyKeys(dedup)
    first = keys.recall("ci-7", "ci.build", "fp", "job-1")
    assert first.is_new  # and never published nor freed: its producer hangs
    with pytest.raises(IdempotencyKeyInProgress, match="job-1") as raised:
        keys.recall("ci-7", "ci.build", "fp", "job-2")
    assert raised.value.key == "ci-7" and raised.value.job_id == "job-1"
    with pytest.raises(IdempotencyKeyInProgress):
        asyncio.run(keys.arecall("ci-7", "ci.build", "fp", "job-3"))
    keys.published(first)
    dedup.confirmer.flush()
    hit = asyncio.run(keys.arecall("ci-7", "ci.build", "fp", "job-4"))
    assert hit.hit and hit.job_id == "job-1"
    assert dedup.stats["idempotency.in_progress"] == 2


def test_a_confirmation_the_store_could_not_take_is_sent_again() -> None:
    """The store missed the first confirmation batch: it is sent again while the grace lasts,
    so a repeat of the key gets its hit instead of waiting out the grace."""
    from taskdedup import IdempotencyKeys
    from taskdedup.stores.base import Confirm

    store = MemoryStore()
    run, failures = store.run, [1]

    def flaky(op: Any) -> Any:
        if isinstance(op, Confirm) and failures[0]:
            failures[0] -= 1
            raise StoreUnavailable("Redis did not answer: injected")
        return run(op)

    store.run = flaky  # type: ignore[method-assign]
    dedup = Deduplicator(store, Settings(idempotency_wait=3))
    keys = IdempotencyKeys(dedup)
    first = keys.recall("ci-8", "ci.build", "fp", "job-1")
    keys.published(first)  # the confirmer thread sends it; the store misses it once
    again = keys.recall("ci-8", "ci.build", "fp", "job-2")
    assert again.hit and again.job_id == "job-1" and failures == [0]


def test_the_kill_switch_and_dry_run_answer_no_idempotency_key_and_never_wait() -> None:
    from taskdedup import IdempotencyKeys

    store = MemoryStore()
    IdempotencyKeys(Deduplicator(store)).recall("ci-9", "ci.build", "fp", "job-1")  # pending
    for settings in (Settings(enabled=False), Settings(dry_run=True)):
        dedup = Deduplicator(store, settings)
        again = IdempotencyKeys(dedup).recall("ci-9", "ci.build", "fp", "job-2")
        assert again.is_new and again.job_id == "job-2"  # published as if no key was given
    assert dedup.stats["idempotency.would_hit"] == 1


def test_a_mismatch_is_raised_at_once_even_while_the_first_is_being_published() -> None:
    from taskdedup import IdempotencyKeyInProgress, IdempotencyKeyMismatch, IdempotencyKeys

    dedup = Deduplicator(MemoryStore(), Settings(idempotency_wait=0))
    keys = IdempotencyKeys(dedup)
    keys.recall("ci-10", "ci.build", "fp-a", "job-1")  # not published yet
    with pytest.raises(IdempotencyKeyMismatch):
        keys.recall("ci-10", "ci.build", "fp-b", "job-2")
    with pytest.raises(IdempotencyKeyInProgress, match="after 0 s"):  # 0: no wait at all
        keys.recall("ci-10", "ci.build", "fp-a", "job-3")
    with pytest.raises(ConfigError, match="idempotency_wait"):
        Settings(idempotency_wait=-1)


def test_a_duplicate_waits_for_a_holder_still_being_published() -> None:
    """The holder's lock is not confirmed yet: its publish may fail. A duplicate waits; if the
    publish fails it becomes the job, if it is confirmed it is the holder's duplicate."""
    import threading

    dedup = Deduplicator(MemoryStore(), Settings(grace=60))
    tp = make()
    answers: list[Any] = []

    def duplicate(job_id: str) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: answers.append(dedup.enqueue(tp, (1,), job_id=job_id))
        )
        thread.start()
        return thread

    first = dedup.enqueue(tp, (1,), job_id="A")
    waiting = duplicate("B")
    waiting.join(0.3)
    assert waiting.is_alive() and not answers  # it waits for A's publish
    dedup.publish_failed(first)
    waiting.join(5)
    assert answers[0].acquired and answers[0].job_id == "B"  # A never existed: B is the job
    dedup.published(answers[0])
    duplicate("C").join(5)
    assert answers[1].deduplicated and answers[1].job_id == "B"


class FlakyStore(Store):
    """A MemoryStore that can be taken down (every operation then raises StoreUnavailable)."""

    prefix = "flaky"

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.down = False

    def run(self, op: Op[Any]) -> Any:
        if self.down:
            raise StoreUnavailable("connection refused")
        return self.inner.run(op)

    async def arun(self, op: Op[Any]) -> Any:
        return self.run(op)


def test_a_release_the_store_missed_is_sent_again_once_it_answers() -> None:
    """A revoked job's (or a failed publish's) release meets an outage: the lock must not then
    live out its ttl (G13); it is freed once the store answers again."""
    import time

    store = FlakyStore()
    dedup = Deduplicator(store, Settings(grace=86400))
    dedup.releaser.interval = 0.05
    tp = make()
    ticket = dedup.enqueue(tp, (5,), job_id="revoked")
    assert ticket.key is not None
    store.down = True
    assert not dedup.release(ticket.key, "revoked")
    assert dedup.releaser.pending() == 1
    store.down = False
    deadline = time.monotonic() + 5
    while dedup.releaser.pending():
        assert time.monotonic() < deadline, "the missed release was never sent again"
        time.sleep(0.02)
    assert dedup.enqueue(tp, (5,), job_id="next").acquired


@pytest.mark.parametrize("batcher", ["confirmer", "releaser"])
def test_a_child_forked_while_a_background_batch_holds_its_lock_can_still_use_it(
    batcher: str,
) -> None:
    """Celery's prefork pool forks children from a main process whose background threads may
    be flushing at that moment: the child must not inherit a lock held for ever."""
    import os
    import signal

    dedup = Deduplicator(MemoryStore())
    batch = getattr(dedup, batcher)
    with batch._mutex:  # as a flush in the parent's thread would, at the fork
        pid = os.fork()
        if pid == 0:  # the child: add work, which takes the lock; killed if it blocks
            signal.alarm(5)
            if batcher == "confirmer":
                batch.add("k", "job")
            else:
                batch.add(Release("k", "job"))
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the forked child blocked on the {batcher}'s lock (status {status})"
    )


def test_a_debounced_burst_whose_delivery_comes_late_still_runs_its_latest_arguments(
    redis_url: str, key_prefix: str
) -> None:
    """The burst's one message comes long after its run was due (a backlog in the queue): the
    lock still holds the burst's latest arguments (it lives the ttl, not just past max_wait),
    submissions meanwhile fold into it, and the late delivery runs the latest of them. Found
    by the chaos soak: the lock lapsed a grace after max_wait and the run took its message's
    first arguments."""
    from taskdedup import RedisStore
    from taskdedup.stores.base import Inspect

    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix), Settings(grace=0.2))
    policy = make("debounce", delay=0.2, max_wait=0.5, ttl=3600, keys=["user_id"])
    first = dedup.enqueue(policy, (1, "a"), job_id="late")
    dedup.published(first)
    dedup.confirmer.flush()
    assert dedup.enqueue(policy, (1, "b"), payload='[1, "b"]').job_id == "late"
    time.sleep(0.5 + 0.2 + 0.3)  # past the cap and a grace: the delivery has not come yet
    held = dedup.store.run(Inspect(first.key or ""))
    assert held is not None and held.ttl_ms > 3_000_000  # it lives its ttl
    assert dedup.enqueue(policy, (1, "c"), payload='[1, "c"]').job_id == "late"  # folded in
    run = dedup.claim(policy, "late", key=first.key)
    assert run.should_run and run.arguments == '[1, "c"]'  # the latest, however late
    dedup.finish(policy, first.key or "", "late")
    dedup.close()


def test_a_run_owed_to_a_holder_whose_record_is_gone_writes_no_record_without_expiry(
    redis_url: str, key_prefix: str
) -> None:
    """G9: the owed run is copied into the running holder's job record only when that record
    exists; a record gone (evicted, deleted by hand) is not written anew without a ttl."""
    import redis as redis_client

    from taskdedup import RedisStore
    from taskdedup.stores.base import Acquire, Claim

    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    store.run(Acquire("k", "A", 60_000, 60_000, True, None, "t"))
    store.run(Claim("k", "A", "w", 30_000, 60_000, "hold", False, 60_000))
    record = f"{key_prefix}:{{k}}:job:A"
    client = redis_client.Redis.from_url(redis_url)
    assert client.exists(record)
    client.delete(record)
    owed = store.run(Acquire("k", "N", 60_000, 60_000, True, "n", "t"))
    assert owed.running and not client.exists(record)
    client.close()
    store.close()
