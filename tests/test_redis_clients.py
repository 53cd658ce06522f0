"""RedisStore's asyncio clients: one set per event loop, whatever the caller does with loops."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from taskdedup import Deduplicator, Policy, RedisStore, Settings


def build(commit: str) -> None: ...


POLICY = Policy("until_executed").bind("ci.build", build)


def test_one_store_serves_one_event_loop_after_another(redis_url: str, key_prefix: str) -> None:
    """A script that calls ``asyncio.run`` several times with one store: redis-py's asyncio
    clients are bound to their first loop, so each new loop gets clients of its own."""
    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store, Settings(on_store_error="raise"))
    first = asyncio.run(dedup.aenqueue(POLICY, ("loops",), job_id="j0"))
    dedup.published(first)
    again = [asyncio.run(dedup.aenqueue(POLICY, ("loops",), job_id=f"j{i}")) for i in (1, 2)]
    assert first.acquired
    assert all(a.deduplicated and a.job_id == "j0" for a in again)
    store.close()


def test_threads_with_event_loops_of_their_own_share_one_store(
    redis_url: str, key_prefix: str
) -> None:
    """Each thread runs its own loop against the same store at the same time: every answer
    is the right one (each loop has its own clients)."""
    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store, Settings(on_store_error="raise"))
    wrong: list[str] = []

    async def calls(thread: int) -> None:
        for i in range(150):
            first = await dedup.aenqueue(POLICY, (f"t{thread}-{i}",), job_id=f"{thread}-{i}")
            dedup.published(first)
            again = await dedup.aenqueue(POLICY, (f"t{thread}-{i}",), job_id=f"{thread}-{i}b")
            if not (first.acquired and again.deduplicated and again.job_id == f"{thread}-{i}"):
                wrong.append(f"{thread}-{i}")

    threads = [threading.Thread(target=asyncio.run, args=(calls(t),)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert wrong == []
    store.close()


def test_loops_that_ended_leave_no_connections_behind(private_redis_url: str) -> None:
    """Ten ``asyncio.run`` calls on one store: the clients of each finished loop are let go
    (their sockets close), so connections do not pile up one set per loop."""
    import gc

    import redis

    admin = redis.Redis.from_url(private_redis_url)
    before = int(admin.info("clients")["connected_clients"])
    store = RedisStore.from_url(private_redis_url, key_prefix="loops")
    dedup = Deduplicator(store, Settings(on_store_error="raise"))
    for i in range(10):
        asyncio.run(dedup.aenqueue(POLICY, (f"k{i}",)))
    gc.collect()
    after = int(admin.info("clients")["connected_clients"])
    assert after - before <= 2  # the last loop's two connections at most
    admin.close()


def test_32_threads_first_calls_on_a_fresh_store_all_answer(
    redis_url: str, key_prefix: str
) -> None:
    """Threads that race to a fresh store's first call share one client: a client made twice
    and dropped closes its pool's connections under the threads using them (31 of 32 sent
    calls failed with "Connection closed by server" before)."""
    from taskdedup.stores.base import Acquire

    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    barrier = threading.Barrier(32)
    replies: list[object] = []
    errors: list[BaseException] = []

    def first_call(i: int) -> None:
        barrier.wait()
        try:
            sent = store.send(Acquire("race", f"j{i}", 60_000, 60_000))
            assert sent is not None
            replies.append(sent.reply())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(32)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often, as on a busy producer
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert len(replies) == 32
    assert sum(r.acquired for r in replies) == 1  # type: ignore[attr-defined]
    store.close()


def test_a_connection_lost_between_a_call_and_its_reply_is_asked_again(
    private_redis_url: str,
) -> None:
    """The store's connection is killed after a call was written and before its reply was
    read: the call is run again on a new connection (as redis-py's retries would), and the
    caller gets an answer, not StoreUnavailable."""
    import redis

    from taskdedup.stores.base import Acquire

    admin = redis.Redis.from_url(private_redis_url)
    admin.client_setname("admin")
    store = RedisStore.from_url(private_redis_url, key_prefix="lost-reply")
    store.run(Acquire("warm", "w", 60_000, 60_000))  # connected, scripts loaded
    admin.client_pause(5000, all=False)  # writes wait: the call is held before it runs
    try:
        sent = store.send(Acquire("lost", "j1", 60_000, 60_000))
        assert sent is not None
        victims = [c["id"] for c in admin.client_list() if c.get("name") != "admin"]
        assert victims
        for ident in victims:
            admin.client_kill_filter(_id=ident)
    finally:
        admin.client_unpause()
    reply = sent.reply()
    assert reply.acquired and reply.holder == "j1"
    assert store.run(Acquire("lost", "j2", 60_000, 60_000)).holder == "j1"
    store.close()
    admin.close()


def test_a_child_forked_while_the_client_is_being_made_can_make_its_own(
    redis_url: str, key_prefix: str
) -> None:
    """A prefork child forked while a parent thread holds the lock that makes the client
    (a first store call under way) makes its own client, instead of waiting for ever."""
    import os

    from taskdedup.stores.base import Inspect

    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    with store.clients._making:  # another thread of the parent is making the client
        pid = os.fork()
        if pid == 0:  # the child: its first store call must answer
            try:
                store.run(Inspect("forked"))
                os._exit(0)
            except BaseException:
                os._exit(1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child never answered: it waited on the parent's lock")
