"""The drop-in ``taskdedup.compat.celery_once``, tested as celery-once 3.0.1 is tested.

Three parts (docs/research/celery-once.md, sections 4 and 5):

1. celery-once's own 68 tests, each rewritten as a test of the drop-in; a comment
   ``# upstream: <file>::<test>`` (or a parametrize id equal to the upstream test's name)
   names the one it stands for. The tests that mocked celery-once's internals check the same
   observable behaviour with a real custom backend (:class:`RecordingBackend`, named by a
   dotted path as a user names one), real files in ``tmp_path`` and a real Redis.
2. Every behaviour of celery-once's README (section 5's checklist), ``test_readme_*``.
3. What taskdedup does differently on purpose (the module docstring), ``test_differs_*``.

Modes: ``eager`` (``task_always_eager``), ``queued`` (published, no worker consumes it) and
``worker`` (a real in-process worker, solo pool). The upstream tests of the publish run in all
three, those of the run or the end of a job in ``eager`` and ``worker``. The README's run
queued where what they show is the key as the publish took it (its name, its ttl, the queue's
length), and in the other modes where a worker changes what is seen (the keys and the
timeout while a worker runs the job).

Every task and queue name starts with the test's ``key_prefix``; celery-once's keys are
``qo_<task name>...``, so ``qo_<prefix>*``, deleted after each test.
"""

from __future__ import annotations

import contextvars
import importlib
import json
import os
import pickle
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.result import EagerResult
from kombu.exceptions import EncodeError, OperationalError
from redis.lock import Lock as RedisLock

from harness import wait_for
from taskdedup.compat import celery_once as compat
from taskdedup.compat.celery_once import (
    AlreadyQueued,
    File,
    QueueOnce,
    Redis,
    force_string,
    import_backend,
    key_to_lock_name,
    kwargs_to_list,
    parse_url,
    queue_once_key,
)
from taskdedup.errors import ConfigError

ALL_MODES = ["eager", "queued", "worker"]
RUN_MODES = ["eager", "worker"]  # the job runs: its end is observable
WAIT = 30.0  # seconds: the deadline of any wait for a worker


# ------------------------------------------------------------------ a custom backend


class BackendLog:
    """What a :class:`RecordingBackend` was asked, in order; ``refuse`` makes it refuse."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse: AlreadyQueued | None = None
        self._lock = threading.Lock()

    def add(self, *call: Any) -> None:
        with self._lock:
            self.calls.append(call)

    def backend_calls(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] in ("raise_or_lock", "clear_lock")]


class RecordingBackend:
    """A custom backend as BACKEND_GUIDE.rst describes one: ``__init__(settings)``,
    ``raise_or_lock(key, timeout)`` (raise AlreadyQueued when locked), ``clear_lock(key)``.
    It stands for upstream's ``tests.backends.TestBackend`` (Mock methods): it records."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.log: BackendLog | None = settings.get("log") if isinstance(settings, dict) else None

    def raise_or_lock(self, key: str, timeout: Any) -> None:
        assert self.log is not None
        self.log.add("raise_or_lock", key, timeout)
        if self.log.refuse is not None:
            raise self.log.refuse

    def clear_lock(self, key: str) -> None:
        assert self.log is not None
        self.log.add("clear_lock", key)


BACKEND_PATH = f"{__name__}.RecordingBackend"  # this module, as import_backend imports it


# ------------------------------------------------------------------ the environment


def make_app(redis_url: str, prefix: str, *, eager: bool = False, **conf: Any) -> Celery:
    """A Celery app whose every key is under ``prefix`` (broker, results, taskdedup), with
    celery-once's configuration (``ONCE``) on the same Redis unless ``conf`` says otherwise."""
    app = Celery(prefix, broker=redis_url, backend=redis_url, set_as_current=False)
    settings: dict[str, Any] = {
        "broker_transport_options": {
            "global_keyprefix": f"{prefix}:kombu:",
            "polling_interval": 0.1,  # the in-process worker stops in 0.1 s, not 1 s
        },
        "result_backend_transport_options": {"global_keyprefix": f"{prefix}:result:"},
        "task_default_queue": f"{prefix}-q",
        "taskdedup_key_prefix": prefix,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "task_always_eager": eager,
        "ONCE": {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_url, "default_timeout": 60},
        },
    }
    settings.update(conf)
    app.conf.update(settings)
    return app


class Gate:
    """Holds a job's body (on the worker's thread) until the test opens it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()

    def enter(self) -> None:
        self.started.set()
        assert self.go.wait(WAIT), "the test never opened the gate"

    def wait_started(self) -> None:
        assert self.started.wait(WAIT), "the worker never started the job"


class Env:
    """One test's app, in one mode, and what the test reads of Redis."""

    def __init__(self, mode: str, redis_url: str, prefix: str, client: redis.Redis, **conf: Any):
        self.mode = mode
        self.prefix = prefix
        self.redis = client
        self.app = make_app(redis_url, prefix, eager=mode == "eager", **conf)
        self.hostname = f"once-{uuid.uuid4().hex[:8]}@{prefix}"
        self.gates: list[Gate] = []

    def task(self, name: str | None = None, **options: Any) -> Callable[[Any], Any]:
        """``@app.task(base=QueueOnce, name=f"{prefix}.<name>", shared=False, ...)``."""
        base = options.pop("base", QueueOnce)

        def define(fn: Any) -> Any:
            task_name = f"{self.prefix}.{name or fn.__name__}"
            return self.app.task(base=base, name=task_name, shared=False, **options)(fn)

        return define

    def key(self, rest: str) -> str:
        """celery-once's key of this test's task ``rest`` (``"job_a-1"`` for job(a=1))."""
        return f"qo_{self.prefix}.{rest}"

    def held(self, key: str) -> bool:
        return bool(self.redis.exists(key))

    def pttl(self, key: str) -> int:
        return int(self.redis.pttl(key))

    def queued(self) -> int:
        """Messages waiting in the test's queue."""
        return int(self.redis.llen(f"{self.prefix}:kombu:{self.prefix}-q"))

    def gate(self) -> Gate:
        gate = Gate()
        self.gates.append(gate)
        return gate

    @contextmanager
    def running(self) -> Iterator[None]:
        """The worker of worker mode (none in the others); its jobs' gates are opened before
        it stops, so a failed test never leaves it blocked."""
        if self.mode != "worker":
            yield
            return
        with self.worker():
            yield

    @contextmanager
    def worker(self, **options: Any) -> Iterator[Any]:
        with start_worker(
            self.app,
            pool="solo",
            perform_ping_check=False,
            hostname=self.hostname,
            shutdown_timeout=WAIT,
            **options,
        ) as worker:
            try:
                yield worker
            finally:  # before the worker is stopped: a held job must not block its stop
                for gate in self.gates:
                    gate.go.set()

    def finished(self, result: Any, key: str | None = None) -> Any:
        """The job's return value once it ended and (``key``) celery-once's key is freed.
        Eager: it has ended already; worker: waited for."""
        assert self.mode in RUN_MODES
        value = result.get(timeout=WAIT, propagate=False)
        if key is not None:
            if self.mode == "eager":
                assert not self.held(key)
            else:
                wait_for(lambda: not self.held(key), WAIT, f"{key} to be freed")
        return value

    def scheduled_ids(self) -> set[str]:
        """The ids of the ETA jobs the worker holds (``inspect scheduled``)."""
        replies = self.app.control.inspect([self.hostname], timeout=2).scheduled() or {}
        return {entry["request"]["id"] for entries in replies.values() for entry in entries}


@pytest.fixture
def once_keys(redis_client: redis.Redis, key_prefix: str) -> Iterator[Callable[[], list[bytes]]]:
    """celery-once's keys of this test (``qo_<prefix>...``), deleted afterwards (the
    ``key_prefix`` fixture deletes only ``<prefix>*``)."""

    def keys() -> list[bytes]:
        return sorted(redis_client.scan_iter(match=f"qo_{key_prefix}*"))

    yield keys
    for key in keys():
        redis_client.delete(key)


@pytest.fixture
def mode() -> str:
    """The mode of a test that is not parametrized over modes."""
    return "queued"


@pytest.fixture
def new_env(
    mode: str, redis_url: str, key_prefix: str, redis_client: redis.Redis, once_keys: Any
) -> Callable[..., Env]:
    """``new_env(**app_conf)``: the test's Env in its mode, with extra app settings."""
    return lambda **conf: Env(mode, redis_url, key_prefix, redis_client, **conf)


@pytest.fixture
def env(new_env: Callable[..., Env]) -> Env:
    return new_env()


@pytest.fixture
def log() -> BackendLog:
    return BackendLog()


@pytest.fixture
def custom_env(new_env: Callable[..., Env], log: BackendLog) -> Env:
    """An Env whose ONCE backend is :class:`RecordingBackend` (upstream's integration
    tests/test_tasks.py setup: ``default_timeout`` 60)."""
    return new_env(ONCE={"backend": BACKEND_PATH, "settings": {"default_timeout": 60, "log": log}})


def foreign_token() -> str:
    """What celery-once 3.0.1 writes as a lock's value: redis-py Lock's uuid1().hex."""
    return uuid.uuid1().hex


# ================================================================== 1. upstream's 68 tests
# ---------------------------------------------------------------------- tests/unit/test_helpers.py


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("a", "a", id="test_force_string_1"),
        pytest.param("a", "a", id="test_force_string_2"),  # u'a': Python 3 has one str
        pytest.param("é", "é", id="test_force_string_3"),
        pytest.param("é", "é", id="test_force_string_4"),  # u'é'
    ],
)
def test_force_string(value: str, expected: str) -> None:
    # upstream: tests/unit/test_helpers.py::test_force_string_1 .. _4
    assert force_string(value) == expected
    assert type(force_string(value)) is str


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({}, [], id="test_kwargs_to_list_empty"),
        pytest.param({"int": 1}, ["int-1"], id="test_kwargs_to_list_1"),
        pytest.param(
            {"int": 1, "boolean": True}, ["boolean-True", "int-1"], id="test_kwargs_to_list_2"
        ),
        pytest.param(
            {"int": 1, "boolean": True, "str": "abc"},
            ["boolean-True", "int-1", "str-abc"],
            id="test_kwargs_to_list_3",
        ),
        pytest.param(
            {"int": 1, "boolean": True, "str": "abc", "list": [1, "2"]},
            ["boolean-True", "int-1", "list-[1, '2']", "str-abc"],
            id="test_kwargs_to_list_4",
        ),
        # test_kwargs_to_list_5 was Python 2 only (its str was UTF-8 bytes, encoded for the
        # key). The Python 3 equivalent: bytes values are not decoded but shown by their
        # repr, as celery-once 3.0.1 does on Python 3 (b'\xc3\xa9' and 'é' differ).
        pytest.param(
            {"a": {"é": b"c"}, "b": ["a", "é".encode()], "c": 1, "d": "é".encode(), "e": "é"},
            ["a-{'é': b'c'}", "b-['a', b'\\xc3\\xa9']", "c-1", "d-b'\\xc3\\xa9'", "e-é"],
            id="test_kwargs_to_list_5",
        ),
        pytest.param(
            {"a": {"é": "c"}, "b": ["a", "é"], "c": 1, "d": "é", "e": "é"},
            ["a-{'é': 'c'}", "b-['a', 'é']", "c-1", "d-é", "e-é"],
            id="test_kwargs_to_list_6",
        ),
        pytest.param(
            {"nested": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}},
            ["nested-{'a': 1, 'b': 2, 'c': 3, 'd': 4, 'e': 5}"],
            id="test_kwargs_to_list_nested_dict_is_sorted_1",
        ),
        pytest.param(
            {"nested": {"a": {"a": 1, "b": 2}, "c": 2, "b": 3, "d": 4, "e": 5}},
            ["nested-{'a': \"{'a': 1, 'b': 2}\", 'b': 3, 'c': 2, 'd': 4, 'e': 5}"],
            id="test_kwargs_to_list_nested_dict_is_sorted_2",
        ),
    ],
)
def test_kwargs_to_list(kwargs: dict[str, Any], expected: list[str]) -> None:
    # upstream: tests/unit/test_helpers.py::test_kwargs_to_list_* (the parametrize id)
    assert kwargs_to_list(kwargs) == expected
    original = pytest.importorskip("celery_once.helpers")  # byte for byte the original's
    assert original.kwargs_to_list(kwargs) == expected


@pytest.mark.parametrize(
    ("name", "kwargs", "restrict_to", "expected"),
    [
        pytest.param("example", {}, None, "qo_example", id="test_queue_once_key"),
        pytest.param(
            "example", {"pk": 10}, None, "qo_example_pk-10", id="test_queue_once_key_kwargs"
        ),
        pytest.param(
            "example",
            {"pk": 10, "id": 10},
            ["pk"],
            "qo_example_pk-10",
            id="test_queue_once_key_kwargs_restrict_keys",
        ),
        # test_queue_once_key_unicode_py2 was Python 2 only: its key was the UTF-8 bytes
        # "qo_\xc3\xa9xample...". The Python 3 equivalent: the key's bytes, as redis-py sends
        # them, are those bytes (a Python 2 producer's lock is the same Redis key).
        pytest.param(
            "éxample",
            {"a": "é", "b": "é"},
            None,
            b"qo_\xc3\xa9xample_a-\xc3\xa9_b-\xc3\xa9",
            id="test_queue_once_key_unicode_py2",
        ),
        pytest.param(
            "éxample",
            {"a": "é", "b": "é"},
            None,
            "qo_éxample_a-é_b-é",
            id="test_queue_once_key_unicode_py3",
        ),
    ],
)
def test_queue_once_key(name: str, kwargs: Any, restrict_to: Any, expected: Any) -> None:
    # upstream: tests/unit/test_helpers.py::test_queue_once_key* (the parametrize id)
    key = queue_once_key(name, kwargs, restrict_to=restrict_to)
    if isinstance(expected, bytes):
        assert key.encode("utf-8") == expected
    else:
        assert key == expected


def test_import_backend() -> None:
    # upstream: tests/unit/test_helpers.py::test_import_backend
    # (a dotted path to a class in the test package; here this module, by its import name)
    assert importlib.import_module(__name__) is sys.modules[__name__]
    backend = import_backend({"backend": BACKEND_PATH, "settings": 1})
    assert type(backend) is RecordingBackend
    assert backend.settings == 1


# ------------------------------------------------------------------------ tests/unit/test_tasks.py
# (upstream's module does `from celery import task`, which Celery 5 removed: ported to
# app.task, the task names carry the test's prefix)


@pytest.fixture
def unit_tasks(env: Env) -> Any:
    class Tasks:
        @env.task()
        def simple_example() -> str:
            return "simple"

        @env.task(bind=True)
        def bound_task(self: Any, a: int, b: int) -> int:
            return a + b

        @env.task()
        def args_example(a: int, b: int) -> int:
            return a + b

        @env.task(once={"keys": ["a"]})
        def select_args_example(a: int, b: int) -> int:
            return a + b

        @env.task(autoretry_for=(Exception,))
        def autoretry_for_example(a: int, b: int) -> int:
            return a + b

    return Tasks


def test_get_key_simple(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_simple
    assert unit_tasks.simple_example.get_key() == env.key("simple_example")


def test_get_key_args_1(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_args_1
    key = unit_tasks.args_example.get_key(kwargs={"a": 1, "b": 2})
    assert key == env.key("args_example_a-1_b-2")


def test_get_key_args_2(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_args_2
    assert unit_tasks.args_example.get_key(args=(1, 2)) == env.key("args_example_a-1_b-2")


def test_get_key_select_args_1(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_select_args_1
    key = unit_tasks.select_args_example.get_key(kwargs={"a": 1, "b": 2})
    assert key == env.key("select_args_example_a-1")


def test_get_key_bound_task(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_bound_task
    key = unit_tasks.bound_task.get_key(kwargs={"a": 1, "b": 2})
    assert key == env.key("bound_task_a-1_b-2")


def test_get_key_autoretry_for(unit_tasks: Any, env: Env) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_key_autoretry_for (#74)
    task = unit_tasks.autoretry_for_example
    assert task.run is not task._orig_run  # Celery did wrap run for autoretry_for
    key = task.get_key(kwargs={"a": 1, "b": 2})
    assert key == env.key("autoretry_for_example_a-1_b-2")


def test_get_call_args(unit_tasks: Any) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_call_args
    assert unit_tasks.args_example._get_call_args((1, 2), {}) == {"a": 1, "b": 2}


def test_get_call_args_bound(unit_tasks: Any) -> None:
    # upstream: tests/unit/test_tasks.py::test_get_call_args_bound
    assert unit_tasks.bound_task._get_call_args((1, 2), {}) == {"a": 1, "b": 2}


# --------------------------------------------------------------- tests/unit/backends/test_redis.py


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "redis://localhost:6379/",
            {"host": "localhost", "port": 6379},
            id="test_parse_redis_details_tcp_default_args",
        ),
        pytest.param(
            "redis://localhost:6379/3",
            {"host": "localhost", "port": 6379, "db": 3},
            id="test_parse_url_tcp_with_db",
        ),
        pytest.param("redis://localhost", {"host": "localhost"}, id="test_parse_url_tcp_no_port"),
        pytest.param(
            "redis://:ohai@localhost:6379",
            {"host": "localhost", "port": 6379, "password": "ohai"},
            id="test_parse_url_tcp_with_password",
        ),
        pytest.param(
            "redis+socket:///var/run/redis/redis.sock",
            {"unix_socket_path": "/var/run/redis/redis.sock"},
            id="test_parse_url_unix_sock_no_options",
        ),
        pytest.param(
            "redis+socket:///var/run/redis/redis.sock?db=2&socket_timeout=2",
            {"unix_socket_path": "/var/run/redis/redis.sock", "db": 2, "socket_timeout": 2.0},
            id="test_parse_url_unix_sock_with_options",
        ),
        pytest.param(
            "rediss://localhost:6379/3",
            {"host": "localhost", "port": 6379, "db": 3, "ssl": True},
            id="test_parse_url_with_ssl",
        ),
        # README: "?ssl=true" and "?db=1" are passed on to StrictRedis (as strings, db an int)
        pytest.param(
            "redis://localhost:6379?ssl=true&db=1",
            {"host": "localhost", "port": 6379, "ssl": "true", "db": 1},
            id="readme_query_options",
        ),
    ],
)
def test_parse_url(url: str, expected: dict[str, Any]) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_parse_* (the parametrize id)
    details = parse_url(url)
    assert details == expected
    assert type(details.get("db", 0)) is int


def test_parse_unsupported_url() -> None:
    # upstream: tests/unit/backends/test_redis.py::test_parse_unsupported_url
    with pytest.raises(ValueError, match="Unsupported protocol"):
        parse_url("amqp://guest:guest@localhost:5672/potato")


@pytest.fixture
def redis_backend(redis_url: str) -> Redis:
    return Redis({"url": redis_url})


def test_redis_raise_or_lock(redis_backend: Redis, env: Env) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_redis_raise_or_lock
    key = env.key("test")
    assert env.redis.get(key) is None
    redis_backend.raise_or_lock(key=key, timeout=60)
    assert env.redis.get(key) is not None
    assert 58_000 < env.pttl(key) <= 60_000  # SET NX PX 60000


def test_redis_raise_or_lock_locked(redis_backend: Redis, env: Env) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_redis_raise_or_lock_locked
    key = env.key("test")
    assert RedisLock(env.redis, key, timeout=30).acquire()  # expires in 30 seconds
    with pytest.raises(AlreadyQueued) as caught:
        redis_backend.raise_or_lock(key=key, timeout=60)
    assert caught.value.countdown == pytest.approx(30.0, rel=0.1)
    assert isinstance(caught.value.countdown, float)
    assert "Expires in" in caught.value.message


def test_redis_raise_or_lock_locked_and_expired(redis_backend: Redis, env: Env) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_redis_raise_or_lock_locked_and_expired
    key = env.key("test")
    assert RedisLock(env.redis, key, timeout=0.2).acquire()
    wait_for(lambda: not env.held(key), 5, "the lock to expire")
    redis_backend.raise_or_lock(key=key, timeout=60)
    assert env.redis.get(key) is not None


def test_redis_clear_lock(redis_backend: Redis, env: Env) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_redis_clear_lock
    key = env.key("test")
    env.redis.set(key, 1326499200 + 30)
    assert redis_backend.clear_lock(key) == 1  # DEL's reply
    assert env.redis.get(key) is None


def test_redis_cached_property(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # upstream: tests/unit/backends/test_redis.py::test_redis_cached_property
    monkeypatch.setattr(compat, "_CLIENTS", {})  # no client from an earlier test
    parsed: list[str] = []

    def counting_parse_url(url: str) -> dict[str, Any]:
        parsed.append(url)
        return parse_url(url)

    monkeypatch.setattr(compat, "parse_url", counting_parse_url)
    first = Redis({"url": redis_url})
    second = Redis({"url": redis_url})  # despite being built twice, set up once
    assert parsed == [redis_url]
    assert first.redis is second.redis
    # taskdedup differs: one client per URL; celery-once kept the first app's for every URL
    other_url = redis_url + ("&" if "?" in redis_url else "?") + "socket_timeout=5"
    assert Redis({"url": other_url}).redis is not first.redis
    assert parsed == [redis_url, other_url]


# ---------------------------------------------------------------- tests/unit/backends/test_file.py


def test_key_to_lock_name() -> None:
    # upstream: tests/unit/backends/test_file.py::test_key_to_lock_name
    assert key_to_lock_name("qo_test") == "qo_test_999f583e69db6a0c04b86beeebb2b631"
    long_name = key_to_lock_name("qo_looooooong_task_name")
    assert long_name == "qo_looooooong_tas_6626e5965e549303044d5a7f4fdc3c6b"
    assert key_to_lock_name("qo_example_a-1") == "qo_example_a-1_b7f89d8561e5788a3e7687c6ede93bcd"
    assert len(key_to_lock_name("qo_" + "x" * 500)) == 50


def test_file_init(tmp_path: Path) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_init (makedirs(location) called)
    location = str(tmp_path / "home" / "test")
    backend = File({"location": location})
    assert backend.location == location
    assert os.path.isdir(location)


def test_file_init_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_init_default
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() is tmp_path
    backend = File({})
    assert backend.location == os.path.join(tempfile.gettempdir(), "celery_once")
    assert os.path.isdir(backend.location)


def test_file_init_location_exists(tmp_path: Path) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_init_location_exists (EEXIST is
    # swallowed)
    location = tmp_path / "locks"
    location.mkdir()
    (location / "kept").write_text("")
    backend = File({"location": str(location)})
    assert backend.location == str(location)
    assert os.listdir(location) == ["kept"]


@pytest.fixture
def file_backend(tmp_path: Path) -> File:
    return File({"location": str(tmp_path / "celery")})


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_file_create_lock(file_backend: File) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_create_lock (one O_CREAT|O_EXCL
    # open of location/key_to_lock_name(key), the descriptor closed, no utime)
    key = "test.task.key"
    path = os.path.join(file_backend.location, key_to_lock_name(key))
    fds = open_fds()
    assert file_backend.raise_or_lock(key, 3600) is None
    assert open_fds() == fds  # closed
    assert os.listdir(file_backend.location) == [key_to_lock_name(key)]
    assert os.path.getsize(path) == 0
    with pytest.raises(FileExistsError):  # it is the file an O_EXCL open finds taken
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))


def test_file_lock_exists(file_backend: File) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_lock_exists (mtime 1000 s ago,
    # timeout 3600: countdown 2600, no utime)
    key = "test.task.key"
    path = os.path.join(file_backend.location, key_to_lock_name(key))
    Path(path).touch()
    then = time.time() - 1000
    os.utime(path, (then, then))
    fds = open_fds()
    with pytest.raises(AlreadyQueued) as caught:
        file_backend.raise_or_lock(key, 3600)
    assert caught.value.countdown == pytest.approx(2600, abs=5)
    assert os.path.getmtime(path) == pytest.approx(then, abs=0.01)  # not touched
    assert open_fds() == fds


def test_file_lock_timeout(file_backend: File) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_lock_timeout (mtime 6000 s ago,
    # timeout 3600: utime(path, None), taken over, None returned)
    key = "test.task.key"
    path = os.path.join(file_backend.location, key_to_lock_name(key))
    Path(path).touch()
    then = time.time() - 6000
    os.utime(path, (then, then))
    assert file_backend.raise_or_lock(key, 3600) is None
    assert os.path.getmtime(path) == pytest.approx(time.time(), abs=5)
    with pytest.raises(AlreadyQueued):  # and it is held again, for the new holder
        file_backend.raise_or_lock(key, 3600)


def test_file_clear_lock(file_backend: File) -> None:
    # upstream: tests/unit/backends/test_file.py::test_file_clear_lock
    key = "test.task.key"
    file_backend.raise_or_lock(key, 3600)
    assert file_backend.clear_lock(key) is None
    assert os.listdir(file_backend.location) == []
    # taskdedup differs: a lock already gone is free (celery-once raised FileNotFoundError)
    assert file_backend.clear_lock(key) is None


# ----------------------------------------------------------------- tests/integration/test_tasks.py
# (eager in upstream, the mock backend tests.backends.TestBackend: here RecordingBackend, in
# every mode where the behaviour applies)


@pytest.fixture
def example(custom_env: Env, log: BackendLog) -> Any:
    @custom_env.task(name="example")
    def example() -> None:
        log.add("run")

    return example


def test_config(example: Any, custom_env: Env) -> None:
    # upstream: tests/integration/test_tasks.py::test_config
    assert example.config is custom_env.app.conf


def test_once_config(example: Any, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_once_config
    assert example.once_config == {
        "backend": BACKEND_PATH,
        "settings": {"default_timeout": 60, "log": log},
    }


def test_default_timeout(example: Any) -> None:
    # upstream: tests/integration/test_tasks.py::test_default_timeout
    assert example.default_timeout == 60


def custom_ran(custom_env: Env, log: BackendLog, result: Any) -> None:
    """The job ran (eager, worker) or waits in the queue (queued)."""
    if custom_env.mode == "queued":
        assert custom_env.queued() == 1
        assert ("run",) not in log.calls
    else:
        custom_env.finished(result)
        wait_for(lambda: ("clear_lock", custom_env.key("example")) in log.calls, WAIT)
        assert ("run",) in log.calls


@pytest.mark.parametrize("mode", ALL_MODES)
def test_apply_async(example: Any, custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_apply_async
    with custom_env.running():
        result = example.apply_async()
        assert log.calls[0] == ("raise_or_lock", custom_env.key("example"), 60)
        # as configured, an int (a backend's SET key v NX EX timeout refuses 60.0)
        assert type(log.calls[0][2]) is int
        custom_ran(custom_env, log, result)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_apply_async_timeout(example: Any, custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_apply_async_timeout
    with custom_env.running():
        result = example.apply_async(once={"timeout": 120})
        assert log.calls[0] == ("raise_or_lock", custom_env.key("example"), 120)
        assert type(log.calls[0][2]) is int
        custom_ran(custom_env, log, result)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_raise_already_queued(example: Any, custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_raise_already_queued
    log.refuse = AlreadyQueued(60)
    with custom_env.running():
        with pytest.raises(AlreadyQueued) as caught:
            example.apply_async()
        assert caught.value.countdown == 60
    assert log.calls == [("raise_or_lock", custom_env.key("example"), 60)]  # it never ran
    assert custom_env.queued() == 0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_raise_already_queued_graceful(example: Any, custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_raise_already_queued_graceful
    log.refuse = AlreadyQueued(60)
    with custom_env.running():
        result = example.apply_async(once={"graceful": True})
        assert result.result is None
        assert result.state == "REJECTED"
    assert log.calls == [("raise_or_lock", custom_env.key("example"), 60)]
    assert custom_env.queued() == 0


@pytest.mark.parametrize("mode", RUN_MODES)
def test_retry(custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_retry (a bound task, keys=[], retrying
    # with other kwargs: the lock is taken once, kept through the retry, cleared at the end)
    @custom_env.task(name="example_retry", once={"keys": []}, bind=True, default_retry_delay=0)
    def example_retry(self: Any, a: int = 0) -> int:
        log.add("run", a)
        if a != 1:
            raise self.retry(kwargs={"a": 1})
        return a

    key = custom_env.key("example_retry")
    with custom_env.running():
        result = example_retry.apply_async()
        wait_for(lambda: ("clear_lock", key) in log.calls, WAIT, "the lock to be cleared")
        assert custom_env.finished(result) == 1
    assert log.calls == [
        ("raise_or_lock", key, 60),
        ("run", 0),
        ("run", 1),  # the retry did not ask for the lock again
        ("clear_lock", key),
    ]


@pytest.mark.parametrize("mode", RUN_MODES)
def test_delay_unlock_before_run(custom_env: Env, log: BackendLog) -> None:
    # upstream: tests/integration/test_tasks.py::test_delay_unlock_before_run (exactly two
    # backend calls, the first after the lock being clear_lock, before the job's end)
    @custom_env.task(name="example_unlock_before_run", once={"unlock_before_run": True})
    def example_unlock_before_run() -> None:
        log.add("run")

    key = custom_env.key("example_unlock_before_run")
    with custom_env.running():
        result = example_unlock_before_run.apply_async()
        custom_env.finished(result)
    assert log.calls == [("raise_or_lock", key, 60), ("clear_lock", key), ("run",)]


# -------------------------------------------------------- tests/integration/backends/test_redis.py
# (eager and fakeredis in upstream: here the real Redis, in every mode)


@pytest.fixture
def redis_example(env: Env) -> Any:
    """upstream's ``example(a=1)``; ``seen`` records, from inside each run, whether the key
    was held and its ttl."""

    @env.task(name="example")
    def example(a: int = 1) -> None:
        key = env.key(f"example_a-{a}")
        example.seen.append((env.held(key), env.pttl(key)))

    example.seen = []
    return example


def accepted_then_freed(env: Env, task: Any, submit: Callable[[], Any], key: str) -> None:
    """upstream's check of an accepted call: the key is held while the job runs and gone
    afterwards (eager, worker); queued: held for the timeout, the message in the queue."""
    with env.running():
        result = submit()
        if env.mode == "queued":
            assert env.held(key) and 55_000 < env.pttl(key) <= 60_000
            assert env.queued() == 1
            assert task.seen == []
            return
        env.finished(result, key)
    assert len(task.seen) == 1
    held, ttl = task.seen[0]
    assert held and ttl > 0
    assert not env.held(key)


def refused(env: Env, task: Any, submit: Callable[[], Any]) -> None:
    with env.running(), pytest.raises(AlreadyQueued):
        submit()
    assert task.seen == []
    assert env.queued() == 0


def test_integration_redis_init(redis_example: Any, redis_url: str) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_init
    details = redis_example.once_backend.redis.connection_pool.connection_kwargs
    expected = parse_url(redis_url)
    assert details["host"] == expected["host"]
    assert details["port"] == expected.get("port", 6379)
    assert details["db"] == expected.get("db", 0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_delay(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_delay
    key = env.key("example_a-1")
    accepted_then_freed(env, redis_example, lambda: redis_example.delay(1), key)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_delay_already_queued(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_delay_already_queued
    key = env.key("example_a-1")
    env.redis.set(key, 10000000000)
    refused(env, redis_example, lambda: redis_example.delay(1))
    assert env.redis.get(key) == b"10000000000"  # the holder's lock is untouched


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_delay_expired(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_delay_expired
    key = env.key("example_a-1")
    assert RedisLock(env.redis, key, timeout=0.3).acquire()
    assert env.redis.get(key) is not None
    wait_for(lambda: not env.held(key), 5, "the lock to expire")
    accepted_then_freed(env, redis_example, lambda: redis_example.delay(1), key)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_apply_async(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_apply_async
    key = env.key("example_a-1")
    accepted_then_freed(env, redis_example, lambda: redis_example.apply_async(args=(1,)), key)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_apply_async_queued(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_apply_async_queued
    env.redis.set(env.key("example_a-1"), 10000000000)
    refused(env, redis_example, lambda: redis_example.apply_async(args=(1,)))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_already_queued_graceful(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_already_queued_graceful
    env.redis.set(env.key("example_a-1"), 10000000000)
    with env.running():
        result = redis_example.apply_async(args=(1,), once={"graceful": True})
    assert result.result is None
    assert redis_example.seen == []
    assert env.queued() == 0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_redis_apply_async_expired(redis_example: Any, env: Env) -> None:
    # upstream: tests/integration/backends/test_redis.py::test_apply_async_expired
    key = env.key("example_a-1")
    assert RedisLock(env.redis, key, timeout=0.3).acquire()
    assert env.redis.get(key) is not None
    wait_for(lambda: not env.held(key), 5, "the lock to expire")
    accepted_then_freed(env, redis_example, lambda: redis_example.apply_async(args=(1,)), key)


# --------------------------------------------------------- tests/integration/backends/test_file.py


@pytest.fixture
def file_env(new_env: Callable[..., Env], tmp_path: Path) -> Env:
    location = str(tmp_path / "celery_once")
    return new_env(
        ONCE={
            "backend": "celery_once.backends.File",
            "settings": {"location": location, "default_timeout": 60 * 60},
        }
    )


@pytest.fixture
def file_example(file_env: Env) -> Any:
    @file_env.task(name="example")
    def example(a: int = 1) -> None:
        example.seen.append(os.path.exists(file_lock_path(file_env, f"example_a-{a}")))

    example.seen = []
    return example


def file_lock_path(env: Env, rest: str) -> str:
    location = env.app.conf.ONCE["settings"]["location"]
    return os.path.join(location, key_to_lock_name(env.key(rest)))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_file_delay(file_example: Any, file_env: Env) -> None:
    # upstream: tests/integration/backends/test_file.py::test_delay (the lock file is there
    # while the job runs, and removed after it; queued: there while the job waits)
    path = file_lock_path(file_env, "example_a-1")
    with file_env.running():
        result = file_example.delay(1)
        if file_env.mode == "queued":
            assert os.path.exists(path)
            assert file_env.queued() == 1
            return
        file_env.finished(result)
        wait_for(lambda: not os.path.exists(path), WAIT, "the lock file to be removed")
    assert file_example.seen == [True]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_integration_file_delay_already_queued(file_example: Any, file_env: Env) -> None:
    # upstream: tests/integration/backends/test_file.py::test_delay_already_queued
    path = file_lock_path(file_env, "example_a-1")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT))
    refused(file_env, file_example, lambda: file_example.delay(1))
    assert os.path.exists(path)


# ------------------------------------------------------- tests/integration/flask_app/test_flask.py
# (a real worker; Flask's app_context() stands as a context of our own, so Flask need not be
# installed: the point is a QueueOnce subclass that wraps __call__)

APP_CONTEXT: contextvars.ContextVar[str | None] = contextvars.ContextVar("app", default=None)


@contextmanager
def app_context() -> Iterator[None]:
    token = APP_CONTEXT.set("flask_app")
    try:
        yield
    finally:
        APP_CONTEXT.reset(token)


def has_app_context() -> bool:
    return APP_CONTEXT.get() is not None


class ContextQueueOnce(QueueOnce):
    """The README's Flask recipe: QueueOnce with ``__call__`` inside the app's context."""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("mode", ["worker"])
def test_flask(env: Env) -> None:
    # upstream: tests/integration/flask_app/test_flask.py::test_flask (delay(1); while it
    # runs a second delay(1) raises AlreadyQueued; once it completed a third is accepted)
    gate = env.gate()
    contexts: list[bool] = []

    @env.task(base=ContextQueueOnce)
    def sleep_task(value: int) -> int:
        contexts.append(has_app_context())
        if len(contexts) == 1:
            gate.enter()
        return value

    key = env.key("sleep_task_value-1")
    with env.running():
        first = sleep_task.delay(1)
        gate.wait_started()
        with pytest.raises(AlreadyQueued):
            sleep_task.delay(1)
        gate.go.set()
        assert env.finished(first, key) == 1
        third = sleep_task.delay(1)
        assert third.id != first.id
        assert env.finished(third, key) == 1
    assert contexts == [True, True]


# ================================================================== 2. the README's behaviours


def test_readme_builtin_backend_paths_need_no_original_package(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, tmp_path: Path
) -> None:
    # README: installing; the drop-in's docstring: "The original package need not be
    # installed" (celery-once's paths mean the drop-in's classes)
    for name in list(sys.modules):
        if name == "celery_once" or name.startswith("celery_once."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "celery_once", None)  # import celery_once fails
    with pytest.raises(ImportError):
        importlib.import_module("celery_once.backends")
    for path in ("celery_once.backends.Redis", "celery_once.backends.redis.Redis"):
        backend = import_backend({"backend": path, "settings": {"url": redis_url}})
        assert type(backend) is Redis
    for path in ("celery_once.backends.File", "celery_once.backends.file.File"):
        backend = import_backend({"backend": path, "settings": {"location": str(tmp_path)}})
        assert type(backend) is File


def test_readme_once_config_lives_in_app_conf(new_env: Callable[..., Env]) -> None:
    # README: tasks use base=QueueOnce and the app sets conf.ONCE = {backend, settings}
    env = new_env(ONCE=None)

    @env.task()
    def job(a: int) -> int:
        return a

    # taskdedup differs: a missing ONCE is a ConfigError naming the task and what to set
    # (celery-once: AttributeError 'Settings' object has no attribute 'ONCE', #56)
    with pytest.raises(ConfigError, match=r"QueueOnce needs app.conf.ONCE"):
        job.delay(1)
    assert env.queued() == 0
    env.app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": env.app.conf.broker_url, "default_timeout": 45},
    }
    job.delay(1)
    assert 40_000 < env.pttl(env.key("job_a-1")) <= 45_000


def test_once_config_under_the_celery_namespace(redis_url: str, key_prefix: str) -> None:
    # Django's way: config_from_object(settings, namespace="CELERY") with CELERY_ONCE
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_TASKDEDUP_KEY_PREFIX = key_prefix
        CELERY_ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_url, "default_timeout": 45},
        }

    app = Celery(key_prefix, set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")

    @app.task(base=QueueOnce, name=f"{key_prefix}.job", shared=False)
    def job(a: int) -> None: ...

    job.delay(1)
    with pytest.raises(AlreadyQueued) as caught:
        job.delay(1)
    assert 40 < caught.value.countdown <= 45
    redis.Redis.from_url(redis_url).delete(job.get_key((1,), {}))


@pytest.mark.parametrize("mode", ["eager", "queued"])
@pytest.mark.parametrize("unlock_before_run", [False, True])
def test_readme_calling_the_task_directly_is_not_affected(
    env: Env, unlock_before_run: bool
) -> None:
    # README: "calling the task directly is not affected": no lock taken, none checked
    @env.task(once={"unlock_before_run": unlock_before_run})
    def job(a: int) -> int:
        return a * 2

    key = env.key("job_a-1")
    assert job(1) == 2
    assert not env.held(key)
    token = foreign_token()
    env.redis.set(key, token, px=60_000)  # held by another job
    assert job(1) == 2  # runs all the same
    # taskdedup differs (unlock_before_run=True): the direct call leaves the other job's
    # lock alone; celery-once's __call__ deleted it
    assert env.redis.get(key) == token.encode()
    assert env.queued() == 0


@pytest.mark.parametrize("mode", RUN_MODES)
@pytest.mark.parametrize("outcome", ["success", "exception"])
def test_readme_lock_cleared_when_the_task_completes_or_raises(env: Env, outcome: str) -> None:
    # README: the lock is checked when queued; the task runs normally; the lock clears when
    # it completes or ends due to an exception
    ran: list[bool] = []

    @env.task()
    def job(a: int) -> int:
        ran.append(env.held(env.key(f"job_a-{a}")))
        if outcome == "exception":
            raise ValueError("boom")
        return a

    key = env.key("job_a-10")
    with env.running():
        result = job.delay(10)
        value = env.finished(result, key)
        assert (result.state, value if outcome == "success" else type(value)) == (
            ("SUCCESS", 10) if outcome == "success" else ("FAILURE", ValueError)
        )
        again = job.delay(10)  # free: accepted
        assert again.id != result.id
        env.finished(again, key)
    assert ran == [True, True]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("call", ["delay", "apply_async"])
def test_readme_a_second_call_before_completion_raises_already_queued(env: Env, call: str) -> None:
    # README: example.delay(10); example.delay(10) before the first completed: AlreadyQueued
    # (eager: the first runs at once, so the second call is made from inside its run)
    gate = env.gate()
    inner: list[Any] = []

    def submit() -> Any:
        return example.delay(10) if call == "delay" else example.apply_async(args=(10,))

    @env.task()
    def example(a: int) -> int:
        if env.mode == "eager":
            try:
                submit()
            except AlreadyQueued as exc:
                inner.append(exc)
        else:
            gate.enter()
        return a

    key = env.key("example_a-10")
    with env.running():
        first = submit()
        if env.mode == "worker":
            gate.wait_started()
        if env.mode != "eager":
            with pytest.raises(AlreadyQueued) as caught:
                submit()
            inner.append(caught.value)
        assert len(inner) == 1
        assert isinstance(inner[0].countdown, float) and 0 < inner[0].countdown <= 60
        assert inner[0].message == f"Expires in {inner[0].countdown} seconds"
        if env.mode != "queued":
            gate.go.set()
            assert env.finished(first, key) == 10
    assert env.queued() == (1 if env.mode == "queued" else 0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_readme_graceful_returns_a_rejected_result_instead_of_raising(env: Env) -> None:
    # README: graceful, in the task's options or passed to apply_async: no AlreadyQueued;
    # (the README says None: it is an EagerResult whose result is None, as celery-once's)
    @env.task(once={"graceful": True})
    def graceful(a: int) -> int:
        return a

    @env.task()
    def plain(a: int) -> int:
        return a

    for task in (graceful, plain):
        env.redis.set(env.key(f"{task.name.rsplit('.', 1)[1]}_a-10"), foreign_token())
    with env.running():
        answers = [
            graceful.delay(10),
            graceful.apply_async(args=(10,)),
            plain.apply_async(args=(10,), once={"graceful": True}),
        ]
        for answer in answers:
            assert type(answer) is EagerResult
            assert (answer.id, answer.result, answer.state) == (None, None, "REJECTED")
            assert answer.get() is None
            assert answer.ready() and not answer.successful() and not answer.failed()
        with pytest.raises(AlreadyQueued):
            plain.delay(10)
        with pytest.raises(AlreadyQueued):  # the call's option wins over the task's
            graceful.apply_async(args=(10,), once={"graceful": False})
    assert env.queued() == 0


@pytest.mark.parametrize(
    ("keys", "first", "same", "other"),
    [
        pytest.param(None, (1, 2), (1, 2), (1, 3), id="default-all-arguments"),
        pytest.param(["a"], (1, 2), (1, 3), (2, 2), id="keys-a"),
        pytest.param([], (1, 2), (5, 6), None, id="keys-empty"),
    ],
)
def test_readme_keys_choose_the_arguments_of_the_lock(
    env: Env, keys: list[str] | None, first: tuple[int, int], same: Any, other: Any
) -> None:
    # README: the lock is the task's name and all its arguments by default;
    # once={'keys': ['a']} locks on a only; once={'keys': []} allows one job whatever the
    # arguments
    once = {} if keys is None else {"keys": keys}

    @env.task(once=once)
    def job(a: int, b: int) -> int:
        return a + b

    job.delay(*first)
    expected = {None: "job_a-1_b-2", "a": "job_a-1", "": "job"}
    assert env.held(env.key(expected[None if keys is None else "".join(keys)]))
    with pytest.raises(AlreadyQueued):
        job.delay(*same)
    if other is not None:
        job.delay(*other)
    assert env.queued() == (1 if other is None else 2)


@pytest.mark.parametrize("mode", ["worker"])
def test_readme_keys_and_timeout_while_a_worker_runs_the_job(env: Env) -> None:
    # README (keys, timeout), with a real worker: the key is the named arguments' while the
    # job runs too; a duplicate is refused, another key accepted; the key is freed at the end.
    # taskdedup differs: while it runs, the key lives on the job's lease, renewed by its
    # worker (test_compat_kill.py), so its ttl is at most the lease, not what is left of
    # the timeout; the countdown says so
    gate = env.gate()

    @env.task(once={"keys": ["a"], "timeout": 120})
    def job(a: int, b: int) -> int:
        if b == 0:
            gate.enter()
        return a + b

    key = env.key("job_a-1")
    with env.running():
        first = job.delay(1, 0)
        gate.wait_started()
        assert env.held(key)
        lease_ms = env.app.conf.get("taskdedup_default_lease", 30) * 1000
        assert 0 < env.pttl(key) <= lease_ms
        with pytest.raises(AlreadyQueued) as caught:
            job.delay(1, 7)  # b is not in the key
        assert 0 < caught.value.countdown <= lease_ms / 1000
        other = job.delay(2, 7)
        gate.go.set()
        assert env.finished(first, key) == 1
        assert env.finished(other, env.key("job_a-2")) == 9


@pytest.mark.parametrize(
    ("settings", "once", "call_once", "ttl_ms"),
    [
        pytest.param({"default_timeout": 60}, {}, None, 60_000, id="settings-default_timeout"),
        pytest.param({}, {}, None, 3_600_000, id="default-60-minutes"),
        pytest.param({"default_timeout": 60}, {"timeout": 5}, None, 5_000, id="task-timeout"),
        pytest.param(
            {"default_timeout": 60}, {"timeout": 5}, {"timeout": 120}, 120_000, id="call-timeout"
        ),
        pytest.param({}, {"timeout": 1.5}, None, 1_500, id="float-timeout"),
        pytest.param({}, {"timeout": 0}, None, -1, id="timeout-0-never-expires"),
        # a timeout given as None is kept, not replaced by default_timeout (celery-once's
        # dict.get with a default; #15's way to a lock without expiry)
        pytest.param({}, {"timeout": None}, None, -1, id="task-timeout-None-never-expires"),
        pytest.param({}, {}, {"timeout": None}, -1, id="call-timeout-None-never-expires"),
    ],
)
def test_readme_timeout_is_the_locks_ttl(
    new_env: Callable[..., Env],
    redis_url: str,
    settings: dict[str, Any],
    once: dict[str, Any],
    call_once: dict[str, Any] | None,
    ttl_ms: int,
) -> None:
    # README: timeout, the fallback clearing of a lock (60 minutes by default), set in the
    # backend's settings (default_timeout), per task (once={'timeout': ...}) or per call
    env = new_env(
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": redis_url, **settings}}
    )

    @env.task(once=once)
    def job(a: int) -> int:
        return a

    options = {} if call_once is None else {"once": call_once}
    job.apply_async((1,), **options)
    key = env.key("job_a-1")
    assert env.held(key)
    if ttl_ms < 0:
        assert env.pttl(key) == -1
    else:
        assert ttl_ms - 1_000 < env.pttl(key) <= ttl_ms
    with pytest.raises(AlreadyQueued) as caught:
        job.apply_async((1,), **options)
    expected = ttl_ms / 1000 if ttl_ms > 0 else -0.001
    assert caught.value.countdown == pytest.approx(expected, abs=1.0)


def test_readme_timeout_frees_the_lock_of_a_job_still_queued(env: Env) -> None:
    # README: the timeout clears a lock that was never cleared (its job waits in the queue)
    @env.task(once={"timeout": 1})
    def job(a: int) -> int:
        return a

    first = job.delay(1)
    key = env.key("job_a-1")
    with pytest.raises(AlreadyQueued):
        job.delay(1)
    wait_for(lambda: not env.held(key), 5, "the lock's timeout")
    second = job.delay(1)
    assert second.id != first.id and not second.deduplicated
    assert env.queued() == 2


@pytest.mark.parametrize("mode", ["worker"])
def test_readme_unlock_before_run_frees_the_lock_as_the_job_starts(env: Env) -> None:
    # README: unlock_before_run=True releases the lock just before the job executes (the
    # default: after it); it can only be set on the task, not in apply_async
    gates = {"early": env.gate(), "late": env.gate()}

    @env.task(once={"unlock_before_run": True})
    def early(a: int) -> int:
        if not gates["early"].started.is_set():
            gates["early"].enter()
        return a

    @env.task()
    def late(a: int) -> int:
        gates["late"].enter()
        return a

    with env.running():
        held = late.apply_async((1,), once={"unlock_before_run": True})  # (ignored per call)
        gates["late"].wait_started()
        assert env.held(env.key("late_a-1"))
        with pytest.raises(AlreadyQueued):
            late.delay(1)
        gates["late"].go.set()
        assert env.finished(held, env.key("late_a-1")) == 1

        running = early.delay(1)
        gates["early"].wait_started()
        assert not env.held(env.key("early_a-1"))
        beside = early.delay(1)  # accepted while the first runs (it runs after it: solo pool)
        assert beside.id != running.id and not beside.deduplicated
        assert env.held(env.key("early_a-1"))  # the second job's, while it waits
        gates["early"].go.set()
        assert [env.finished(r, env.key("early_a-1")) for r in (running, beside)] == [1, 1]


@pytest.mark.parametrize("mode", ["worker"])
def test_readme_unlock_before_run_a_retry_does_not_take_the_lock_again(env: Env) -> None:
    # README's caveat of unlock_before_run: a retry won't re-enable the lock
    @env.task(once={"unlock_before_run": True}, bind=True)
    def job(self: Any, a: int) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=60)
        return a

    with env.running():
        first = job.delay(1)
        wait_for(lambda: first.id in env.scheduled_ids(), WAIT, "the worker to hold the retry")
        assert not env.held(env.key("job_a-1"))
        other = job.delay(1)  # accepted: the retry holds no lock
        assert other.id != first.id and not other.deduplicated


@pytest.mark.parametrize(
    ("blocking", "blocking_timeout", "freed_after", "accepted"),
    [
        pytest.param(True, 0.5, None, False, id="blocking-gives-up-after-blocking_timeout"),
        pytest.param(True, 5, 0.3, True, id="blocking-takes-the-lock-once-freed"),
        pytest.param(True, None, 0.3, True, id="blocking_timeout-None-waits"),
        pytest.param(False, 5, 0.3, False, id="not-blocking-raises-at-once"),
    ],
)
def test_readme_redis_blocking(
    new_env: Callable[..., Env],
    redis_url: str,
    blocking: bool,
    blocking_timeout: float | None,
    freed_after: float | None,
    accepted: bool,
) -> None:
    # README (Redis backend): blocking=True makes scheduling wait up to blocking_timeout
    # seconds (int or float, None: forever) for the lock, then raise AlreadyQueued; the
    # default, blocking=False, raises at once
    settings = {"url": redis_url, "blocking": blocking, "blocking_timeout": blocking_timeout}
    env = new_env(ONCE={"backend": "celery_once.backends.Redis", "settings": settings})

    @env.task()
    def job(a: int) -> int:
        return a

    key = env.key("job_a-1")
    token = foreign_token()
    env.redis.set(key, token, px=60_000)
    if freed_after is not None:

        def free() -> None:
            time.sleep(freed_after)  # (the other holder ends a while later)
            env.redis.delete(key)

        threading.Thread(target=free, daemon=True).start()
    began = time.monotonic()
    if accepted:
        job.delay(1)
        assert env.redis.get(key) not in (None, token.encode())
        assert time.monotonic() - began >= freed_after * 0.9  # type: ignore[operator]
    else:
        with pytest.raises(AlreadyQueued):
            job.delay(1)
        waited = time.monotonic() - began
        if blocking:
            assert 0.3 <= waited < 2.0
        else:
            assert waited < 0.25
    assert env.queued() == (1 if accepted else 0)


def test_readme_redis_url_options_reach_the_client(
    new_env: Callable[..., Env], redis_url: str
) -> None:
    # README: redis://host:port[/db][?options]: options become StrictRedis arguments
    db = parse_url(redis_url).get("db", 0)
    base = redis_url.split("?")[0].rstrip("/").rsplit("/", 1)
    root = base[0] if base[1].isdigit() else "/".join(base)
    url = f"{root}?db={db}&socket_timeout=7"
    env = new_env(ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url}})

    @env.task()
    def job(a: int) -> int:
        return a

    kwargs = job.once_backend.redis.connection_pool.connection_kwargs
    assert (kwargs["db"], kwargs["socket_timeout"]) == (db, 7.0)
    job.delay(1)
    assert env.held(env.key("job_a-1"))  # in the same database


@pytest.mark.parametrize("age", [10, 120])
def test_readme_file_backend_default_timeout(file_example: Any, file_env: Env, age: int) -> None:
    # README (File backend): location and default_timeout; a lock file older than the
    # timeout is stale and taken over, a younger one refuses with its remaining seconds
    file_env.app.conf.ONCE["settings"]["default_timeout"] = 60
    path = file_lock_path(file_env, "example_a-1")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).touch()
    then = time.time() - age
    os.utime(path, (then, then))
    if age < 60:
        with pytest.raises(AlreadyQueued) as caught:
            file_example.delay(1)
        assert caught.value.countdown == pytest.approx(60 - age, abs=2)
        assert file_env.queued() == 0
    else:
        file_example.delay(1)
        assert os.path.getmtime(path) == pytest.approx(time.time(), abs=5)
        assert file_env.queued() == 1


@pytest.mark.parametrize("mode", RUN_MODES)
def test_readme_custom_backend_clear_lock_after_failing_beyond_the_retry_limit(
    custom_env: Env, log: BackendLog
) -> None:
    # README (custom backends): clear_lock is called after completion "or fails beyond
    # celery's retry limit", not on each retry
    @custom_env.task(bind=True, max_retries=1, default_retry_delay=0)
    def flaky(self: Any, a: int) -> None:
        log.add("run", self.request.retries)
        raise self.retry(exc=ValueError("flaky"))

    key = custom_env.key("flaky_a-1")
    with custom_env.running():
        result = flaky.delay(1)
        wait_for(lambda: ("clear_lock", key) in log.calls, WAIT, "the lock to be cleared")
        assert isinstance(custom_env.finished(result), ValueError)
    assert log.calls == [("raise_or_lock", key, 60), ("run", 0), ("run", 1), ("clear_lock", key)]


@pytest.mark.parametrize("mode", ["worker"])
def test_readme_history_a_retried_job_keeps_its_lock_between_attempts(env: Env) -> None:
    # HISTORY 1.0.2 and 1.3.0: self.retry() and autoretry_for keep the lock (the retry does
    # not check it, so it is not refused by its own lock); the last attempt clears it
    gate = env.gate()
    attempts: list[int] = []

    @env.task(bind=True, autoretry_for=(ValueError,), max_retries=3, default_retry_delay=0)
    def job(self: Any, a: int) -> int:
        attempts.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=1)  # self.retry()
        if self.request.retries == 1:
            raise ValueError("again")  # autoretry_for (retry_backoff off: at once)
        gate.enter()
        return a

    key = env.key("job_a-1")
    with env.running():
        result = job.delay(1)
        gaps: list[bool] = []
        while not gate.started.is_set():  # from the first attempt to the third
            gaps.append(env.held(key))
            assert len(gaps) < WAIT / 0.02, "the third attempt never started"
            time.sleep(0.02)
        assert all(gaps) and len(gaps) > 10
        with pytest.raises(AlreadyQueued):
            job.delay(1)
        gate.go.set()
        assert env.finished(result, key) == 1
    assert attempts == [0, 1, 2]


def test_readme_history_key_uses_the_signature_of_the_task_as_defined(env: Env) -> None:
    # HISTORY 3.0.1 (#105): the signature is captured when the task is created, so a
    # wrapper put on run later (Sentry's, then without functools.wraps) does not change
    # the key
    @env.task()
    def job(a: int, b: int = 2) -> int:
        return a + b

    original_run = job.run

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return original_run(*args, **kwargs)

    job.run = wrapper
    assert job.get_key(args=(1,)) == env.key("job_a-1")
    job.delay(1)
    assert env.held(env.key("job_a-1"))


def test_key_format_keeps_celery_once_3_0_1_quirks(env: Env) -> None:
    # the key, byte for byte celery-once 3.0.1's (section 2.1): defaults are not bound, so
    # f(1) and f(1, 2) are two keys; a `keys` entry the call leaves out is a KeyError (#143);
    # *args and **kwargs appear under their names
    @env.task(once={"keys": ["b"]})
    def picky(a: int, b: int = 2) -> int:
        return a + b

    @env.task()
    def job(a: int, b: int = 2, *args: Any, **kw: Any) -> int:
        return a + b

    job.delay(1)
    job.delay(1, 2)
    job.delay(1, 2, 3, 4, z=1, y=[1, {"b": 1, "a": 2}])
    assert {k.decode() for k in env.redis.scan_iter(match=f"qo_{env.prefix}.job*")} == {
        env.key("job_a-1"),
        env.key("job_a-1_b-2"),
        env.key("job_a-1_args-(3, 4)_b-2_kw-{'y': [1, \"{'a': 2, 'b': 1}\"], 'z': 1}"),
    }
    with pytest.raises(KeyError):
        picky.delay(1)
    with pytest.raises(TypeError, match="missing a required argument"):
        job.delay()
    assert env.queued() == 3


def test_already_queued_is_celery_onces_exception() -> None:
    # section 1.2: AlreadyQueued(countdown): .countdown, .message, str(), pickles
    exc = AlreadyQueued(49.999)
    assert isinstance(exc, Exception)
    assert (exc.countdown, exc.message, str(exc), exc.args) == (
        49.999,
        "Expires in 49.999 seconds",
        "49.999",
        (49.999,),
    )
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), back.countdown, back.message) == (AlreadyQueued, 49.999, exc.message)


# ================================================================== 3. where taskdedup differs


@pytest.mark.parametrize("mode", ["worker"])
def test_differs_lock_kept_while_a_job_runs_longer_than_its_timeout(
    new_env: Callable[..., Env],
) -> None:
    # taskdedup differs: celery-once's lock expires after `timeout` even while its job runs
    # (#36), and a second job starts beside it; the drop-in keeps it on the job's lease,
    # renewed while the job runs (lease 1 s here, timeout 1 s)
    env = new_env(taskdedup_default_lease=1)
    gate = env.gate()

    @env.task(once={"timeout": 1})
    def long_job(a: int) -> int:
        gate.enter()
        return a

    key = env.key("long_job_a-1")
    with env.running():
        first = long_job.delay(1)
        gate.wait_started()
        began = time.monotonic()
        while time.monotonic() - began < 2.5:  # over twice the timeout and the lease
            assert env.held(key), "the running job's lock expired"
            time.sleep(0.05)
        with pytest.raises(AlreadyQueued):
            long_job.delay(1)
        gate.go.set()
        assert env.finished(first, key) == 1


@pytest.mark.parametrize("mode", ["worker"])
def test_differs_revoking_a_job_the_worker_holds_frees_its_key(env: Env) -> None:
    # taskdedup differs: a revoked job frees its key (celery-once kept it for the timeout)
    ran: list[int] = []

    @env.task()
    def report(a: int) -> int:
        ran.append(a)
        return a

    key = env.key("report_a-1")
    with env.running():
        job = report.apply_async((1,), countdown=120)
        wait_for(lambda: job.id in env.scheduled_ids(), WAIT, "the worker to hold the job")
        with pytest.raises(AlreadyQueued):
            report.delay(1)
        wait_for(
            lambda: env.app.control.revoke(
                job.id, destination=[env.hostname], reply=True, limit=1, timeout=2
            ),
            WAIT,
            "the worker to answer the revoke",
        )
        wait_for(lambda: not env.held(key), 10, "the revoked job's key to be freed")
        fresh = report.delay(1)
        assert env.finished(fresh, key) == 1
    assert ran == [1]  # the fresh job only


@pytest.mark.parametrize("mode", ["queued"])
def test_differs_an_expired_job_frees_its_key(env: Env) -> None:
    # taskdedup differs: a job discarded because its `expires` passed frees its key
    ran: list[int] = []

    @env.task()
    def report(a: int) -> int:
        ran.append(a)
        return a

    key = env.key("report_a-1")
    job = report.apply_async((1,), expires=0.5)
    deadline = time.monotonic() + 0.6
    with pytest.raises(AlreadyQueued):
        report.delay(1)
    wait_for(lambda: time.monotonic() > deadline, 5, "the job to expire")
    with env.worker():  # a worker receives it now, and discards it
        wait_for(lambda: not env.held(key), 10, "the expired job's key to be freed")
        assert job.state == "REVOKED"
    assert ran == []


@pytest.mark.parametrize("mode", ["worker"])
@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        pytest.param((1, 2), "(1, 2)", id="tuple-becomes-list"),
        pytest.param({1: "x"}, "{1: 'x'}", id="int-dict-key-becomes-str"),
    ],
)
def test_differs_key_freed_when_json_changed_the_arguments(
    env: Env, value: Any, rendered: str
) -> None:
    # taskdedup differs: celery-once recomputed the key on the worker from the JSON-decoded
    # arguments ([1, 2], {'1': 'x'}), so it deleted another key and left the lock stuck
    # until its timeout; the drop-in frees the key the producer took
    received: list[Any] = []

    @env.task()
    def pair(a: Any) -> None:
        received.append(a)

    key = env.key(f"pair_a-{rendered}")
    with env.running():
        result = pair.delay(value)
        assert env.held(key)
        env.finished(result, key)
    assert received and received[0] != value  # JSON did change it
    assert not env.held(key)


class Opaque:
    """An argument JSON cannot encode, whose key is ``opaque``."""

    def __str__(self) -> str:
        return "opaque"


def test_differs_a_failed_publish_gives_the_lock_back(env: Env) -> None:
    # taskdedup differs: celery-once took the lock, the publish failed, and the lock stayed
    # until its timeout with no job to clear it; the drop-in gives it back (its own lock too)
    @env.task()
    def job(a: Any) -> Any:
        return a

    key = env.key("job_a-opaque")
    for _ in range(2):  # the second attempt is not refused by the first's lock
        with pytest.raises(EncodeError):
            job.delay(Opaque())
        assert not env.held(key)
    result = job.delay("opaque")  # the same key, now encodable: accepted
    assert not result.deduplicated
    assert env.held(key)
    assert env.queued() == 1


def test_differs_a_publish_to_a_broker_that_is_down_gives_the_lock_back(
    new_env: Callable[..., Env], redis_url: str
) -> None:
    # taskdedup differs (README: "a publish that fails (broker down)"): the broker refuses the
    # connection; celery-once's key stayed taken for its timeout, the drop-in's is given back
    env = new_env(taskdedup_url=redis_url, broker_connection_timeout=1)
    env.app.conf.broker_url = "redis://127.0.0.1:1/0"  # nothing listens there

    @env.task()
    def job(a: int) -> int:
        return a

    key = env.key("job_a-1")
    for _ in range(2):  # the second attempt meets no lock of the first
        with pytest.raises(OperationalError, match="Connection refused"):  # not AlreadyQueued
            job.apply_async((1,), retry=False)
        assert not env.held(key)


@pytest.mark.parametrize("holder", ["old-producer", "queued-job"])
def test_differs_apply_does_not_delete_another_jobs_lock(env: Env, holder: str) -> None:
    # taskdedup differs: celery-once's task.apply() took no lock but ran after_return, which
    # deleted the lock of whichever job held the key. The drop-in's runs the body here and
    # now, as celery-once's does, and frees nothing it did not take
    ran: list[int] = []

    @env.task()
    def job(a: int) -> int:
        ran.append(a)
        return a

    key = env.key("job_a-1")
    if holder == "old-producer":
        env.redis.set(key, foreign_token(), px=60_000)
    else:
        job.delay(1)
    value = env.redis.get(key)
    result = job.apply((1,))
    assert result.get() == 1 and ran == [1]  # it ran, locally
    assert env.redis.get(key) == value
    with pytest.raises(AlreadyQueued):
        job.delay(1)
    assert env.queued() == (0 if holder == "old-producer" else 1)


def test_differs_once_option_is_not_sent_as_a_message_property(env: Env) -> None:
    # taskdedup differs: celery-once passed `once` on to kombu, so each message carried it
    # as a property; the drop-in reads it (here: the timeout) and sends nothing of it
    @env.task()
    def job(a: int) -> int:
        return a

    job.apply_async((1,), once={"timeout": 30, "graceful": True})
    assert 25_000 < env.pttl(env.key("job_a-1")) <= 30_000  # read
    raw = env.redis.lindex(f"{env.prefix}:kombu:{env.prefix}-q", 0)
    message = json.loads(raw)
    assert "once" not in message["properties"]
    assert "once" not in message["headers"]
    assert message["headers"]["task"] == job.name  # (the message is this job's)


@pytest.mark.parametrize("mode", ["eager"])
def test_eager_retry_keeps_the_lock_until_the_last_attempt(env: Env) -> None:
    # section 3.4: eager mode, self.retry(): the retry is applied at once, without a check of
    # the lock, which is kept through it and cleared by the last attempt (both locks: the
    # next call of the key is accepted)
    attempts: list[tuple[int, bool]] = []
    key = env.key("job_a-1")

    @env.task(bind=True, default_retry_delay=0)
    def job(self: Any, a: int) -> int:
        attempts.append((self.request.retries, env.held(key)))
        if self.request.retries == 0:
            raise self.retry()
        return a

    job.delay(1)
    assert sorted(attempts) == [(0, True), (1, True)]
    assert not env.held(key)
    job.delay(1)  # free again


@pytest.mark.parametrize("mode", ["worker"])
def test_differs_a_job_whose_key_expired_never_frees_the_newer_jobs_key(env: Env) -> None:
    # taskdedup differs (README, "freeing the key"): celery-once's DEL freed whichever job
    # held the key. Job A waits in the queue past its timeout, job B takes the key; A runs
    # and ends: B's key stays, so while B runs an old producer (celery-once itself) is
    # still refused
    gates = {"a": env.gate(), "b": env.gate()}

    @env.task(once={"timeout": 1, "keys": ["a"]})
    def job(a: int, who: str) -> str:
        gates[who].enter()
        return who

    key = env.key("job_a-1")
    first = job.delay(1, "a")
    wait_for(lambda: not env.held(key), 5, "A's key to expire while A waits")
    second = job.delay(1, "b")
    assert env.redis.get(key) == second.id.encode()
    with env.running():
        gates["a"].wait_started()
        assert env.redis.get(key) == second.id.encode()  # A did not take B's key over
        gates["a"].go.set()
        assert first.get(timeout=WAIT) == "a"
        gates["b"].wait_started()
        assert env.redis.get(key) == second.id.encode()  # A's end left it; B runs under it
        assert not env.redis.set(key, foreign_token(), nx=True, px=60_000)  # an old producer
        gates["b"].go.set()
        assert env.finished(second, key) == "b"
