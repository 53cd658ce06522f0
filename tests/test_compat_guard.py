"""The peer's key taken inside taskdedup's acquire (a :class:`Guard`): a drop-in's publish of a
new key is one round trip to Redis, as the original's ``SET NX`` is, and a duplicate is one
(the originals make two: ``SET NX``, then ``PTTL`` or ``GET``).

First the store's primitive (what the acquire does with a guard in each state of the two
keys), then the drop-ins' publishes, counted on the wire.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from taskdedup import RedisStore
from taskdedup.compat.celery_once import AlreadyQueued, QueueOnce
from taskdedup.compat.celery_singleton import Singleton
from taskdedup.stores.base import Acquire, Guard, TakesGuards
from taskdedup.stores.memory import MemoryStore

# ------------------------------------------------------------------ the store's primitive


@pytest.fixture(params=[True, False], ids=["history", "quiet"])
def store(request: pytest.FixtureRequest, redis_url: str, key_prefix: str) -> Iterator[RedisStore]:
    store = RedisStore(
        redis.Redis.from_url(redis_url), key_prefix=key_prefix, history=request.param
    )
    yield store
    store.close()


def _acquire(store: RedisStore, key: str, job: str, guard: Guard | None) -> Any:
    return store.run(Acquire(key, job, 60_000, 60_000, True, None, "t", guard=guard))


def test_a_free_lock_takes_the_guard_with_it(
    store: RedisStore, redis_client: redis.Redis, key_prefix: str
) -> None:
    peer = f"{key_prefix}:peer"
    reply = _acquire(store, "k", "j1", Guard(peer, "j1", 30_000, "ttl"))
    assert reply.acquired and reply.guard == ""
    assert redis_client.get(peer) == b"j1"
    assert 29_000 < redis_client.pttl(peer) <= 30_000
    reply = _acquire(store, "k2", "j2", Guard(f"{peer}2", "j2", None, "value"))
    assert reply.acquired and redis_client.pttl(f"{peer}2") == -1  # no ttl: none, as the peer


@pytest.mark.parametrize("answer", ["ttl", "value"])
def test_a_held_guard_answers_and_nothing_is_written(
    answer: str, store: RedisStore, redis_client: redis.Redis, key_prefix: str
) -> None:
    peer = f"{key_prefix}:peer"
    redis_client.set(peer, "old-producer", px=20_000)  # an old producer's key; the lock free
    reply = _acquire(store, "k", "j1", Guard(peer, "j1", 30_000, answer))  # type: ignore[arg-type]
    assert (reply.acquired, reply.guard) == (False, "held")
    if answer == "ttl":
        assert 19_000 < int(reply.guard_answer) <= 20_000
    else:
        assert reply.guard_answer == "old-producer"
    assert store.run(Acquire("k", "j9", 60_000, 60_000)).acquired  # the lock was left free
    # the lock held too (a drop-in's job): the guard still answers, nothing is counted
    reply = _acquire(store, "k", "j2", Guard(peer, "j2", 30_000, answer))  # type: ignore[arg-type]
    assert reply.guard == "held"
    assert redis_client.hget(f"{key_prefix}:{{k}}:lock", "d") == b"0"
    assert redis_client.get(peer) == b"old-producer"


def test_a_free_guard_of_a_held_lock_is_left_free(
    store: RedisStore, redis_client: redis.Redis, key_prefix: str
) -> None:
    peer = f"{key_prefix}:peer"
    assert _acquire(store, "k", "j1", None).acquired
    reply = _acquire(store, "k", "j2", Guard(peer, "j2", 30_000, "value"))
    assert (reply.acquired, reply.guard, reply.holder) == (False, "free", "j1")
    assert redis_client.get(peer) is None
    assert redis_client.hget(f"{key_prefix}:{{k}}:lock", "d") == b"0"


def test_a_guard_goes_with_the_lock_and_the_message_pushed_together(
    store: RedisStore, redis_client: redis.Redis, key_prefix: str
) -> None:
    peer, queue = f"{key_prefix}:peer", f"{key_prefix}:queue"
    op = Acquire("k", "j1", 60_000, 60_000, guard=Guard(peer, "j1", 30_000, "ttl"))
    assert store.acquire_and_push(op, queue, "message-1").acquired
    assert (redis_client.get(peer), redis_client.lrange(queue, 0, -1)) == (b"j1", [b"message-1"])
    op = Acquire("k", "j2", 60_000, 60_000, guard=Guard(peer, "j2", 30_000, "ttl"))
    assert store.acquire_and_push(op, queue, "message-2").guard == "held"
    assert redis_client.llen(queue) == 1  # nothing pushed


def test_a_store_on_another_server_takes_no_guard(redis_url: str, key_prefix: str) -> None:
    store = RedisStore(redis.Redis.from_url(redis_url), key_prefix=key_prefix)
    ours = store.client.connection_pool.connection_kwargs
    assert isinstance(store, TakesGuards) and store.takes_guards_on(ours)
    assert not store.takes_guards_on({**ours, "db": int(ours.get("db") or 0) + 1})
    assert not isinstance(MemoryStore(), TakesGuards)
    with pytest.raises(TypeError, match="guard"):
        MemoryStore().run(Acquire("k", "j", 1000, 1000, guard=Guard("p", "j", None, "ttl")))
    store.close()


# ------------------------------------------------------------------ the drop-ins, on the wire


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], Any]], int]:
    """How many times this thread wrote to a Redis connection while ``call`` ran (a command,
    a script, a pipeline: one write each, one round trip each)."""
    counts: dict[int, int] = {}
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        if me in counts:
            counts[me] += 1
        return send(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)

    def trips(call: Callable[[], Any]) -> int:
        me = threading.get_ident()
        counts[me] = 0
        try:
            call()
        finally:
            made = counts.pop(me)
        return made

    return trips


@pytest.fixture(params=["store apart", "fused"])
def app(
    request: pytest.FixtureRequest, redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> Iterator[Celery]:
    """An app whose publish is not answered by a worker: a broker in memory (taskdedup's store
    is the peer's Redis), or the Redis broker on the peer's server (lock, peer key and
    message in one script)."""
    broker = "memory://" if request.param == "store apart" else redis_url
    app = Celery("guard", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"},
        task_default_queue=f"{key_prefix}-q",
        taskdedup_key_prefix=key_prefix,
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_url, "default_timeout": 600},
        },
        singleton_backend_url=redis_url,
        singleton_key_prefix=f"{key_prefix}:SINGLETONLOCK_",
    )
    yield app
    for key in redis_client.scan_iter(match=f"qo_{key_prefix}*"):
        redis_client.delete(key)


@pytest.mark.parametrize("peer", ["once", "singleton"])
def test_a_drop_in_publish_is_one_round_trip_new_or_duplicate(
    peer: str,
    app: Celery,
    key_prefix: str,
    redis_client: redis.Redis,
    round_trips: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = QueueOnce if peer == "once" else Singleton

    @app.task(base=base, name=f"{key_prefix}.{peer}", shared=False)
    def job(item: str) -> None: ...

    app.finalize()
    for _ in range(2):  # (connections opened, scripts loaded: not the publish's work)
        with contextlib.suppress(AlreadyQueued):
            job.delay("warm-up")
    item = uuid.uuid4().hex
    first: list[Any] = []
    assert round_trips(lambda: first.append(job.delay(item))) == 1
    key = job.peer_key((item,), {})
    assert redis_client.get(key) == first[0].id.encode()  # the peer's key, naming the job
    scripts: list[bytes] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def watched(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        packed = b"".join(command) if isinstance(command, list) else bytes(command)
        scripts.append(packed) if b"EVALSHA" in packed.upper() else None
        return send(self, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", watched)
    # the key was taken here a moment ago: its duplicates ask the peer's key alone (SET NX and
    # PTTL or GET in one round trip, no script), as many times as they come
    for _ in range(3):
        scripts.clear()
        if peer == "once":
            caught: list[AlreadyQueued] = []

            def duplicate(caught: list[AlreadyQueued] = caught) -> None:
                with pytest.raises(AlreadyQueued) as raised:
                    job.delay(item)
                caught.append(raised.value)

            assert round_trips(duplicate) == 1
            assert 590 < caught[0].countdown <= 600
        else:
            again: list[Any] = []
            assert round_trips(lambda again=again: again.append(job.delay(item))) == 1
            assert again[0].id == first[0].id  # the holder's AsyncResult, as the original's
        assert scripts == []
    # a key this process never saw held (another producer's) is found by the acquire's
    # guard: one round trip too
    other = uuid.uuid4().hex
    redis_client.set(job.peer_key((other,), {}), "another-producer", px=60_000)
    scripts.clear()
    if peer == "once":
        with pytest.raises(AlreadyQueued):
            assert round_trips(lambda: job.delay(other)) == 1
    else:
        held: list[Any] = []
        assert round_trips(lambda: held.append(job.delay(other))) == 1
        assert held[0].id == "another-producer"
    assert len(scripts) == 1
