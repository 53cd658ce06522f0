"""A Redis that stops answering (G5): the store gives up after its socket timeout.

The server here is a loopback port that accepts connections and never replies, which is what a
hung Redis (or a dead peer behind a live network path) looks like to a client.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from taskdedup import Deduplicator, Policy, RedisStore, Settings, StoreUnavailable


def build(commit: str) -> None: ...


POLICY = Policy("until_executed").bind("ci.build", build)


@pytest.fixture
def silent_url() -> Iterator[str]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"


@pytest.mark.parametrize("side", ["sync", "asyncio", "asyncio, timeout in the url"])
def test_a_store_that_stops_answering_is_unavailable_after_the_socket_timeout(
    silent_url: str, side: str
) -> None:
    if "url" in side:
        store = RedisStore.from_url(silent_url + "?socket_timeout=0.3", socket_timeout=60)
    else:
        store = RedisStore.from_url(silent_url, socket_timeout=0.3)
    dedup = Deduplicator(store, Settings(on_store_error="raise"))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not answer"):
        if side == "sync":
            dedup.enqueue(POLICY, ("abc",))
        else:
            asyncio.run(dedup.aenqueue(POLICY, ("abc",)))
    waited = time.monotonic() - started
    # Not a speed claim: without the timeout this call would wait forever.
    assert waited < 5


def test_the_default_is_to_publish_anyway(silent_url: str) -> None:
    """on_store_error="publish" (the default): the outage is logged and the job goes out."""
    store = RedisStore.from_url(silent_url, socket_timeout=0.3)
    ticket = asyncio.run(Deduplicator(store).aenqueue(POLICY, ("abc",)))
    assert ticket.should_publish and ticket.outcome == "store_unavailable"


def test_after_a_timeout_each_asyncio_call_still_gets_its_own_answer(
    private_redis_url: str,
) -> None:
    """A call cut off by the deadline leaves no reply behind on a connection that a later call
    would read as its own (the store's asyncio calls share one quick connection when free)."""
    import redis

    store = RedisStore.from_url(private_redis_url, socket_timeout=0.3)
    dedup = Deduplicator(store, Settings(on_store_error="raise"))
    admin = redis.Redis.from_url(private_redis_url)

    async def main() -> None:
        first = await dedup.aenqueue(POLICY, ("a",), job_id="job-a")
        dedup.published(first)  # its message is in the broker: a duplicate may be answered with it
        admin.client_pause(1500)  # Redis stops answering for 1.5 s
        with pytest.raises(StoreUnavailable):
            await dedup.aenqueue(POLICY, ("b",), job_id="job-b")
        deadline = time.monotonic() + 10
        while True:  # the same questions again, once Redis answers
            try:
                again = await dedup.aenqueue(POLICY, ("a",), job_id="job-a2")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "Redis never answered again"
        assert again.deduplicated and again.job_id == first.job_id
        other = await dedup.aenqueue(POLICY, ("c",), job_id="job-c")
        assert other.acquired and other.job_id == "job-c"
        await store.aclose()

    asyncio.run(main())
    admin.close()


def test_a_redis_out_of_memory_is_unavailable_for_producers_and_workers() -> None:
    """maxmemory reached under noeviction refuses every write: the producer follows
    on_store_error and the worker sends the job back for later (G14), neither sees a raw
    redis error."""
    from redis_server import PrivateRedis

    server = PrivateRedis(extra_args=["--maxmemory", "1", "--maxmemory-policy", "noeviction"])
    with server:
        dedup = Deduplicator(RedisStore.from_url(server.url, key_prefix="oom"))
        ticket = dedup.enqueue(POLICY, ("abc",))
        assert ticket.outcome == "store_unavailable" and ticket.should_publish
        admission = dedup.claim(POLICY, ticket.job_id, args=("abc",))
        assert admission.outcome == "store_unavailable" and admission.retry_after == 1
        with pytest.raises(StoreUnavailable, match=r"did not answer"):
            asyncio.run(
                Deduplicator(dedup.store, Settings(on_store_error="raise")).aenqueue(
                    POLICY, ("abc",)
                )
            )
