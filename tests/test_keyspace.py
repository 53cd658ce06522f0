"""Records under the prefix that taskdedup did not write: a clear error naming the key, and no
key that blocks forever (issue 12). Real Redis: these are Redis' own error replies."""

from __future__ import annotations

import redis

from taskdedup import CorruptRecord, Deduplicator, Policy, RedisStore, TaskPolicy
from taskdedup.stores.base import Inspect

POLICY = TaskPolicy("ci.build", None, Policy("until_executed"))


def test_a_record_of_another_type_is_a_corrupt_record_error_naming_the_key(
    redis_url: str, key_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store)
    key = POLICY.key_for(("abc",))
    (lock_name,) = [n for n in store.calls.names(key, "lock")]
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(lock_name, "not a hash", ex=60)  # something else wrote under our prefix
        try:
            dedup.enqueue(POLICY, ("abc",))
        except CorruptRecord as exc:
            assert lock_name in str(exc) and "WRONGTYPE" in str(exc)
            assert "delete it" in str(exc)
        else:
            raise AssertionError("no CorruptRecord for a string where a lock hash should be")
    finally:
        client.close()
        dedup.close()


def test_a_lock_without_a_ttl_gets_one_by_its_second_duplicate(
    redis_url: str, key_prefix: str
) -> None:
    """A restore without ttls would hold the key for good (G9). The check costs a command, so
    it is made at a holder's second duplicate (and every 64th after), not at the first: the
    duplicate a double click makes stays two commands."""
    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store)
    key = POLICY.key_for(("def",))
    (lock_name,) = [n for n in store.calls.names(key, "lock")]
    client = redis.Redis.from_url(redis_url)
    try:
        first = dedup.enqueue(POLICY, ("def",))
        dedup.published(first)
        client.persist(lock_name)  # a hand edit, a restore without ttls: it would hold for good
        assert client.pttl(lock_name) == -1
        for _ in range(2):
            again = dedup.enqueue(POLICY, ("def",))
            assert again.deduplicated and again.job_id == first.job_id
        assert 0 < client.pttl(lock_name) <= POLICY.policy.ttl_seconds * 1000
        assert store.run(Inspect(key)) is not None
    finally:
        client.close()
        dedup.close()


def test_an_idempotency_record_without_a_ttl_gets_one_at_the_next_use(
    redis_url: str, key_prefix: str
) -> None:
    from taskdedup import IdempotencyKeys

    store = RedisStore.from_url(redis_url, key_prefix=key_prefix)
    dedup = Deduplicator(store)
    keys = IdempotencyKeys(dedup)
    client = redis.Redis.from_url(redis_url)
    try:
        first = keys.recall("ci-42", "ci.build", "fp", "job-1", ttl=600)
        keys.published(first)
        (name,) = [n for n in client.scan_iter(match=f"{key_prefix}*") if b"job" not in n]
        client.persist(name)
        again = keys.recall("ci-42", "ci.build", "fp", "job-2", ttl=600)
        assert again.hit and again.job_id == "job-1"
        assert 0 < client.pttl(name) <= 600_000
    finally:
        client.close()
        dedup.close()
