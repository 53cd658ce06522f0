"""A rolling deploy from celery-once / celery-singleton to taskdedup's drop-ins.

Old producers (the original packages, installed here) and new ones (``taskdedup.compat``)
share the peer's key in Redis, so they deduplicate against each other in both directions,
and a job sent by either side and run by a worker of either side frees the key. (A worker
killed with kill -9: tests/test_compat_kill.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import wait_for

celery_once = pytest.importorskip("celery_once")
celery_singleton = pytest.importorskip("celery_singleton")

from taskdedup.compat import celery_once as compat_once  # noqa: E402
from taskdedup.compat import celery_singleton as compat_singleton  # noqa: E402


def make_app(name: str, redis_url: str, key_prefix: str) -> Celery:
    app = Celery(name, broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:result:"},
        task_default_queue=f"{key_prefix}-q",
        taskdedup_key_prefix=key_prefix,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_url, "default_timeout": 60},
        },
        singleton_key_prefix=f"{key_prefix}:SINGLETONLOCK_",
        singleton_backend_url=redis_url,
        worker_hijack_root_logger=False,
    )
    return app


@pytest.fixture
def once_keys(redis_client: redis.Redis, key_prefix: str) -> Iterator[Callable[[], list[bytes]]]:
    """celery-once's keys of this test (``qo_<task name>...``), deleted afterwards."""

    def keys() -> list[bytes]:
        return sorted(redis_client.scan_iter(match=f"qo_{key_prefix}*"))

    yield keys
    for key in keys():
        redis_client.delete(key)


@pytest.fixture(autouse=True)
def _singleton_backend_per_test() -> Iterator[None]:
    """celery-singleton keeps one backend per process, made from the first app's settings."""
    from celery_singleton import backends

    backends._backend = None
    yield
    backends._backend = None


class Deploy:
    """An old app (the original package) and a new one (the drop-in), with one task each of
    the same name, on one broker queue and one Redis."""

    def __init__(self, peer: str, redis_url: str, key_prefix: str, *, restricted: bool = True):
        """``restricted``: the key is made of ``item`` alone; else of every argument (the
        peers' default)."""
        self.peer = peer
        self.old = make_app("old", redis_url, key_prefix)
        self.new = make_app("new", redis_url, key_prefix)
        name = f"{key_prefix}.{peer}_job"
        self.runs: list[tuple[str, str]] = []
        self.started = threading.Event()
        self.go = threading.Event()
        self.go.set()
        if peer == "once":
            options: dict[str, Any] = {"once": {"keys": ["item"]}} if restricted else {}
            old_base, new_base = celery_once.QueueOnce, compat_once.QueueOnce
            self.duplicate_errors: tuple[type, ...] = (
                celery_once.AlreadyQueued,
                compat_once.AlreadyQueued,
            )
        else:
            options = {"unique_on": ["item"]} if restricted else {}
            old_base, new_base = celery_singleton.Singleton, compat_singleton.Singleton
            self.duplicate_errors = ()

        def body(side: str) -> Callable[..., str]:
            def job(item: str, note: Any = "") -> str:
                self.runs.append((side, item))
                self.started.set()
                assert self.go.wait(30)
                return item

            return job

        self.old_task = self.old.task(name=name, base=old_base, shared=False, **options)(
            body("old")
        )
        self.new_task = self.new.task(name=name, base=new_base, shared=False, **options)(
            body("new")
        )

    def submit(self, side: str, item: str, note: Any = "") -> str | None:
        """The job id the call got: its own (accepted) or the holder's; None when the peer
        answers a duplicate with an exception (celery-once's AlreadyQueued)."""
        task = self.old_task if side == "old" else self.new_task
        try:
            return str(task.delay(item, note=note).id)
        except self.duplicate_errors:
            return None


@pytest.fixture(params=["once", "singleton"])
def deploy(
    request: pytest.FixtureRequest, redis_url: str, key_prefix: str, once_keys: Any
) -> Deploy:
    return Deploy(request.param, redis_url, key_prefix)


@pytest.mark.parametrize("first", ["old", "new"])
def test_old_and_new_producers_deduplicate_against_each_other(
    deploy: Deploy, first: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    second = "new" if first == "old" else "old"
    held = deploy.submit(first, "a")
    assert held is not None
    answer = deploy.submit(second, "a", note="other")  # same key: item only
    if deploy.peer == "once":
        assert answer is None  # AlreadyQueued, from either side
    else:
        assert answer == held  # the holder's AsyncResult, from either side
    other = deploy.submit(second, "b")  # another key is accepted
    assert other is not None and other != held
    if deploy.peer == "singleton":  # the key holds the holder's id, whoever wrote it
        values = {redis_client.get(k) for k in redis_client.scan_iter(f"{key_prefix}:SINGLE*")}
        assert values == {held.encode(), other.encode()}


@pytest.mark.parametrize("peer", ["once", "singleton"])
@pytest.mark.parametrize("first", ["old", "new"])
def test_old_and_new_producers_share_keys_made_of_every_argument(
    peer: str, first: str, redis_url: str, key_prefix: str, once_keys: Any
) -> None:
    # the peers' default key: every argument, a dict's keys in any order included
    deploy = Deploy(peer, redis_url, key_prefix, restricted=False)
    second = "new" if first == "old" else "old"
    held = deploy.submit(first, "a", note={"b": 1, "a": [1, 2]})
    assert held is not None
    answer = deploy.submit(second, "a", note={"a": [1, 2], "b": 1})
    assert answer is None if peer == "once" else answer == held
    other = deploy.submit(second, "a", note={"b": 2})  # another argument: another key
    assert other is not None and other != held
    assert deploy.submit(first, "a", note={"b": 2}) in (None, other)


def test_producers_of_both_sides_at_once_accept_exactly_one(deploy: Deploy) -> None:
    barrier = threading.Barrier(8)
    answers: list[str | None] = []

    def submit(side: str) -> None:
        barrier.wait()
        answers.append(deploy.submit(side, "same"))

    threads = [threading.Thread(target=submit, args=(s,)) for s in ["old", "new"] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ids = [a for a in answers if a is not None]
    assert len(answers) == 8
    if deploy.peer == "once":
        assert len(ids) == 1  # the others raised AlreadyQueued
    else:
        assert len(set(ids)) == 1 and len(ids) == 8  # all got the one holder's handle


@pytest.mark.parametrize(("producer", "worker"), [("old", "new"), ("new", "old")])
def test_a_job_sent_by_one_side_and_run_by_the_other_frees_the_key(
    deploy: Deploy, producer: str, worker: str
) -> None:
    app = deploy.new if worker == "new" else deploy.old
    deploy.go.clear()
    job = deploy.submit(producer, "x")
    assert job is not None
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert deploy.started.wait(30), "the worker never started the job"
        for side in ("old", "new"):  # held while it runs, for both sides
            assert deploy.submit(side, "x") in (None, job)
        deploy.go.set()
        wait_for(lambda: len(deploy.runs) == 1 and _free(deploy), 20, "the key to be freed")
    assert deploy.runs == [(worker, "x")]
    again = deploy.submit(producer, "x")  # (no worker now: it stays queued)
    assert again is not None and again != job  # accepted: a new job
    assert deploy.submit(worker, "x") in (None, again)  # and held for the other side


def _free(deploy: Deploy) -> bool:
    """Whether both sides would accept the key now, asked without taking it (the peer's key
    is what both read)."""
    client = redis.Redis.from_url(deploy.new.conf.singleton_backend_url)
    try:
        prefix = deploy.new.conf.taskdedup_key_prefix
        patterns = (f"qo_{prefix}*", f"{prefix}:SINGLETONLOCK_*")
        return not any(True for p in patterns for _ in client.scan_iter(match=p))
    finally:
        client.close()
