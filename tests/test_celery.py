"""Celery: real in-process workers on a Redis broker (solo and threads pools)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import race, wait_for
from taskdedup import CorruptRecord, DuplicateJob, KeyEncodingError
from taskdedup.celery import deduplicate, install
from taskdedup.celery.tasks import task_policy
from taskdedup.stores.base import Inspect


def make_app(redis_url: str, prefix: str, **conf: Any) -> Celery:
    app = Celery(prefix, broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:result:"},
        task_default_queue=f"{prefix}-q",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        taskdedup_key_prefix=prefix,
        **conf,
    )
    return app


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Celery:
    app = make_app(redis_url, key_prefix)
    install(app)
    return app


@pytest.fixture
def runs() -> Iterator[list[Any]]:
    yield []


def queue_length(app: Celery, redis_url: str, prefix: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(f"{prefix}:kombu:{prefix}-q"))
    finally:
        client.close()


def test_32_threads_delay_the_same_call_one_message_one_id(
    app: Celery, redis_url: str, key_prefix: str, runs: list[Any]
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> str:
        runs.append(sha)
        return sha

    results = race(32, lambda _: build.delay("abc123"))
    ids = {r.id for r in results}
    assert len(ids) == 1
    assert sum(not r.deduplicated for r in results) == 1
    assert queue_length(app, redis_url, key_prefix) == 1
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert results[0].get(timeout=20) == "abc123"
    assert runs == ["abc123"]


def test_until_executed_holds_through_the_run_and_the_job_reads_key_and_fence(
    app: Celery, runs: list[Any]
) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed", lease=5)
    @app.task(shared=False, bind=True)
    def report(self: Any, day: str) -> dict[str, Any]:
        runs.append((self.request.taskdedup_key, self.request.taskdedup_fence))
        started.set()
        assert release.wait(20)
        return {"day": day}

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = report.delay("mon")
        assert started.wait(20)
        during = report.delay("mon")
        assert during.deduplicated and during.id == first.id
        release.set()
        assert first.get(timeout=20) == {"day": "mon"}
        after = wait_for(lambda: (r := report.delay("mon")) and not r.deduplicated and r)
        assert after.id != first.id
        after.get(timeout=20)
    (key, fence), (key2, fence2) = runs
    assert key == key2 and len(key) == 32 and fence2 > fence > 0


def test_until_executing_frees_the_key_when_the_job_starts(app: Celery) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executing")
    @app.task(shared=False)
    def sync(account: int) -> int:
        started.set()
        assert release.wait(20)
        return account

    queued = sync.delay(1)
    assert sync.delay(1).id == queued.id  # still queued: deduplicated
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert started.wait(20)
        second = sync.delay(1)  # running: a new job is accepted
        assert not second.deduplicated and second.id != queued.id
        release.set()
        assert queued.get(timeout=20) == 1 and second.get(timeout=20) == 1


def test_on_conflict_raise_carries_the_holders_id(app: Celery) -> None:
    @deduplicate("until_executed", on_conflict="raise")
    @app.task(shared=False)
    def charge(order: int) -> None: ...

    first = charge.delay(7)
    with pytest.raises(DuplicateJob) as err:
        charge.delay(7)
    assert err.value.job_id == first.id


def test_a_task_failing_twice_then_succeeding_holds_its_lock_throughout(
    app: Celery, key_prefix: str, runs: list[Any]
) -> None:
    @deduplicate("until_executed", lease=5)
    @app.task(shared=False, bind=True, max_retries=5)
    def flaky(self: Any, n: int) -> str:
        runs.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.3, exc=RuntimeError("not yet"))
        return "ok"

    with start_worker(app, pool="solo", perform_ping_check=False):
        job = flaky.delay(1)
        seen = set()
        while not job.ready():
            dup = flaky.delay(1)
            if dup.id != job.id:  # freed as its last attempt returned, before the result landed
                assert 2 in runs, "the retrying job lost its lock"
                dup.get(timeout=20)
                break
            assert dup.deduplicated
            seen.add(len(runs))
            time.sleep(0.05)
        assert job.get(timeout=20) == "ok"
    assert runs[:3] == [0, 1, 2]
    assert not flaky.delay(1).deduplicated  # released after the success


def test_reschedule_once_runs_once_more_with_the_latest_arguments(
    app: Celery, runs: list[Any]
) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed", keys=["user_id"], on_conflict="reschedule_once")
    @app.task(shared=False)
    def sync_user(user_id: int, note: str) -> str:
        runs.append(note)
        if note == "first":
            started.set()
            assert release.wait(20)
        return note

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = sync_user.delay(1, "first")
        assert started.wait(20)
        assert sync_user.delay(1, "second").id == first.id
        assert sync_user.delay(1, "third").id == first.id
        release.set()
        first.get(timeout=20)
        wait_for(lambda: len(runs) == 2, what="the rescheduled run")
        time.sleep(0.5)  # a wrong implementation would run a third time here
    assert runs == ["first", "third"]


def test_a_busy_job_sent_again_by_the_worker_runs_after_the_holder(
    redis_url: str, key_prefix: str, runs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """until_and_while_executing: a job enqueued while the holder runs is busy at its start
    and sent again later by the worker. That copy must reach the queue even though its own
    lock (taken in the broker push, by another producer) is already marked as pushed."""
    caplog.set_level(logging.INFO, logger="taskdedup")
    started, release = threading.Event(), threading.Event()

    def define(app: Celery) -> Any:
        @deduplicate("until_and_while_executing", keys=["acct"], including_scheduled=True)
        @app.task(name="t.sync", shared=False)
        def sync(acct: int, note: str) -> str:
            runs.append(note)
            if note == "first":
                started.set()
                assert release.wait(20)
            return note

        return sync

    producer, other_producer, worker = (make_app(redis_url, key_prefix) for _ in range(3))
    for app in (producer, other_producer, worker):
        install(app)
    define(worker)
    with start_worker(worker, pool="threads", concurrency=2, perform_ping_check=False):
        first = define(producer).delay(1, "first")
        assert started.wait(20)
        second = define(other_producer).delay(1, "second")  # the key was freed at start
        assert not second.deduplicated
        wait_for(lambda: "busy" in caplog.text, 10, "second to find the key busy")
        release.set()
        assert first.get(timeout=20) == "first"
        assert second.get(timeout=20) == "second"
    assert runs == ["first", "second"]


def test_while_executing_never_runs_two_jobs_of_a_key_at_once(app: Celery, runs: list[Any]) -> None:
    @deduplicate("while_executing", lease=5)
    @app.task(shared=False)
    def import_feed(feed: str) -> None:
        runs.append(("start", time.monotonic()))
        time.sleep(0.4)
        runs.append(("end", time.monotonic()))

    with start_worker(app, pool="threads", concurrency=3, perform_ping_check=False):
        jobs = [import_feed.delay("f") for _ in range(3)]
        assert len({j.id for j in jobs}) == 3  # no enqueue lock: none is dropped
        for job in jobs:
            job.get(timeout=30)
    kinds = [kind for kind, _ in sorted(runs, key=lambda r: r[1])]
    assert kinds == ["start", "end"] * 3


def test_revoke_releases_the_lock(app: Celery, runs: list[Any]) -> None:
    """A queued job revoked while a worker listens is discarded when it reaches the worker, and
    its key is free at once (every case of G13: tests/test_celery_revoke.py)."""
    from test_celery_revoke import consume_tasks, held_then_freed, revoke, running_worker

    @deduplicate("until_executed")
    @app.task(shared=False)
    def slow(x: int) -> int:
        runs.append(x)
        return x

    with running_worker(app, consuming=False) as hostname:
        job = slow.delay(1)
        assert slow.delay(1).id == job.id
        revoke(app, job.id, hostname)
        consume_tasks(app, hostname)
        assert held_then_freed(slow, job, 1).get(timeout=20) == 1
    assert runs == [1]  # the fresh job only


def test_scheduled_jobs_are_deduplicated_only_when_asked(app: Celery) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def plain(x: int) -> None: ...

    @deduplicate("until_executed", including_scheduled=True, ttl=60)
    @app.task(shared=False)
    def scheduled(x: int) -> None: ...

    assert not plain.apply_async((1,), countdown=30).deduplicated
    assert not plain.apply_async((1,), countdown=30).deduplicated
    first = scheduled.apply_async((1,), countdown=30)
    assert scheduled.apply_async((1,), countdown=30).id == first.id
    store = install(app).dedup.store
    key = scheduled_key(app, scheduled, 1)
    # once the publish is confirmed, the lock lives ttl + delay (90 s), not just the ttl
    info = wait_for(lambda: (i := store.run(Inspect(key))) and i.confirmed and i, what="confirm")
    assert info.job_id == first.id and 60_000 < info.ttl_ms <= 90_000


def scheduled_key(app: Celery, task: Any, *args: Any) -> str:
    from taskdedup.celery.tasks import task_policy

    policy = task_policy(task, install(app).settings)
    assert policy is not None
    return policy.key_for(args, {})


def test_send_task_by_name_is_deduplicated(app: Celery) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False, name="jobs.by_name")
    def by_name(x: int) -> None: ...

    first = app.send_task("jobs.by_name", (5,))
    second = app.send_task("jobs.by_name", args=(5,))
    assert second.deduplicated and second.id == first.id


def test_bad_arguments_fail_at_enqueue_with_the_task_named(app: Celery) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False, name="jobs.strict")
    def strict(x: int) -> None: ...

    with pytest.raises(KeyEncodingError, match=r"jobs\.strict"):
        strict.delay(object())


def test_install_is_idempotent(app: Celery) -> None:
    first = install(app)
    send = app.send_task
    assert install(app) is first and app.send_task is send


def test_task_option_and_class_based_tasks_with_an_inherited_policy(
    app: Celery, runs: list[Any]
) -> None:
    @app.task(shared=False, deduplicate={"strategy": "until_executed", "keys": ["order_id"]})
    def ship(order_id: int, carrier: str = "ups") -> None: ...

    first = ship.delay(1, "ups")
    assert ship.delay(1, carrier="dhl").id == first.id

    @deduplicate("until_executed", keys=["account"])
    class AccountTask(app.Task):  # type: ignore[misc, name-defined]
        abstract = True

    class Reconcile(AccountTask):  # type: ignore[misc, valid-type]
        name = "accounts.reconcile"

        def run(self, account: str, full: bool = False) -> str:
            runs.append((account, self.request.taskdedup_key))  # the worker side claimed it
            return account

    reconcile = app.register_task(Reconcile())
    job = reconcile.delay("acme")
    assert reconcile.delay("acme", full=True).id == job.id
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert job.get(timeout=20) == "acme"
    assert len(runs) == 1 and runs[0][0] == "acme" and len(runs[0][1]) == 32


def test_a_failed_publish_releases_the_lock_before_the_error(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store other than the broker: the lock is taken first, so a failed publish must give
    it back before the caller sees the error (G5)."""
    from kombu import Producer
    from kombu.exceptions import OperationalError

    from taskdedup import RedisStore

    app = make_app(redis_url, key_prefix)
    store = RedisStore(redis.Redis.from_url(redis_url), key_prefix=key_prefix)
    integ = install(app, store=store)
    assert not integ.fused_publish

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    key = scheduled_key(app, notify, 1)
    seen_during_publish = []

    def broken_publish(self: Any, *args: Any, **kwargs: Any) -> None:
        seen_during_publish.append(store.run(Inspect(key)))
        raise OperationalError("broker went away")

    monkeypatch.setattr(Producer, "publish", broken_publish)
    with pytest.raises(OperationalError):
        notify.delay(1)
    assert seen_during_publish and seen_during_publish[0] is not None  # it was locked...
    assert store.run(Inspect(key)) is None  # ...and released before the raise
    monkeypatch.undo()
    assert not notify.delay(1).deduplicated


def test_on_the_brokers_redis_lock_and_message_go_out_together(
    app: Celery, redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    """Store = broker: one script takes the lock and pushes the message, so the lock needs no
    confirmation; if the push fails, no lock is left behind."""

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    integ = install(app)
    assert integ.fused_publish
    store = integ.dedup.store
    key = scheduled_key(app, notify, 1)
    queue_key = f"{key_prefix}:kombu:{key_prefix}-q"
    redis_client.set(queue_key, "not a list")  # the push inside the script fails...
    step = integ.dedup.plan_enqueue(task_policy(notify, integ.settings), (1,))
    with pytest.raises(CorruptRecord, match=f"WRONGTYPE.*{queue_key}"):
        store.acquire_and_push(step.op, queue_key, "{}")  # type: ignore[union-attr]
    assert store.run(Inspect(key)) is None  # ...and leaves no lock behind
    redis_client.delete(queue_key)
    first = notify.delay(1)
    assert not first.deduplicated
    info = integ.dedup.store.run(Inspect(key))
    assert info is not None and info.job_id == first.id and info.confirmed  # no grace needed
    assert redis_client.llen(queue_key) == 1
    assert notify.delay(1).id == first.id and redis_client.llen(queue_key) == 1


def test_store_outage_follows_on_store_error(redis_url: str, key_prefix: str) -> None:
    lenient = make_app(redis_url, key_prefix, taskdedup_url="redis://127.0.0.1:1/0")
    install(lenient)

    @deduplicate("until_executed")
    @lenient.task(shared=False)
    def job(x: int) -> None: ...

    assert not job.delay(1).deduplicated and not job.delay(1).deduplicated  # published, logged

    strict = make_app(
        redis_url,
        key_prefix + "b",
        taskdedup_url="redis://127.0.0.1:1/0",
        taskdedup_on_store_error="raise",
    )
    install(strict)

    @deduplicate("until_executed")
    @strict.task(shared=False)
    def job2(x: int) -> None: ...

    from taskdedup import StoreUnavailable

    with pytest.raises(StoreUnavailable):
        job2.delay(1)


def test_without_a_redis_broker_the_store_url_must_be_given(key_prefix: str) -> None:
    from taskdedup import ConfigError

    app = Celery("amqp-only", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    install(app)

    @deduplicate("until_executed")
    @app.task(shared=False)
    def job(x: int) -> None: ...

    with pytest.raises(ConfigError, match="taskdedup_url"):
        job.delay(1)


def test_canvas_members_pass_through_unless_their_task_has_a_policy(
    app: Celery, runs: list[Any]
) -> None:
    from celery import chain, group

    @app.task(shared=False)
    def plain(x: int) -> int:
        runs.append(("plain", x))
        return x

    @deduplicate("until_executed")
    @app.task(shared=False)
    def guarded(x: int) -> int:
        runs.append(("guarded", x))
        return x

    member = guarded.delay(3)
    assert guarded.delay(3).id == member.id
    with start_worker(app, pool="solo", perform_ping_check=False):
        group(plain.s(1), plain.s(1)).apply_async().get(timeout=20)
        chain(plain.s(2), plain.si(2)).apply_async().get(timeout=20)
        # a canvas waits for its members' own ids: they are published even when a job of the
        # same key is queued, so no group, chord or chain can hang on a dropped member
        in_group = group(guarded.s(3), guarded.s(4)).apply_async()
        assert in_group.get(timeout=20) == [3, 4]
        assert chain(guarded.s(3), plain.s()).apply_async().get(timeout=20) == 3
        member.get(timeout=20)
    assert sorted(runs) == sorted(
        [("plain", 1), ("plain", 1), ("plain", 2), ("plain", 2), ("plain", 3)]
        + [("guarded", 3)] * 3
        + [("guarded", 4)]
    )


def test_beat_entries_are_deduplicated(app: Celery) -> None:
    from celery.beat import ScheduleEntry, Scheduler

    @deduplicate("until_executed")
    @app.task(shared=False, name="reports.nightly")
    def nightly() -> None: ...

    scheduler = Scheduler(app, lazy=True)
    entry = ScheduleEntry(name="nightly", task="reports.nightly", schedule=60, app=app)
    first = scheduler.apply_async(entry)
    second = scheduler.apply_async(entry)
    assert second.deduplicated and second.id == first.id


def test_settings_come_from_app_conf_and_the_environment(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(redis_url, key_prefix, taskdedup_dry_run=True, taskdedup_default_ttl=42)
    monkeypatch.setenv("TASKDEDUP_DEFAULT_LEASE", "7")
    integ = install(app)
    assert integ.settings.dry_run and integ.settings.default_ttl == 42
    assert integ.settings.default_lease == 7

    @deduplicate("until_executed")
    @app.task(shared=False)
    def job(x: int) -> None: ...

    assert not job.delay(1).deduplicated and not job.delay(1).deduplicated  # dry run
    assert integ.dedup.stats["enqueue.would_deduplicate"] == 1


def test_a_job_longer_than_its_lease_keeps_its_lock_by_heartbeat(app: Celery) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed", lease=0.6)
    @app.task(shared=False)
    def crunch(n: int) -> int:
        started.set()
        assert release.wait(20)
        return n

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        job = crunch.delay(1)
        assert started.wait(20)
        until = time.monotonic() + 2.0  # more than three leases
        while time.monotonic() < until:
            assert crunch.delay(1).id == job.id, "the running job lost its lock"
            time.sleep(0.1)
        release.set()
        assert job.get(timeout=20) == 1


def test_until_expired_throttles_for_the_ttl(app: Celery, runs: list[Any]) -> None:
    @deduplicate("until_expired", ttl=1.5)
    @app.task(shared=False)
    def digest(team: str) -> None:
        runs.append(team)

    with start_worker(app, pool="solo", perform_ping_check=False):
        first = digest.delay("core")
        first.get(timeout=20)
        assert digest.delay("core").id == first.id  # finished, still throttled
        again = wait_for(
            lambda: (r := digest.delay("core")) and not r.deduplicated and r,
            timeout=10,
            what="the throttle to end",
        )
        again.get(timeout=20)
    assert runs == ["core", "core"]


def test_until_and_while_executing_accepts_a_new_job_but_runs_it_after(
    app: Celery, runs: list[Any]
) -> None:
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_and_while_executing", lease=5)
    @app.task(shared=False)
    def rebuild(index: str) -> None:
        runs.append(("start", index, time.monotonic()))
        if not started.is_set():
            started.set()
            assert release.wait(20)
        runs.append(("end", index, time.monotonic()))

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = rebuild.delay("products")
        assert started.wait(20)
        second = rebuild.delay("products")  # the enqueue lock was released at start
        assert not second.deduplicated
        assert rebuild.delay("products").id == second.id  # ...and taken by the second job
        time.sleep(0.5)
        release.set()
        first.get(timeout=20)
        second.get(timeout=30)
    kinds = [kind for kind, _, _ in sorted(runs, key=lambda r: r[2])]
    assert kinds == ["start", "end", "start", "end"]


def test_a_deferred_job_keeps_its_callbacks(app: Celery, runs: list[Any]) -> None:
    @app.task(shared=False)
    def after(value: str) -> None:
        runs.append(("after", value))

    @deduplicate("while_executing", lease=5)
    @app.task(shared=False)
    def step(name: str) -> str:
        time.sleep(0.3)
        return name

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = step.apply_async(("a",), link=after.s())
        second = step.apply_async(("a",), link=after.s())  # busy when it starts: deferred
        first.get(timeout=20)
        second.get(timeout=30)
        wait_for(lambda: len(runs) == 2, what="both callbacks")
    assert runs == [("after", "a"), ("after", "a")]


def test_a_key_held_by_another_process_is_found_in_the_push(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    """This process never saw the key held, so it builds the message and the fused script
    finds the holder: nothing is pushed, after_task_publish does not fire, and the caller gets
    the holder's handle (or DuplicateJob)."""
    from celery.signals import after_task_publish

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    @deduplicate("until_executed", on_conflict="raise")
    @app.task(shared=False)
    def strict(user: int) -> None: ...

    integ = install(app)
    other = integ.dedup  # the same store, as another producer process would use it
    for task, job in ((notify, "held-elsewhere"), (strict, "strict-elsewhere")):
        other.published(other.enqueue(task_policy(task, integ.settings), (1,), job_id=job))
    published: list[str] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append(headers["id"])

    after_task_publish.connect(record, weak=False)
    try:
        result = notify.delay(1)
        assert result.deduplicated and result.id == "held-elsewhere"
        with pytest.raises(DuplicateJob) as raised:
            strict.delay(1)
        assert raised.value.job_id == "strict-elsewhere"
        assert not notify.delay(2).deduplicated
    finally:
        after_task_publish.disconnect(record)
    assert queue_length(app, redis_url, key_prefix) == 1 and len(published) == 1


def test_a_duplicate_found_in_the_push_keeps_the_broker_connection(
    app: Celery, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate the fused script finds (another process holds the key) gives the producer
    back to the app's pool whole: kombu treated the exception through Celery's own acquire as
    a broken connection and replaced it, so every such duplicate reconnected, opened a channel
    and declared the queue again (5-15 ms each)."""
    from kombu.transport import redis as kombu_redis

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    integ = install(app)
    assert integ.fused_publish
    policy = task_policy(notify, integ.settings)
    for user in range(6):  # held by another producer
        integ.dedup.published(integ.dedup.enqueue(policy, (user,), job_id=f"elsewhere-{user}"))
    assert notify.delay(0).id == "elsewhere-0"  # (the pool's connection and channel made)
    channels: list[Any] = []
    made = kombu_redis.Channel.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        channels.append(self)
        made(self, *args, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "__init__", counted)
    for user in range(1, 6):
        result = notify.delay(user)
        assert result.deduplicated and result.id == f"elsewhere-{user}"
    assert channels == []  # no new connection, no new channel
    assert not notify.delay(99).deduplicated  # and the producer still publishes


def test_a_key_freed_after_it_was_seen_held_is_published_once(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    """A key this process saw held is asked about before Celery builds a message; when it has
    been freed meanwhile, that answer's lock is the one the publish uses."""

    @deduplicate("until_executing")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    integ = install(app)
    first = notify.delay(1)
    key = scheduled_key(app, notify, 1)
    assert integ.dedup.release(key, first.id)  # as a worker does when the job starts
    second = notify.delay(1)
    assert not second.deduplicated and second.id != first.id
    info = integ.dedup.store.run(Inspect(key))
    assert info is not None and info.job_id == second.id
    third = notify.delay(1)
    assert third.deduplicated and third.id == second.id
    assert queue_length(app, redis_url, key_prefix) == 2


def test_a_fresh_key_costs_no_round_trip_beyond_the_publish(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the broker's Redis the lock rides in the publish: a deduplicated task's fresh call
    sends as many commands to Redis as a plain task's call."""
    from kombu.transport import redis as kombu_redis

    from taskdedup import RedisStore
    from test_guarantees import CountingConnection

    monkeypatch.setattr(kombu_redis.Channel, "connection_class", CountingConnection)
    app = make_app(redis_url, key_prefix)
    store = RedisStore.from_url(
        redis_url, key_prefix=key_prefix, connection_class=CountingConnection
    )
    assert install(app, store=store).fused_publish

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    @app.task(shared=False)
    def plain(user: int) -> None: ...

    def sends(call: Any) -> int:
        before = CountingConnection.sends
        call()
        return CountingConnection.sends - before

    notify.delay(0), plain.delay(0)  # warm up: scripts loaded, queue declared
    assert sends(lambda: notify.delay(1)) == sends(lambda: plain.delay(1))
    assert sends(lambda: notify.delay(2)) == sends(lambda: plain.delay(2))
    assert queue_length(app, redis_url, key_prefix) == 6


def test_a_handed_off_lock_published_through_the_push_is_confirmed(
    app: Celery, key_prefix: str, redis_client: redis.Redis
) -> None:
    """A hand-off leaves the lock to the new job id unconfirmed (grace); its publish through
    the fused push confirms it, as a background confirmation would."""
    from taskdedup.stores.base import Acquire

    store = install(app).dedup.store
    handed = Acquire("handoff-" + key_prefix, "next-job", ttl_ms=3_600_000, grace_ms=60_000)
    store.run(handed)  # the lock as a hand-off leaves it: held by next-job, not confirmed
    before = store.run(Inspect(handed.key))
    assert before is not None and not before.confirmed
    queue_key = f"{key_prefix}:kombu:{key_prefix}-q"
    assert store.acquire_and_push(handed, queue_key, "{}").acquired  # type: ignore[attr-defined]
    after = store.run(Inspect(handed.key))
    assert after is not None and after.confirmed and after.ttl_ms > 60_000
    assert redis_client.llen(queue_key) == 1


def test_a_lock_asked_for_first_is_given_back_when_celery_fails_before_publishing(
    app: Celery,
) -> None:
    @deduplicate("until_executed", key="nightly-report")
    @app.task(shared=False)
    def report(day: str) -> None: ...

    integ = install(app)
    first = report.delay("mon")  # the key is now seen held in this process
    key = scheduled_key(app, report, "mon")
    assert integ.dedup.release(key, first.id)  # as a worker does when the job ends
    with pytest.raises(TypeError):
        report.delay()  # asks first (takes the lock), then Celery's argument check fails
    assert integ.dedup.store.run(Inspect(key)) is None
    assert not report.delay("tue").deduplicated


def test_a_lock_taken_in_a_discarded_publish_batch_keeps_only_its_grace(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    integ = install(app)
    key = scheduled_key(app, notify, 1)
    with pytest.raises(RuntimeError), app.producer_or_acquire() as producer, producer.batch():
        notify.apply_async((1,), producer=producer)
        raise RuntimeError("the batch is discarded")
    integ.dedup.confirmer.flush()
    info = integ.dedup.store.run(Inspect(key))
    assert info is not None and not info.confirmed and info.ttl_ms <= 60_000
    assert queue_length(app, redis_url, key_prefix) == 0


def test_the_fused_push_is_not_repeated_by_a_retried_publish(
    app: Celery, key_prefix: str, redis_client: redis.Redis
) -> None:
    """kombu retries a publish whose reply was lost: the same message is not pushed twice."""

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    integ = install(app)
    step = integ.dedup.plan_enqueue(task_policy(notify, integ.settings), (1,))
    queue_key = f"{key_prefix}:kombu:{key_prefix}-q"
    store = integ.dedup.store
    assert store.acquire_and_push(step.op, queue_key, "{}").acquired  # type: ignore[union-attr]
    assert store.acquire_and_push(step.op, queue_key, "{}").acquired  # type: ignore[union-attr]
    assert redis_client.llen(queue_key) == 1


@pytest.mark.parametrize("mode", ["raise", "enqueue"])
def test_a_store_error_in_the_fused_push_follows_on_store_error(
    redis_url: str, key_prefix: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from taskdedup import RedisStore, StoreUnavailable

    app = make_app(redis_url, key_prefix, taskdedup_on_store_error=mode)
    assert install(app).fused_publish

    @deduplicate("until_executed")
    @app.task(shared=False)
    def notify(user: int) -> None: ...

    def down(*_: Any) -> None:
        raise StoreUnavailable("Redis did not answer: injected")

    monkeypatch.setattr(RedisStore, "acquire_and_push", down)
    if mode == "raise":
        with pytest.raises(StoreUnavailable, match="injected"):
            notify.delay(1)
        assert queue_length(app, redis_url, key_prefix) == 0
    else:
        assert not notify.delay(1).deduplicated
        assert queue_length(app, redis_url, key_prefix) == 1


FUSED_OFF = """
import sys
from celery import Celery
from kombu.transport import redis as kombu_redis
from taskdedup.celery import deduplicate, install

url, prefix, fused = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
app = Celery(prefix, broker=url, set_as_current=False)
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
    task_default_queue=f"{prefix}-q",
    taskdedup_key_prefix=prefix,
    taskdedup_fused_publish=fused,
)
integ = install(app)

@deduplicate("until_executed")
@app.task(shared=False)
def notify(user: int) -> None: ...

first, again = notify.delay(1), notify.delay(1)
assert again.deduplicated and again.id == first.id, (first.id, again.id)
assert integ.fused_publish is fused
print(getattr(kombu_redis.Channel, "_taskdedup_hooked", False))
"""


@pytest.mark.parametrize("fused", ["on", "off"])
def test_fused_publish_off_leaves_kombu_alone_and_still_deduplicates(
    redis_url: str, key_prefix: str, fused: str
) -> None:
    """``fused_publish=False``: the store shares the broker's Redis, yet kombu's private
    ``Channel._put`` is never hooked; the lock is taken, then the message published."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FUSED_OFF, redis_url, key_prefix, fused],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("True" if fused == "on" else "False")
