"""Celery: idempotency keys and the reservation guard, with real in-process workers on Redis."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import race, wait_for
from taskdedup import (
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    QuotaExceeded,
    ReservationGuard,
)
from taskdedup.celery import deduplicate, install, reserve
from test_celery import make_app, queue_length


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Celery:
    app = make_app(redis_url, key_prefix)
    install(app)
    return app


# ---------------------------------------------------------------- idempotency keys


def test_a_retried_submission_gets_the_original_job_back(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    @app.task(shared=False)
    def build(sha: str, target: str = "all") -> str:
        return f"{sha}:{target}"

    first = build.apply_async(("4f2a9c1",), idempotency_key="gh-org/repo-4f2a9c1")
    assert first.idempotent_hit is False
    again = build.apply_async((), {"sha": "4f2a9c1"}, idempotency_key="gh-org/repo-4f2a9c1")
    assert again.idempotent_hit is True and again.id == first.id
    assert queue_length(app, redis_url, key_prefix) == 1
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert again.get(timeout=20) == "4f2a9c1:all"


def test_the_same_key_with_other_arguments_is_a_mismatch(app: Celery) -> None:
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    @app.task(shared=False)
    def deploy(sha: str) -> None: ...

    first = build.apply_async(("abc",), idempotency_key="build-17")
    with pytest.raises(IdempotencyKeyMismatch) as raised:
        build.apply_async(("def",), idempotency_key="build-17")
    assert raised.value.key == "build-17" and raised.value.job_id == first.id
    assert first.id in str(raised.value) and "build-17" in str(raised.value)
    with pytest.raises(IdempotencyKeyMismatch):
        deploy.apply_async(("abc",), idempotency_key="build-17")  # another task


def test_on_mismatch_return_hands_back_the_original(redis_url: str, key_prefix: str) -> None:
    app = make_app(redis_url, key_prefix, taskdedup_idempotency_on_mismatch="return")
    install(app)

    @app.task(shared=False)
    def build(sha: str) -> None: ...

    first = build.apply_async(("abc",), idempotency_key="build-18")
    other = build.apply_async(("def",), idempotency_key="build-18")
    assert other.id == first.id and other.idempotent_hit is True


def test_after_its_ttl_the_same_key_makes_a_new_job(app: Celery) -> None:
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    first = build.apply_async(("abc",), idempotency_key="nightly-1", idempotency_ttl=1)
    assert build.apply_async(("abc",), idempotency_key="nightly-1").id == first.id

    def new_job() -> Any:
        result = build.apply_async(("abc",), idempotency_key="nightly-1", idempotency_ttl=1)
        return None if result.idempotent_hit else result

    assert wait_for(new_job, 5, "the key to expire").id != first.id


def test_32_threads_submitting_one_key_make_one_job(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    results = race(32, lambda _: build.apply_async(("abc",), idempotency_key="pipeline-9"))
    assert len({r.id for r in results}) == 1
    assert sum(r.idempotent_hit for r in results) == 31
    assert queue_length(app, redis_url, key_prefix) == 1


@pytest.mark.parametrize(
    "bad", ["", "has space", "x" * 257, "naïve", "tab\tkey", 42, None.__class__]
)
def test_a_bad_key_is_a_clear_value_error_and_nothing_is_written(
    app: Celery, redis_url: str, key_prefix: str, bad: Any
) -> None:
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    with pytest.raises(InvalidIdempotencyKey, match="printable ASCII") as raised:
        build.apply_async(("abc",), idempotency_key=bad)
    assert isinstance(raised.value, ValueError)
    assert queue_length(app, redis_url, key_prefix) == 0
    client = redis.Redis.from_url(redis_url)
    try:
        assert not list(client.scan_iter(match=f"{key_prefix}:{{idem:*"))
    finally:
        client.close()


def test_the_key_is_checked_before_the_dedup_policy(app: Celery) -> None:
    @deduplicate("until_executed", keys=["repo"])
    @app.task(shared=False)
    def ci(repo: str, sha: str) -> None: ...

    first = ci.apply_async(("org/repo", "aaa"), idempotency_key="ci-aaa")
    # another commit of the same repo: a dedup duplicate; its key now answers the holder
    dup = ci.apply_async(("org/repo", "bbb"), idempotency_key="ci-bbb")
    assert dup.deduplicated and dup.id == first.id and dup.idempotent_hit is False
    again = ci.apply_async(("org/repo", "bbb"), idempotency_key="ci-bbb")
    assert again.idempotent_hit and again.id == first.id
    hit = ci.apply_async(("org/repo", "aaa"), idempotency_key="ci-aaa")
    assert hit.idempotent_hit and not hit.deduplicated and hit.id == first.id


def test_a_failed_publish_frees_the_key(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu import Producer
    from kombu.exceptions import OperationalError

    @app.task(shared=False)
    def build(sha: str) -> None: ...

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker went away")

    monkeypatch.setattr(Producer, "publish", broken)
    with pytest.raises(OperationalError):
        build.apply_async(("abc",), idempotency_key="ci-retry-1")
    monkeypatch.undo()
    assert build.apply_async(("abc",), idempotency_key="ci-retry-1").idempotent_hit is False


def _count_recalls(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every idempotency lookup the store answers from now on."""
    from taskdedup.stores.base import Remember

    asked: list[object] = []
    run = store.run

    def counting(op: Any) -> Any:
        if isinstance(op, Remember):
            asked.append(op)
        return run(op)

    monkeypatch.setattr(store, "run", counting)
    return asked


def _slow_publish(monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> tuple[Any, Any]:
    """Make the next publish wait until released, then fail or go on; returns (entered,
    release) events, so a test can act while a submission is being published."""
    from kombu import Producer
    from kombu.exceptions import OperationalError

    entered, release = threading.Event(), threading.Event()
    original = Producer.publish
    first = [True]

    def publish(self: Any, *args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            entered.set()
            assert release.wait(20)
            if fail:
                raise OperationalError("broker went away")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", publish)
    return entered, release


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_retry_during_the_first_publish_waits_for_its_outcome(
    app: Celery, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch, first_fails: bool
) -> None:
    """A client that times out and resubmits while its first submission is still being
    published: if that publish fails, the retry makes the job (it is not told about a job that
    never existed); if it succeeds, the retry gets it back."""
    from kombu.exceptions import OperationalError

    @app.task(shared=False)
    def build(sha: str) -> None: ...

    entered, release = _slow_publish(monkeypatch, fail=first_fails)
    asked = _count_recalls(install(app).dedup.store, monkeypatch)
    outcome: dict[str, Any] = {}

    def first_submission() -> None:
        try:
            outcome["first"] = build.apply_async(("abc",), idempotency_key="ci-retry-2")
        except OperationalError as exc:
            outcome["first"] = exc

    first = threading.Thread(target=first_submission)
    first.start()
    assert entered.wait(20)
    retry = threading.Thread(
        target=lambda: outcome.update(
            retry=build.apply_async(("abc",), idempotency_key="ci-retry-2")
        )
    )
    retry.start()
    wait_for(lambda: len(asked) >= 3, 10, "the retry to ask about the key again")
    assert "retry" not in outcome  # it waits for the first publish, unanswered
    release.set()
    first.join(20)
    retry.join(20)
    if first_fails:
        assert isinstance(outcome["first"], OperationalError)
        assert outcome["retry"].idempotent_hit is False
    else:
        assert outcome["retry"].idempotent_hit is True
        assert outcome["retry"].id == outcome["first"].id
    assert queue_length(app, redis_url, key_prefix) == 1


def test_a_retry_gives_up_on_a_first_publish_that_never_ends(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from taskdedup import IdempotencyKeyInProgress

    app = make_app(redis_url, key_prefix)
    app.conf.taskdedup_idempotency_wait = 0.5
    install(app)

    @app.task(shared=False)
    def build(sha: str) -> None: ...

    from kombu.exceptions import OperationalError

    entered, release = _slow_publish(monkeypatch, fail=True)

    def first_submission() -> None:
        with pytest.raises(OperationalError):
            build.apply_async(("abc",), idempotency_key="k-3")

    first = threading.Thread(target=first_submission)
    first.start()
    try:
        assert entered.wait(20)
        with pytest.raises(IdempotencyKeyInProgress, match="still being published") as raised:
            build.apply_async(("abc",), idempotency_key="k-3")
        assert raised.value.key == "k-3"
    finally:
        release.set()
        first.join(20)
    assert queue_length(app, redis_url, key_prefix) == 0


# ---------------------------------------------------------------- reservations


def test_fifty_submitters_on_one_scope_publish_exactly_the_cap(
    app: Celery, redis_url: str, key_prefix: str
) -> None:
    release = threading.Event()
    started: list[int] = []  # user 42's jobs that started

    @reserve(max_concurrent=5, scope="user_id", ttl=60)
    @app.task(shared=False)
    def export(user_id: int, n: int) -> int:
        if user_id == 42:
            started.append(n)
        release.wait(30)
        return n

    def submit(i: int) -> Any:
        try:
            return export.delay(42, i)
        except QuotaExceeded as exc:
            return exc

    outcomes = race(50, submit)
    published = [o for o in outcomes if not isinstance(o, QuotaExceeded)]
    refused = [o for o in outcomes if isinstance(o, QuotaExceeded)]
    assert len(published) == 5 and len(refused) == 45
    assert str(refused[0]) == "Quota exceeded: maximum 5 concurrent jobs for scope user_id=42"
    assert queue_length(app, redis_url, key_prefix) == 5
    guard = ReservationGuard(install(app).dedup.store)
    with start_worker(app, pool="threads", concurrency=5, perform_ping_check=False):
        wait_for(lambda: len(started) == 5, 20, "the five jobs to start")
        with pytest.raises(QuotaExceeded):
            export.delay(42, 99)  # running jobs hold their slots
        assert export.delay(7, 1) is not None  # another scope is not affected
        release.set()
        assert sorted(r.get(timeout=20) for r in published) == sorted(started)
        wait_for(lambda: not guard.active("user_id=42"), 10, "the slots to be freed")
    after = race(6, submit)
    assert sum(isinstance(o, QuotaExceeded) for o in after) == 1  # 5 more, not 6


def test_a_duplicate_or_a_hit_takes_no_slot(app: Celery) -> None:
    @deduplicate("until_executed")
    @reserve(max_concurrent=2, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str, part: int) -> None: ...

    first = sync.delay("acme", 1)
    assert sync.delay("acme", 1).deduplicated  # no slot for a duplicate
    sync.apply_async(("acme", 2), idempotency_key="sync-acme-2")
    assert sync.apply_async(("acme", 2), idempotency_key="sync-acme-2").idempotent_hit
    guard = ReservationGuard(install(app).dedup.store)
    assert {s.member for s in guard.active("tenant=acme")} >= {first.id}
    assert len(guard.active("tenant=acme")) == 2
    with pytest.raises(QuotaExceeded):
        sync.delay("acme", 3)


def test_a_refused_call_gives_back_its_lock_and_key(app: Celery) -> None:
    @deduplicate("until_executed")
    @reserve(max_concurrent=1, scope=lambda tenant, **_: f"tenant-{tenant}")
    @app.task(shared=False)
    def sync(tenant: str, part: int) -> None: ...

    sync.delay("acme", 1)
    with pytest.raises(QuotaExceeded, match="scope tenant-acme"):
        sync.apply_async(("acme", 2), idempotency_key="sync-2")
    guard = ReservationGuard(install(app).dedup.store)
    guard.release("tenant-acme", guard.active("tenant-acme")[0].member)
    fresh = sync.apply_async(("acme", 2), idempotency_key="sync-2")
    assert not fresh.deduplicated and fresh.idempotent_hit is False


def test_a_bad_scope_argument_fails_when_the_task_is_defined(app: Celery) -> None:
    from taskdedup import ConfigError

    with pytest.raises(ConfigError, match="user"):

        @reserve(max_concurrent=2, scope="user")
        @app.task(shared=False)
        def export(user_id: int) -> None: ...


def test_a_failed_job_and_a_revoked_job_free_their_slots(app: Celery) -> None:
    @reserve(max_concurrent=1, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str) -> None:
        raise RuntimeError("boom")

    guard = ReservationGuard(install(app).dedup.store)
    failing = sync.delay("acme")
    with start_worker(app, pool="solo", perform_ping_check=False):
        with pytest.raises(RuntimeError):
            failing.get(timeout=20)
        wait_for(lambda: not guard.active("tenant=acme"), 10, "the failed job's slot")
    from test_celery_revoke import consume_tasks, revoke, running_worker

    with running_worker(app, consuming=False) as hostname:  # it learns of the revoke
        queued = sync.delay("acme")
        assert [s.member for s in guard.active("tenant=acme")] == [queued.id]
        revoke(app, queued.id, hostname)
        consume_tasks(app, hostname)  # the worker discards it
        wait_for(lambda: not guard.active("tenant=acme"), 10, "the revoked job's slot")
    assert queued.state == "REVOKED"


def test_a_call_refused_by_its_dedup_policy_frees_its_idempotency_key(app: Celery) -> None:
    from taskdedup import DuplicateJob

    @deduplicate("until_executed", keys=["repo"], on_conflict="raise")
    @app.task(shared=False)
    def ci(repo: str, sha: str) -> None: ...

    first = ci.apply_async(("org/repo", "aaa"), idempotency_key="ci-aaa")
    with pytest.raises(DuplicateJob):
        ci.apply_async(("org/repo", "bbb"), idempotency_key="ci-bbb")
    install(app).dedup.release(_key(app, ci), first.id)
    assert ci.apply_async(("org/repo", "bbb"), idempotency_key="ci-bbb").idempotent_hit is False


def _key(app: Celery, task: Any) -> str:
    from taskdedup.celery.tasks import task_policy

    policy = task_policy(task, install(app).settings)
    assert policy is not None
    return policy.key_for(("org/repo", "x"), {})


def test_a_duplicate_with_a_short_idempotency_ttl_keeps_that_ttl(
    app: Celery, redis_client: redis.Redis, key_prefix: str
) -> None:
    from taskdedup.idempotency import record_key

    @deduplicate("until_executed")
    @app.task(shared=False)
    def sync(tenant: str) -> None: ...

    sync.delay("acme")
    dup = sync.apply_async(("acme",), idempotency_key="sync-1", idempotency_ttl=60)
    assert dup.deduplicated
    ttl = redis_client.pttl(f"{key_prefix}:{{{record_key('sync-1')}}}:lock")
    assert 0 < ttl <= 60_000


def test_a_bad_idempotency_ttl_is_a_config_error(app: Celery) -> None:
    from taskdedup import ConfigError

    @app.task(shared=False)
    def build(sha: str) -> None: ...

    with pytest.raises(ConfigError, match="idempotency_ttl"):
        build.apply_async(("a",), idempotency_key="k-1", idempotency_ttl=0)


def test_a_failed_publish_gives_back_the_slot(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu import Producer
    from kombu.exceptions import OperationalError

    @reserve(max_concurrent=1, scope="tenant")
    @app.task(shared=False)
    def sync(tenant: str) -> None: ...

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker went away")

    guard = ReservationGuard(install(app).dedup.store)
    monkeypatch.setattr(Producer, "publish", broken)
    with pytest.raises(OperationalError):
        sync.delay("acme")
    assert guard.active("tenant=acme") == []
    monkeypatch.undo()
    assert sync.delay("acme") is not None  # the one slot is free


@pytest.mark.parametrize("strategy", ["until_executing", "until_executed"])
def test_a_rescheduled_run_under_a_full_cap_is_sent_and_runs(
    app: Celery, strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """reschedule_once owes one more run. Its publish is never refused by the scope's cap
    (that would fail the job in hand and lose the owed run): it takes a slot if one is free
    (until_executed: the job in hand has just freed its own), else it is sent without one and
    waits for one when it starts (until_executing: it is sent as the first starts), so the
    two never run at once under max_concurrent=1."""
    caplog.set_level(logging.INFO, logger="taskdedup")
    started, release = threading.Event(), threading.Event()
    runs: list[tuple[str, list[str]]] = []
    guard = ReservationGuard(install(app).dedup.store)

    @reserve(max_concurrent=1, scope="user_id")
    @deduplicate(strategy, keys=["user_id"], on_conflict="reschedule_once")
    @app.task(shared=False)
    def sync_user(user_id: int, note: str) -> str:
        runs.append((note, [slot.member for slot in guard.active(f"user_id={user_id}")]))
        if note == "first":
            started.set()
            assert release.wait(20)
        return note

    first = sync_user.delay(1, "first")
    if strategy == "until_executing":  # a duplicate while the first is queued: owed at its start
        assert sync_user.delay(1, "second").id == first.id
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert started.wait(20)
        if strategy == "until_executed":  # a duplicate while the first runs: owed at its end
            assert sync_user.delay(1, "second").id == first.id
        else:  # the owed run was sent as the first started, and waits for the slot
            wait_for(lambda: "scope user_id=1 is full" in caplog.text, 20, "the run to wait")
        release.set()
        assert first.get(timeout=20) == "first"  # the job in hand is not failed by the cap
        wait_for(lambda: len(runs) == 2, 20, "the rescheduled run")
        wait_for(lambda: not guard.active("user_id=1"), 10, "the slots to be freed")
    (_, during_first), (note, during_second) = runs
    assert note == "second" and during_first == [first.id]
    assert len(during_second) == 1 and during_second != during_first  # its own slot, alone


def test_a_job_whose_reservation_lapsed_waits_for_a_slot_when_the_scope_is_full(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Queued longer than its reservation's ttl, a job starts without a slot: it takes one
    if the scope has room, else it is sent again later instead of running over the cap."""
    caplog.set_level(logging.INFO, logger="taskdedup")
    guard = ReservationGuard(install(app).dedup.store)
    runs: list[list[str]] = []

    @reserve(max_concurrent=1, scope="tenant", ttl=0.3)
    @app.task(shared=False)
    def sync(tenant: str) -> None:
        runs.append([slot.member for slot in guard.active(f"tenant={tenant}")])

    job = sync.delay("acme")
    wait_for(lambda: not guard.active("tenant=acme"), 10, "the reservation to lapse")
    outsider = guard.reserve("tenant=acme", 1, ttl=60)  # the scope is full again
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        wait_for(lambda: "scope tenant=acme is full" in caplog.text, 20, "the job to wait")
        assert runs == []
        outsider.release()
        job.get(timeout=20)
    assert runs == [[job.id]]  # it ran holding the scope's only slot


def test_a_job_that_cannot_be_sent_again_for_a_full_scope_frees_its_lock(
    app: Celery, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker refuses the worker's re-send of a job waiting for its scope: the job fails
    (visibly), and its dedup key is free again rather than held for the ttl (G5)."""
    from kombu.exceptions import OperationalError

    import taskdedup.celery.worker as worker_module

    guard = ReservationGuard(install(app).dedup.store)

    @deduplicate("until_executed")
    @reserve(max_concurrent=1, scope="tenant", ttl=0.3)
    @app.task(shared=False)
    def sync(tenant: str) -> None: ...

    def refused(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker went away")

    job = sync.delay("acme")
    wait_for(lambda: not guard.active("tenant=acme"), 10, "the reservation to lapse")
    outsider = guard.reserve("tenant=acme", 1, ttl=60)
    monkeypatch.setattr(worker_module, "resend", refused)
    with (
        start_worker(app, pool="solo", perform_ping_check=False),
        pytest.raises(OperationalError),
    ):
        job.get(timeout=20)
    outsider.release()
    again = sync.delay("acme")
    assert not again.deduplicated and again.id != job.id
