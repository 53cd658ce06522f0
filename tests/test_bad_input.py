"""Bad input gets a clear ConfigError naming the option and the value, at definition (issue 12).

Durations that are NaN, infinite, negative, booleans, strings or absurdly long, limits that are
booleans, and yes/no settings given as strings that only look like booleans used to pass (NaN
and inf failed later with a bare ValueError/OverflowError; ``max_concurrent=True`` reached Redis
as a DataError; ``enabled="no"`` switched taskdedup on).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from celery import Celery

from taskdedup import ConfigError, Policy, ReservePolicy, Settings
from taskdedup.celery import deduplicate, install, reserve

BAD_SECONDS = [math.nan, math.inf, -math.inf, -1, True, "10", 1e12]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
@pytest.mark.parametrize("option", ["ttl", "lease"])
def test_a_bad_duration_is_refused_at_definition_naming_the_option(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=option):
        Policy("until_executed", **{option: value})


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
@pytest.mark.parametrize(
    "setting", ["default_ttl", "default_lease", "grace", "remember_finished", "idempotency_ttl"]
)
def test_a_bad_duration_setting_is_refused_naming_it(setting: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=setting):
        Settings(**{setting: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, True, "5"], ids=repr)
def test_a_bad_idempotency_wait_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="idempotency_wait"):
        Settings(idempotency_wait=value)


def test_the_idempotency_wait_can_be_set_from_the_environment() -> None:
    assert Settings.load(environ={"TASKDEDUP_IDEMPOTENCY_WAIT": "2.5"}).idempotency_wait == 2.5
    with pytest.raises(ConfigError, match="TASKDEDUP_IDEMPOTENCY_WAIT"):
        Settings.load(environ={"TASKDEDUP_IDEMPOTENCY_WAIT": "soon"})


@pytest.mark.parametrize("value", [True, 0, -2, 2.5, "3", math.nan], ids=repr)
def test_a_bad_max_concurrent_is_refused_before_anything_reaches_the_store(value: Any) -> None:
    with pytest.raises(ConfigError, match="max_concurrent"):
        ReservePolicy(max_concurrent=value, scope="tenant")


@pytest.mark.parametrize("setting", ["enabled", "dry_run"])
def test_yes_no_settings_take_booleans_and_their_usual_spellings_only(setting: str) -> None:
    assert getattr(Settings(**{setting: "false"}), setting) is False
    assert getattr(Settings(**{setting: "no"}), setting) is False  # was True: a non-empty str
    assert getattr(Settings(**{setting: "1"}), setting) is True
    for bad in ("maybe", 2, None, "", [True]):
        with pytest.raises(ConfigError, match=setting):
            Settings(**{setting: bad})


def test_a_celery_task_with_a_nan_ttl_is_refused_where_it_is_defined_naming_it() -> None:
    app = Celery("bad-input", set_as_current=False)
    install(app)
    with pytest.raises(ConfigError, match=r"task 'bad\.export': ttl must be a finite"):

        @deduplicate("until_executed", ttl=math.nan)
        @app.task(shared=False, name="bad.export")
        def export(day: str) -> str:
            return day


def test_a_celery_task_capped_with_max_concurrent_true_is_refused_naming_it() -> None:
    app = Celery("bad-input-cap", set_as_current=False)
    install(app)
    with pytest.raises(ConfigError, match=r"task 'bad\.capped': max_concurrent must be"):

        @reserve(True, scope="tenant")
        @app.task(shared=False, name="bad.capped")
        def capped(tenant: str) -> str:
            return tenant


def test_a_reschedule_once_call_over_the_payload_limit_is_refused_and_writes_nothing() -> None:
    from taskdedup import Deduplicator, MemoryStore, PayloadTooLarge, TaskPolicy

    store = MemoryStore()
    dedup = Deduplicator(store, Settings(reschedule_payload_limit=100))
    tp = TaskPolicy("ci.render", None, Policy("until_executing", on_conflict="reschedule_once"))
    with pytest.raises(PayloadTooLarge, match=r"'ci\.render'.*200 bytes.*100"):
        dedup.enqueue(tp, ("x",), payload="x" * 200)
    assert store._records == {}  # nothing written
    assert dedup.enqueue(tp, ("x",), payload="x" * 50).acquired  # under the limit: as before
    unlimited = Deduplicator(MemoryStore(), Settings(reschedule_payload_limit=0))
    assert unlimited.enqueue(tp, ("y",), payload="y" * 10_000).acquired


def test_a_celery_reschedule_once_call_over_the_limit_publishes_nothing(
    redis_url: str, key_prefix: str
) -> None:
    import redis

    from taskdedup import PayloadTooLarge
    from test_celery import make_app

    app = make_app(redis_url, key_prefix, taskdedup_reschedule_payload_limit=1024)
    install(app)

    @deduplicate("until_executing", on_conflict="reschedule_once", keys=["doc"])
    @app.task(shared=False)
    def render(doc: str, body: str) -> str:
        return doc

    with pytest.raises(PayloadTooLarge, match="render"):
        render.delay("d1", "x" * 5000)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.llen(f"{key_prefix}:kombu:{key_prefix}-q") == 0
        assert not list(client.scan_iter(match=f"{key_prefix}*lock*"))
    finally:
        client.close()
    assert not render.delay("d1", "small").deduplicated


@pytest.mark.parametrize("layout", ["store apart", "fused with the broker"])
def test_arguments_the_serializer_cannot_encode_fail_the_call_and_leave_no_key(
    redis_url: str, key_prefix: str, layout: str
) -> None:
    import redis
    from kombu.exceptions import EncodeError

    from taskdedup import RedisStore
    from test_celery import make_app

    app = make_app(redis_url, key_prefix)
    # the same server under another spelling: not fused, the lock is taken before the publish
    url = redis_url if layout != "store apart" else redis_url.replace("127.0.0.1", "localhost")
    install(app, store=RedisStore.from_url(url, key_prefix=key_prefix))

    @deduplicate("until_executed", keys=["day"])
    @app.task(shared=False)
    def export(day: str, options: Any = None) -> str:
        return day

    with pytest.raises(EncodeError):
        export.delay("mon", object())  # the key is fine; JSON cannot encode the message
    client = redis.Redis.from_url(redis_url)
    try:
        left = [k for k in client.scan_iter(match=f"{key_prefix}*") if b":kombu:" not in k]
        assert left == [], f"keys left behind by a call that was never published: {left}"
    finally:
        client.close()
    assert not export.delay("mon").deduplicated


def test_a_taskiq_call_the_formatter_cannot_serialize_fails_and_leaves_no_key(
    redis_url: str, key_prefix: str
) -> None:
    import asyncio

    import redis
    from taskiq_redis import ListQueueBroker

    from taskdedup.taskiq import DedupMiddleware

    # a store apart from the broker (another spelling of the server): the lock is taken in
    # pre_send, before the formatter serializes the message
    store_url = redis_url.replace("127.0.0.1", "localhost")
    broker = ListQueueBroker(redis_url, queue_name=f"{key_prefix}-q").with_middlewares(
        DedupMiddleware(store_url, key_prefix=key_prefix)
    )

    @broker.task(deduplicate={"strategy": "until_executed", "keys": ["day"]})
    async def export(day: str, options: Any = None) -> str:
        return day

    client = redis.Redis.from_url(redis_url)

    async def main() -> bool:
        await broker.startup()
        try:
            with pytest.raises(Exception, match="Cannot send task"):  # taskiq's SendTaskError
                await export.kiq("mon", object())
            left = list(client.scan_iter(match=f"{key_prefix}*"))
            assert left == [], f"keys left behind by a call that was never sent: {left}"
            return bool((await export.kiq("mon")).deduplicated)
        finally:
            await broker.shutdown()

    try:
        assert asyncio.run(main()) is False  # the key was free again
    finally:
        client.close()
