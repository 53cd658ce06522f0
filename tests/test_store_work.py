"""The store's work per decision, counted (not timed): Redis commands per enqueue, its
confirmation, duplicate, claim and finish, read from ``INFO commandstats`` on a server nobody
else uses (G17). A script counts as its EVALSHA plus each command it calls. The ceilings are
today's counts: a change that makes any step heavier fails here and must say why.

Before issue 24 an enqueue cost 19 commands (acquire 13 with a fence counter key and a history
entry, confirmation 6), a duplicate 8, a claim 11-12 and a finish 11-12; each finished job left
3 keys behind (its record, the key's history, the fence counter).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from taskdedup import Deduplicator, Policy, RedisStore, TaskPolicy
from taskdedup.settings import Settings
from taskdedup.stores.base import Confirm
from taskdedup.stores.redis_calls import SOURCES

#: The Redis commands each step costs (EVALSHA included), with history on.
CEILINGS = {
    "enqueue": 5,  # HMGET, TIME, HSET, PEXPIRE
    "confirmation": 4,  # HMGET, HSET, PEXPIREAT (batched: one pipeline per batch)
    "first duplicate": 3,  # HMGET, HSET (counted on the lock, with its id)
    "second duplicate": 4,  # and PTTL: a lock without a ttl (a restore) gets one (G9)
    "duplicate": 3,  # HMGET, HSET (every 64th again checks the ttl)
    "claim (until_executing)": 7,  # job record, lock, TIME, DEL, record written
    "finish (until_executing)": 5,  # job record marked done, lock looked at
    "claim (until_executed)": 8,
    "finish (until_executed)": 6,
    # a lock that answered duplicates writes them to the key's history, in one line, as it
    # ends: LPUSH and PEXPIRE (and TIME where the step did not read the clock yet)
    "claim (until_executing), after duplicates": 9,
    "finish (until_executing), after duplicates": 5,
    "claim (until_executed), after duplicates": 8,
    "finish (until_executed), after duplicates": 9,
}


def _build(sha: str) -> None: ...


@pytest.fixture
def counted(private_redis_url: str) -> Iterator[Callable[[Callable[[], Any]], int]]:
    client = redis.Redis.from_url(private_redis_url)
    for source in SOURCES.values():  # a first call's NOSCRIPT and load are not the step's work
        client.script_load(source)

    def commands(step: Callable[[], Any]) -> int:
        client.config_resetstat()
        step()
        stats = client.info("commandstats")
        skip = ("cmdstat_config", "cmdstat_info", "cmdstat_script")  # ours, and loading
        return sum(v["calls"] for k, v in stats.items() if not k.startswith(skip))

    yield commands
    client.close()


@pytest.mark.parametrize("strategy", ["until_executing", "until_executed"])
def test_commands_per_step_stay_within_their_ceilings(
    private_redis_url: str, counted: Callable[[Callable[[], Any]], int], strategy: str
) -> None:
    store = RedisStore.from_url(private_redis_url, key_prefix=f"work-{uuid.uuid4().hex[:8]}")
    dedup = Deduplicator(store, settings=Settings(grace=60))
    dedup.confirmer.interval = 3600  # the test confirms by hand, inside its own count
    policy: TaskPolicy = Policy(strategy, ttl=600).bind("ci.build", _build)
    dedup.enqueue(policy, ("warm",))  # scripts loaded, connection made: not counted
    seen: dict[str, int] = {}
    ticket: Any = None

    def enqueue() -> None:
        nonlocal ticket
        ticket = dedup.enqueue(policy, ("sha-1",), job_id="job-1")
        dedup.published(ticket)

    seen["enqueue"] = counted(enqueue)
    assert ticket.acquired
    confirmed: list[int] = []
    seen["confirmation"] = counted(lambda: confirmed.append(dedup.confirmer.flush()))
    assert confirmed == [1]
    dups: list[Any] = []
    seen["first duplicate"] = counted(
        lambda: dups.append(dedup.enqueue(policy, ("sha-1",), job_id="d-1"))
    )
    seen["second duplicate"] = counted(
        lambda: dups.append(dedup.enqueue(policy, ("sha-1",), job_id="d-2"))
    )
    seen["duplicate"] = counted(
        lambda: dups.append(dedup.enqueue(policy, ("sha-1",), job_id="d-3"))
    )
    assert [(d.deduplicated, d.job_id) for d in dups] == [(True, "job-1")] * 3
    for args, after in ((("sha-2",), ""), (("sha-1",), ", after duplicates")):
        job = "job-1" if args == ("sha-1",) else "job-3"
        if job == "job-3":  # a job nobody submitted twice
            dedup.published(dedup.enqueue(policy, args, job_id=job))
            dedup.confirmer.flush()
        admission: Any = None

        def claim() -> None:
            nonlocal admission
            admission = dedup.claim(policy, job, args=args)  # noqa: B023

        seen[f"claim ({strategy}){after}"] = counted(claim)
        assert admission.outcome == "run"
        key = policy.key_for(args)
        seen[f"finish ({strategy}){after}"] = counted(lambda: dedup.finish(policy, key, job))  # noqa: B023
    assert dedup.enqueue(policy, ("sha-1",), job_id="job-2").acquired  # the key was freed
    dedup.close()
    # exactly today's counts: a step that grows fails, and one that shrinks updates the table
    # here and the README (G17 row, "Store work")
    assert seen == {step: n for step, n in CEILINGS.items() if step in seen}


def test_without_history_a_first_duplicate_writes_none(
    private_redis_url: str, counted: Callable[[Callable[[], Any]], int]
) -> None:
    prefix = f"quiet-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(private_redis_url, key_prefix=prefix, history=False)
    dedup = Deduplicator(store, settings=Settings(grace=60, history=False))
    policy = Policy("until_executed", ttl=600).bind("ci.build", _build)
    dedup.enqueue(policy, ("warm",))
    first = dedup.enqueue(policy, ("sha-1",), job_id="job-1")
    dedup.published(first)
    dedup.confirmer.flush()
    assert counted(lambda: dedup.enqueue(policy, ("sha-1",), job_id="d-1")) == 3
    assert counted(lambda: dedup.enqueue(policy, ("sha-1",), job_id="d-2")) == 4  # + PTTL
    client = redis.Redis.from_url(private_redis_url)
    try:
        assert not list(client.scan_iter(match=f"{prefix}:*:log"))
    finally:
        client.close()
        dedup.close()


def test_a_proxy_that_shards_keys_gets_one_confirmation_per_call(
    private_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's single script call spans keys; a proxy that shards them answers CROSSSLOT.
    The batch then goes again, one job per call, and so does every later batch."""
    store = RedisStore.from_url(private_redis_url, key_prefix=f"proxy-{uuid.uuid4().hex[:8]}")
    dedup = Deduplicator(store, settings=Settings(grace=60))
    policy = Policy("until_executed", ttl=600).bind("ci.build", _build)
    tickets = [dedup.enqueue(policy, (n,), job_id=f"job-{n}") for n in range(3)]
    pipeline = store._pipeline
    spans: list[int] = []

    def like_a_proxy(client: Any, calls: list[Any], indexes: list[int]) -> list[Any]:
        spans.extend(len(calls[i].keys) for i in indexes)
        if any(len(calls[i].keys) > 2 for i in indexes):
            raise redis.exceptions.ResponseError("CROSSSLOT Keys in request don't hash to one")
        return pipeline(client, calls, indexes)

    monkeypatch.setattr(store, "_pipeline", like_a_proxy)
    items = tuple((t.key or "", t.job_id) for t in tickets)
    assert store.run(Confirm(items)) == 3
    assert store.sharded and spans == [6, 2, 2, 2]
    dedup.close()
