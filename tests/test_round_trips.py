"""Store round trips per enqueue, per duplicate, per claim and per finish, counted (not timed).

Each write of a request to the store's socket is one round trip (a pipeline is one write). The
store's connections count their writes per thread, so the caller's round trips are told apart
from the background confirmer's batches and the heartbeat's renewals. README's Benchmarks
section states these numbers; this test keeps them true on each layout users deploy.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup import RedisStore
from taskdedup.celery import deduplicate, install
from taskdedup.stores.redis_calls import SHAS
from test_celery_amqp import AMQP_URL, amqp_answers

WRITES: Counter[int] = Counter()  # writes to the store's sockets, by thread
SCRIPTS: list[tuple[int, tuple[str, ...]]] = []  # (thread, scripts) of each write, in order
_NAMES = {sha.encode(): name for name, sha in SHAS.items()}


class CountingConnection(redis.Connection):
    """redis-py's connection, counting each request written (one round trip each) and
    noting which of the store's scripts it ran."""

    def on_connect_check_health(self, check_health: bool = True) -> None:
        self.connecting = True  # a new connection's handshake is not a request of ours
        try:
            super().on_connect_check_health(check_health)
        finally:
            self.connecting = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if getattr(self, "connecting", False):
            super().send_packed_command(command, check_health)
            return
        thread = threading.get_ident()
        WRITES[thread] += 1
        raw = command if isinstance(command, bytes) else b"".join(command)
        SCRIPTS.append((thread, tuple(name for sha, name in _NAMES.items() if sha in raw)))
        super().send_packed_command(command, check_health)


def _other_db(url: str) -> str:
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(db + 1) % 16}"))


@pytest.fixture(params=["rabbitmq", "redis-apart", "redis-fused"])
def layout(request: pytest.FixtureRequest, redis_url: str) -> str:
    if request.param == "rabbitmq" and not amqp_answers():
        pytest.skip(f"no RabbitMQ answers at {AMQP_URL}")
    return str(request.param)


@pytest.fixture
def app(layout: str, redis_url: str, key_prefix: str) -> Iterator[Celery]:
    broker = {"rabbitmq": AMQP_URL, "redis-apart": _other_db(redis_url)}.get(layout, redis_url)
    queue = f"{key_prefix}-q"
    app = Celery(key_prefix, broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_heartbeat=0,
        broker_transport_options={"global_keyprefix": f"{key_prefix}:"},
        taskdedup_key_prefix=key_prefix,
    )
    if layout == "redis-fused":  # the store made from the broker's URL, so fused
        app.conf.taskdedup_url = redis_url
        install(app)
        store = app_store(app)
        store.clients._client = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    else:
        store = RedisStore.from_url(
            redis_url, key_prefix=key_prefix, connection_class=CountingConnection
        )
        install(app, store=store)
    yield app
    app_dedup(app).close()  # its confirmer thread stops: a later test counts no write of it
    if layout == "rabbitmq":
        with app.connection() as conn:
            conn.default_channel.queue_delete(queue)
    else:
        client = redis.Redis.from_url(broker)
        for name in client.scan_iter(match=f"{key_prefix}:*"):
            client.unlink(name)


def app_dedup(app: Celery) -> Any:
    """The Deduplicator taskdedup installed on ``app``."""
    from taskdedup.celery import integration_for

    integ = integration_for(app)
    assert integ is not None
    return integ.dedup


def app_store(app: Celery) -> RedisStore:
    store = app_dedup(app).store
    assert isinstance(store, RedisStore)
    return store


def mine() -> int:
    return WRITES[threading.get_ident()]


def test_round_trips_per_enqueue_and_duplicate(app: Celery, layout: str) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    build.delay("warm-up")  # loads the scripts and opens the connections
    before = mine()
    build.delay(uuid.uuid4().hex)
    enqueue = mine() - before
    before = mine()
    first = build.delay("abc")
    duplicate = build.delay("abc")
    assert duplicate.deduplicated and duplicate.id == first.id
    duplicate_trips = mine() - before - enqueue

    assert enqueue == 1, f"{layout}: {enqueue} round trips to enqueue a new key"
    assert duplicate_trips == 1, f"{layout}: {duplicate_trips} round trips for a duplicate"


def test_confirmations_go_out_in_batches(app: Celery, layout: str) -> None:
    """G11's confirmation of a published lock is the confirmer's, in batches: far fewer round
    trips than enqueues (none where lock and message were written by one script)."""

    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> None: ...

    build.delay("warm-up")
    dedup = app_dedup(app)
    dedup.confirmer.flush()
    before = sum(WRITES.values())
    for _ in range(200):
        build.delay(uuid.uuid4().hex)
    dedup.confirmer.flush()  # (here or in the confirmer's thread: every write counts)
    batches = sum(WRITES.values()) - before - 200
    if layout == "redis-fused":
        assert batches == 0
    else:
        assert 1 <= batches <= 20, f"{layout}: {batches} confirmation round trips for 200"


def test_round_trips_per_claim_and_finish(app: Celery, layout: str) -> None:
    """Between one job's body and the next one's, the worker thread writes the first job's
    finish and the second one's claim: one round trip each, and nothing else."""
    seen: dict[str, tuple[int, int]] = {}

    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> None:
        seen[sha] = (threading.get_ident(), len(SCRIPTS))

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        for sha in ("warm-up", "first", "second"):
            build.delay(sha)
            wait_for(lambda sha=sha: seen.get(sha), what=f"job {sha!r} to run")
    worker, start = seen["first"]
    _, end = seen["second"]
    between = [scripts for thread, scripts in SCRIPTS[start:end] if thread == worker]
    assert between == [("finish",), ("claim",)], f"{layout}: {between}"


def test_a_jobs_end_does_not_wait_for_its_finish_reply(
    redis_url: str, private_redis_url: str, key_prefix: str
) -> None:
    """The finish is written when the job ends and its reply read when the next job starts
    (or by a thread soon after): the store applies it at once, so the key is freed all the
    same, but the worker does not wait a round trip for an answer that only feeds the notes.
    Shown with the store's writes paused: the worker goes on to its next job meanwhile."""
    admin = redis.Redis.from_url(private_redis_url)
    app = Celery(key_prefix, broker=redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{key_prefix}-q",
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_transport_options={"global_keyprefix": f"{key_prefix}:"},
    )
    store = RedisStore.from_url(private_redis_url, key_prefix=key_prefix)
    install(app, store=store)
    ran: list[str] = []
    pause = threading.Event()

    @deduplicate("until_executed")
    @app.task(shared=False)
    def build(sha: str) -> None:
        ran.append(sha)
        pause.wait(10)  # the test pauses the store's writes before this job ends

    @app.task(shared=False)
    def notify(what: str) -> None:  # not deduplicated: no store call of its own
        ran.append(what)

    dedup = app_dedup(app)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            first = build.delay("abc")
            wait_for(lambda: "abc" in ran, what="the job to run")
            notify.delay("next")
            admin.client_pause(4000, all=False)  # the finish waits in the store, unanswered
            try:
                pause.set()
                wait_for(lambda: "next" in ran, timeout=3, what="the next job, store paused")
                assert dedup.stats["finish.released"] == 0  # its reply is not read yet
            finally:
                admin.client_unpause()
            wait_for(lambda: dedup.stats["finish.released"] == 1, what="the finish's reply")
        again = build.delay("abc")
        assert not again.deduplicated and again.id != first.id  # the key was freed
    finally:
        store.close()
        admin.close()
        client = redis.Redis.from_url(redis_url)
        for name in client.scan_iter(match=f"{key_prefix}:*"):
            client.unlink(name)
