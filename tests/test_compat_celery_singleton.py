"""The drop-in ``taskdedup.compat.celery_singleton`` against celery-singleton's behaviour.

Spec: docs/research/celery-singleton.md. Four parts:

1. the 45 upstream test functions (tests/test_backends.py 10, tests/test_config.py 13,
   tests/test_singleton.py 22), each rewritten as a test of the drop-in (``# upstream:``);
   where upstream counted calls of a mocked ``util.generate_lock``, these tests read the exact
   Redis key instead (computed here by hand with ``hashlib.md5``), while the job is queued or
   running, and check it is gone after;
2. every behaviour of the README's checklist (``# README:``);
3. the three modes: eager (``task_always_eager``), queued with no worker, and a real
   in-process worker (the ``mode`` fixture), wherever a behaviour applies in them;
4. where taskdedup deliberately differs from celery-singleton (``# differs:``).

Every key is under the test's ``key_prefix`` (task names, queue, broker, results, taskdedup's
locks and ``singleton_key_prefix``), so the fixture's cleanup removes them; the tests that
need the default prefix ``SINGLETONLOCK_`` or another database delete exactly what they wrote.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import queue
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import celery
import pytest
import redis
from celery import Celery, current_task, signals
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

from harness import race, wait_for
from taskdedup.compat import celery_singleton as cs
from taskdedup.compat.celery_singleton import (
    BaseBackend,
    CelerySingletonException,
    Config,
    DuplicateTaskError,
    RedisBackend,
    Singleton,
    clear_locks,
    generate_lock,
    get_backend,
)
from taskdedup.errors import ConfigError

MODES = ["eager", "queued", "worker"]
ENDING_MODES = ["eager", "worker"]  # the modes in which a job ends
ENCODERS = ["class", "dotted path"]
WAIT = 20.0  # seconds: the deadline of every poll (generous for a busy 2-core machine)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def make_app(redis_url: str, key_prefix: str) -> Callable[..., Celery]:
    """A Celery app whose every key is under ``key_prefix``; ``broker``, ``backend`` and any
    setting can be overridden (a setting given as None is left unset)."""

    def make(broker: Any = redis_url, backend: Any = redis_url, **conf: Any) -> Celery:
        app = Celery(key_prefix, broker=broker, backend=backend, set_as_current=False)
        settings = {
            "broker_transport_options": {"global_keyprefix": f"{key_prefix}:kombu:"},
            "result_backend_transport_options": {"global_keyprefix": f"{key_prefix}:result:"},
            "task_default_queue": f"{key_prefix}-q",
            "worker_hijack_root_logger": False,
            "broker_connection_retry_on_startup": True,
            "taskdedup_key_prefix": key_prefix,
            "singleton_key_prefix": f"{key_prefix}:SL_",
        }
        settings.update(conf)
        app.conf.update({k: v for k, v in settings.items() if v is not None})
        return app

    return make


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()


@pytest.fixture
def sl(key_prefix: str) -> str:
    """The test's ``singleton_key_prefix``."""
    return f"{key_prefix}:SL_"


def md5_key(prefix: str, text: str) -> str:
    """celery-singleton's key, by hand: ``prefix + md5(name + json(args) + json(kwargs))``."""
    return prefix + hashlib.md5(text.encode()).hexdigest()


def locks(r: redis.Redis, prefix: str) -> dict[str, str]:
    """The celery-singleton keys under ``prefix`` and the task ids they hold."""
    return {k: r.get(k) for k in r.scan_iter(match=prefix + "*", count=1000)}


def queue_length(r: redis.Redis, key_prefix: str) -> int:
    return int(r.llen(f"{key_prefix}:kombu:{key_prefix}-q"))


@contextmanager
def worker(app: Celery, **options: Any) -> Iterator[Any]:
    with start_worker(app, pool="solo", perform_ping_check=False, **options) as w:
        yield w


def other_db_url(redis_url: str) -> str:
    """``redis_url`` with another database number (1, or 2 if it is 1)."""
    parts = urlsplit(redis_url)
    current = (parts.path or "/0").strip("/") or "0"
    return parts._replace(path="/2" if current == "1" else "/1").geturl()


@contextmanager
def other_db(redis_url: str, key_prefix: str) -> Iterator[tuple[str, redis.Redis]]:
    """Another database of the same server; the test's keys in it are deleted afterwards."""
    if not redis_url.startswith("redis://"):
        pytest.skip("needs a redis:// URL")
    url = other_db_url(redis_url)
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        yield url, client
    finally:
        for key in client.scan_iter(match=f"{key_prefix}*", count=1000):
            client.unlink(key)
        client.close()


class Mode:
    """Runs a job in one of the three modes, and a check while the job is held.

    A task body calls :meth:`running` first. ``run(submit, check)``: ``submit()`` sends the
    first job and ``check(first_id)`` runs while that job holds its lock: eager, inside its body
    (so the check's calls are nested, as in an eager run they must be); queued, while it waits
    in the queue (no worker ever runs it); worker, while it is queued and again while an
    in-process worker runs it (its body waits for the check). ``then(first)`` runs after the
    job ended (eager, worker), with the worker still up.
    """

    def __init__(self, name: str, app: Celery) -> None:
        self.name = name
        self.app = app
        if name == "eager":
            app.conf.task_always_eager = True
        self.started = threading.Event()
        self.go = threading.Event()
        self._check: Callable[[str], Any] | None = None
        self.checks = 0

    def __repr__(self) -> str:
        return self.name

    def running(self) -> None:
        if self.name == "eager":
            check, self._check = self._check, None  # once: a nested run does not check again
            if check is not None:
                check(current_task.request.id)
                self.checks += 1
        elif self.name == "worker":
            self.started.set()
            assert self.go.wait(WAIT), "the test never let the job go on"

    def run(
        self,
        submit: Callable[[], Any],
        check: Callable[[str], Any],
        then: Callable[[Any], Any] | None = None,
        fails: bool = False,
    ) -> Any:
        if self.name == "eager":
            self._check = check
            first = submit()
            self._end(first, fails)  # raises what the check raised inside the body
            assert self.checks == 1, "the check did not run inside the eager job"
            if then is not None:
                then(first)
            return first
        first = submit()
        check(first.id)  # queued
        self.checks += 1
        if self.name == "queued":
            return first
        try:
            with worker(self.app):
                wait_for(self.started.is_set, WAIT, "the worker to start the job")
                check(first.id)  # running
                self.checks += 1
                self.go.set()
                self._end(first, fails)
                if then is not None:
                    then(first)
        finally:
            self.go.set()
        assert self.checks == 2
        return first

    @staticmethod
    def _end(first: Any, fails: bool) -> None:
        """Wait for the job's end; one meant to fail may raise anything but an assertion."""
        if not fails:
            first.get(timeout=WAIT)
            return
        outcome = first.get(timeout=WAIT, propagate=False)
        if isinstance(outcome, AssertionError):
            raise outcome

    def run_all(self, submits: list[Callable[[], Any]]) -> list[Any]:
        """Send every job; eager and worker: wait for each to end (worker: then stop it)."""
        self.go.set()
        results = [submit() for submit in submits]
        if self.name == "worker":
            with worker(self.app):
                for result in results:
                    result.get(timeout=WAIT)
        elif self.name == "eager":
            for result in results:
                result.get(timeout=WAIT)
        return results


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, app: Celery) -> Mode:
    return Mode(request.param, app)


def gone_after_end(mode: Mode, r: redis.Redis, prefix: str, key: str, first_id: str) -> None:
    """After the job: no key (eager, worker), or its key still held (queued)."""
    if mode.name == "queued":
        assert locks(r, prefix) == {key: first_id}
        assert r.ttl(key) == -1  # no lock_expiry: never expires
    else:
        wait_for(lambda: locks(r, prefix) == {}, WAIT, "the key to be released")


class UUIDEncoder(json.JSONEncoder):
    """The README's example of ``singleton_json_encoder_class``: a UUID as its string."""

    def default(self, o: Any) -> Any:
        if isinstance(o, uuid.UUID):
            return str(o)
        return super().default(o)


def encoder_setting(form: str) -> Any:
    return UUIDEncoder if form == "class" else f"{__name__}.UUIDEncoder"


class Boom(Exception):
    """A failing publish."""


# ================================================================ 1. upstream: test_backends.py


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    b = RedisBackend(redis_url)
    try:
        yield b
    finally:
        b.redis.close()


def test_backend_new_lock_is_set(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestLock::test__new_lock__is_set
    backend.lock(f"{key_prefix}:lock", "test_task_id")
    assert backend.redis.get(f"{key_prefix}:lock") == "test_task_id"


def test_backend_new_lock_returns_true(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestLock::test__new_lock__returns_true
    assert backend.lock(f"{key_prefix}:lock", "test_task_id") is True


def test_backend_lock_exists_is_not_set(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestLock::test__lock_exists__is_not_set
    backend.lock(f"{key_prefix}:lock", "first_id")
    backend.lock(f"{key_prefix}:lock", "second_id")
    assert backend.redis.get(f"{key_prefix}:lock") == "first_id"


def test_backend_lock_exists_returns_false(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestLock::test__lock_exists__returns_false
    backend.lock(f"{key_prefix}:lock", "first_id")
    assert backend.lock(f"{key_prefix}:lock", "second_id") is False


def test_backend_unlock_deletes_key(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestUnlock::test__unlock__deletes_key
    backend.lock(f"{key_prefix}:lock", "test_task_id")
    backend.unlock(f"{key_prefix}:lock")
    assert backend.redis.get(f"{key_prefix}:lock") is None


def test_backend_clear_locks_all_gone(backend: RedisBackend, key_prefix: str) -> None:
    # upstream: tests/test_backends.py::TestClear::test__clear_locks__all_gone
    prefix = f"{key_prefix}:SINGLETON_TEST_KEY_PREFIX_"
    keys = [f"{prefix}{i}" for i in range(10)]
    for i, key in enumerate(keys):
        assert backend.lock(key, f"id{i}")
    backend.redis.set(f"{key_prefix}:other", "kept")  # not under the prefix (spec 1.4)
    backend.clear(prefix)
    assert [backend.get(key) for key in keys] == [None] * 10
    assert backend.redis.get(f"{key_prefix}:other") == "kept"


class FakeBackend(BaseBackend):
    """A backend that keeps what it was built with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def lock(self, lock: str, task_id: str, expiry: Any = None) -> bool:
        return True

    def unlock(self, lock: str) -> None: ...

    def get(self, lock: str) -> Any:
        return None

    def clear(self, key_prefix: str) -> None: ...


@pytest.fixture
def fake_config(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    monkeypatch.setattr(cs, "_BACKENDS", {})  # (upstream resets backends._backend = None)
    return types.SimpleNamespace(
        backend_class=FakeBackend,
        backend_url="redis://fake_url",
        backend_kwargs={"a": 1, "b": "two"},
    )


def test_get_backend_correct_class(fake_config: Any) -> None:
    # upstream: tests/test_backends.py::TestGetBackend::test__correct_class
    assert isinstance(get_backend(fake_config), FakeBackend)


def test_get_backend_receives_kwargs(fake_config: Any) -> None:
    # upstream: tests/test_backends.py::TestGetBackend::test__receives_kwargs
    assert get_backend(fake_config).kwargs == {"a": 1, "b": "two"}


def test_get_backend_receives_url_as_first_arg(fake_config: Any) -> None:
    # upstream: tests/test_backends.py::TestGetBackend::test__receives_url_as_first_arg
    assert get_backend(fake_config).args == ("redis://fake_url",)


def test_get_backend_twice_returns_same_instance(fake_config: Any) -> None:
    # upstream: tests/test_backends.py::TestGetBackend::test__get_backend_twice_returns_same_instance  # noqa: E501
    assert get_backend(fake_config) is get_backend(fake_config)


# ================================================================ 1. upstream: test_config.py


def config_of(**conf: Any) -> Config:
    """``Config`` of an app with these settings (no broker or store is contacted)."""
    app = Celery("config_test", set_as_current=False)
    app.conf.update(conf)
    return Config(app)


def test_config_backend_url_defaults_to_celery_backend_url() -> None:
    # upstream: tests/test_config.py::TestBackendUrl::test__defaults_to_celery_backend_url
    config = config_of(result_backend="redis://test_backend_url", broker_url="redis://broker")
    assert config.backend_url == "redis://test_backend_url"


def test_config_backend_url_defaults_to_celery_broker_url() -> None:
    # upstream: tests/test_config.py::TestBackendUrl::test__defaults_to_celery_broker_url
    assert config_of(broker_url="redis://test_broker_url").backend_url == "redis://test_broker_url"


def test_config_backend_url_override_url() -> None:
    # upstream: tests/test_config.py::TestBackendUrl::test__override_url
    config = config_of(
        result_backend="redis://test_backend_url",
        broker_url="redis://test_broker_url",
        singleton_backend_url="redis://override_url",
    )
    assert config.backend_url == "redis://override_url"


def test_config_default_backend_class_is_redis_backend() -> None:
    # upstream: tests/test_config.py::TestBackend::test__default_backend_class__redis_backend
    assert config_of().backend_class is RedisBackend
    # the original's own dotted path names the drop-in's class (it need not be installed)
    path = "celery_singleton.backends.redis.RedisBackend"
    assert config_of(singleton_backend_class=path).backend_class is RedisBackend


def test_config_backend_class_from_string_returns_class(monkeypatch: pytest.MonkeyPatch) -> None:
    # upstream: tests/test_config.py::TestBackend::test__override_from_string__returns_class
    module = types.ModuleType("singleton_backends.fake")
    module.FakeBackend = FakeBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "singleton_backends.fake", module)
    config = config_of(singleton_backend_class="singleton_backends.fake.FakeBackend")
    assert config.backend_class is FakeBackend


def test_config_backend_class_from_class_returns_class() -> None:
    # upstream: tests/test_config.py::TestBackend::test__override_from_class__returns_class
    assert config_of(singleton_backend_class=FakeBackend).backend_class is FakeBackend


def test_config_default_key_prefix() -> None:
    # upstream: tests/test_config.py::TestKeyPrefix::test__default_key_prefix
    assert config_of().key_prefix == "SINGLETONLOCK_"


def test_config_override_key_prefix() -> None:
    # upstream: tests/test_config.py::TestKeyPrefix::test__override_key_prefix
    assert config_of(singleton_key_prefix="CUSTOM_KEY_PREFIX").key_prefix == "CUSTOM_KEY_PREFIX"


def test_config_an_empty_key_prefix_is_kept() -> None:
    # the original's conf.get(name, default) keeps "": in a rolling deploy both sides must
    # write the same keys
    assert config_of(singleton_key_prefix="").key_prefix == ""


def test_config_backend_url_under_the_celery_namespace() -> None:
    # README: CELERY_SINGLETON_BACKEND_URL with config_from_object(..., namespace="CELERY")
    class Settings:
        CELERY_BROKER_URL = "redis://broker.example:6379/0"
        CELERY_SINGLETON_BACKEND_URL = "redis://locks.example:6379/3"

    app = Celery("namespace_test", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    assert Config(app).backend_url == "redis://locks.example:6379/3"


def test_config_raise_on_duplicate_true_is_true() -> None:
    # upstream: tests/test_config.py::TestRaiseOnDuplicate::test__true_is_true
    assert config_of(singleton_raise_on_duplicate=True).raise_on_duplicate is True


def test_config_raise_on_duplicate_false_is_false() -> None:
    # upstream: tests/test_config.py::TestRaiseOnDuplicate::test__false_is_false
    assert config_of(singleton_raise_on_duplicate=False).raise_on_duplicate is False


def test_config_raise_on_duplicate_default_is_none() -> None:
    # upstream: tests/test_config.py::TestRaiseOnDuplicate::test__default_is_none
    assert config_of().raise_on_duplicate is None


def test_config_lock_expiry_has_config_value() -> None:
    # upstream: tests/test_config.py::TestTaskExpiry::test__has_config_value
    assert config_of(singleton_lock_expiry=60).lock_expiry == 60


def test_config_lock_expiry_default_is_none() -> None:
    # upstream: tests/test_config.py::TestTaskExpiry::test__default_is_none
    assert config_of().lock_expiry is None


# ================================================================ 1. upstream: test_singleton.py


def test_queue_duplicates_same_id(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__queue_duplicates__same_id
    # README: at most one job of a name and arguments is queued or running; delay() returns
    # an AsyncResult, the new job's or the one already queued or running (no exception)
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        mode.running()
        return args

    key = md5_key(sl, f"{key_prefix}.simple_task[1, 2, 3]{{}}")

    def check(first_id: str) -> None:
        duplicates = [simple_task.apply_async(args=[1, 2, 3]) for _ in range(10)]
        assert {d.id for d in duplicates} == {first_id}
        assert all(isinstance(d, AsyncResult) for d in duplicates)
        assert locks(r, sl) == {key: first_id}
        if mode.name != "eager":  # the first job's message only (none once a worker has it)
            assert queue_length(r, key_prefix) == (0 if mode.started.is_set() else 1)

    first = mode.run(lambda: simple_task.apply_async(args=[1, 2, 3]), check)
    gone_after_end(mode, r, sl, key, first.id)


def test_queue_multiple_uniques_different_ids(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__queue_multiple_uniques__different_ids
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        mode.running()
        return list(args)

    arg_lists = [[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7]]
    results = mode.run_all([lambda a=a: simple_task.apply_async(args=a) for a in arg_lists])
    assert len({res.id for res in results}) == 5
    if mode.name == "queued":
        assert locks(r, sl) == {
            md5_key(sl, f"{key_prefix}.simple_task{json.dumps(a)}{{}}"): res.id
            for a, res in zip(arg_lists, results, strict=True)
        }
        assert queue_length(r, key_prefix) == 5
    else:
        assert [res.get(timeout=WAIT) for res in results] == arg_lists
        wait_for(lambda: locks(r, sl) == {}, WAIT, "every key to be released")


@pytest.mark.parametrize("mode", ENDING_MODES, indirect=True)
def test_queue_duplicate_after_success_different_ids(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__queue_duplicate_after_success__different_ids  # noqa: E501
    # README: the lock is released when the task finishes (on_success): after a.get(), the
    # same call spawns a new task (a != d)
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        mode.running()
        return list(args)

    def then(first: Any) -> None:
        assert first.get(timeout=WAIT) == [1, 2, 3]
        wait_for(lambda: locks(r, sl) == {}, WAIT, "the key to be released")
        again = simple_task.apply_async(args=[1, 2, 3])
        assert again.id != first.id
        assert again.get(timeout=WAIT) == [1, 2, 3]

    def check(first_id: str) -> None:
        assert simple_task.apply_async(args=[1, 2, 3]).id == first_id

    mode.run(lambda: simple_task.apply_async(args=[1, 2, 3]), check, then)
    wait_for(lambda: locks(r, sl) == {}, WAIT, "the second key to be released")


@pytest.mark.parametrize("mode", ENDING_MODES, indirect=True)
def test_queue_duplicate_after_error_different_ids(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__queue_duplicate_after_error__different_ids  # noqa: E501
    # README: ... or on_failure
    @app.task(base=Singleton, name=f"{key_prefix}.fail_task", shared=False)
    def fail_task(*args: Any) -> Any:
        mode.running()
        raise ValueError("fails")

    def then(first: Any) -> None:
        with pytest.raises(ValueError, match="fails"):
            first.get(timeout=WAIT)
        assert first.state == "FAILURE"
        wait_for(lambda: locks(r, sl) == {}, WAIT, "the key to be released")
        again = fail_task.apply_async(args=[1, 2, 3])
        assert again.id != first.id
        with pytest.raises(ValueError, match="fails"):
            again.get(timeout=WAIT)

    def check(first_id: str) -> None:
        assert fail_task.apply_async(args=[1, 2, 3]).id == first_id

    mode.run(lambda: fail_task.apply_async(args=[1, 2, 3]), check, then, fails=True)
    wait_for(lambda: locks(r, sl) == {}, WAIT, "the second key to be released")


def test_get_existing_task_id(app: Celery, key_prefix: str, sl: str) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__get_existing_task_id
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    lock = simple_task.generate_lock(f"{key_prefix}.simple_task", task_args=[1, 2, 3])
    assert lock == md5_key(sl, f"{key_prefix}.simple_task[1, 2, 3]{{}}")
    assert simple_task.aquire_lock(lock, "test_task_id") is True
    assert simple_task.get_existing_task_id(lock) == "test_task_id"


def test_apply_async_fails_lock_cleared(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__apply_async_fails__lock_cleared
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    with mock.patch.object(celery.Task, "apply_async", side_effect=Boom), pytest.raises(Boom):
        simple_task.apply_async(args=[1, 2, 3])
    assert locks(r, sl) == {}
    # the same with the broker's publish failing, after taskdedup took its own lock: both go
    with mock.patch.object(app.amqp, "send_task_message", side_effect=Boom), pytest.raises(Boom):
        simple_task.apply_async(args=[1, 2, 3])
    assert sorted(r.scan_iter(match=f"{key_prefix}*")) == []
    job = simple_task.apply_async(args=[1, 2, 3])  # and nothing is left to deduplicate on
    assert not getattr(job, "deduplicated", False) and queue_length(r, key_prefix) == 1
    assert locks(r, sl) == {md5_key(sl, f"{key_prefix}.simple_task[1, 2, 3]{{}}"): job.id}


def test_apply_async_fails_exception_reraised(app: Celery, key_prefix: str) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__apply_async_fails__exception_reraised
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    with mock.patch.object(celery.Task, "apply_async", side_effect=Boom), pytest.raises(Boom):
        simple_task.apply_async(args=[1, 2, 3])


def test_raise_on_duplicate_raises_duplicate_error(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestSimpleTask::test__raise_on_duplicate__raises_duplicate_error  # noqa: E501
    # README: raise_on_duplicate=True: a duplicate raises DuplicateTaskError; e.task_id is the
    # existing task's id
    @app.task(
        base=Singleton, name=f"{key_prefix}.raise_task", raise_on_duplicate=True, shared=False
    )
    def raise_task(*args: Any) -> Any:
        mode.running()
        return args

    def check(first_id: str) -> None:
        with pytest.raises(DuplicateTaskError) as err:
            raise_task.delay(1, 2, 3)
        assert err.value.task_id == first_id
        assert str(err.value) == f"Attempted to queue a duplicate of task ID {first_id}"
        assert isinstance(err.value, CelerySingletonException)

    first = mode.run(lambda: raise_task.delay(1, 2, 3), check)
    key = md5_key(sl, f"{key_prefix}.raise_task[1, 2, 3]{{}}")
    gone_after_end(mode, r, sl, key, first.id)


def test_clear_locks(app: Celery, r: redis.Redis, key_prefix: str, sl: str) -> None:
    # upstream: tests/test_singleton.py::TestClearLocks::test__clear_locks
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    jobs = [simple_task.apply_async(args=[i, i + 1]) for i in range(5)]
    assert len(locks(r, sl)) == 5
    clear_locks(app)
    assert list(r.scan_iter(match=sl + "*")) == []
    assert queue_length(r, key_prefix) == 5  # only the locks went
    # README (deadlocks): the next call is not deduplicated onto a job whose key was cleared
    again = simple_task.apply_async(args=[0, 1])
    assert again.id != jobs[0].id
    assert locks(r, sl) == {md5_key(sl, f"{key_prefix}.simple_task[0, 1]{{}}"): again.id}


def unique_on_task(app: Celery, mode: Mode, name: str, unique_on: Any) -> Any:
    @app.task(base=Singleton, name=name, unique_on=unique_on, shared=False)
    def unique_task(a: Any, b: Any, c: Any, d: Any = 4) -> Any:
        mode.running()
        return [a, b, c, d]

    return unique_task


def assert_unique_on_key(
    mode: Mode, r: redis.Redis, sl: str, submit: Callable[[], Any], key: str
) -> None:
    """The job's key is exactly ``key`` while it is queued and while it runs (upstream: the
    lock computed at the publish), and it is gone after it ended (upstream: the same lock
    computed again by on_success)."""

    def check(first_id: str) -> None:
        assert locks(r, sl) == {key: first_id}
        assert submit().id == first_id  # a duplicate

    first = mode.run(submit, check)
    gone_after_end(mode, r, sl, key, first.id)


def test_unique_on_pos_arg_lock_on_unique_args_only(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestUniqueOn::test__unique_on_pos_arg__lock_on_unique_args_only  # noqa: E501
    name = f"{key_prefix}.unique_task"
    task = unique_on_task(app, mode, name, ["a", "c"])
    key = md5_key(sl, name + '[]{"a": 2, "c": 4}')
    assert_unique_on_key(mode, r, sl, lambda: task.delay(2, 3, 4, 5), key)


def test_unique_on_kwargs_lock_on_unique_args_only(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestUniqueOn::test__unique_on_kwargs__lock_on_unique_args_only  # noqa: E501
    name = f"{key_prefix}.unique_task"
    task = unique_on_task(app, mode, name, ["b", "d"])
    key = md5_key(sl, name + '[]{"b": 3, "d": 5}')
    assert_unique_on_key(mode, r, sl, lambda: task.delay(2, b=3, c=4, d=5), key)


def test_unique_on_empty_lock_on_task_name_only(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestUniqueOn::test__unique_on_empty__lock_on_task_name_only
    # README [master]: an empty list considers the task name only
    name = f"{key_prefix}.unique_task"
    task = unique_on_task(app, mode, name, [])
    key = md5_key(sl, name + "[]{}")
    calls = iter([(2, 3, 4, 5), (9, 8, 7, 6), (1, 1, 1, 1)])  # any arguments: one key
    assert_unique_on_key(mode, r, sl, lambda: task.delay(*next(calls, (0, 0, 0))), key)


def test_unique_on_is_string_converts_to_list(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestUniqueOn::test__unique_on_is_string_convertes_to_list
    name = f"{key_prefix}.unique_task"
    task = unique_on_task(app, mode, name, "c")
    key = md5_key(sl, name + '[]{"c": 4}')
    assert_unique_on_key(mode, r, sl, lambda: task.delay(2, 3, 4, 5), key)


def test_unique_on_handles_unspecified_default_args(
    mode: Mode, r: redis.Redis, key_prefix: str, sl: str, app: Celery
) -> None:
    # upstream: tests/test_singleton.py::TestUniqueOn::test__unique_on_handles_unspecified_default_args  # noqa: E501
    name = f"{key_prefix}.unique_task"
    task = unique_on_task(app, mode, name, "d")
    key = md5_key(sl, name + '[]{"d": 4}')  # the default of d, which the call omits
    assert_unique_on_key(mode, r, sl, lambda: task.delay(1, 2, 3), key)


def test_raise_on_duplicate_config_default_false(app: Celery, key_prefix: str) -> None:
    # upstream: tests/test_singleton.py::TestRaiseOnDuplicateConfig::test__default_false
    @app.task(base=Singleton, name=f"{key_prefix}.task", shared=False)
    def task() -> None: ...

    assert task._raise_on_duplicate is False


def test_raise_on_duplicate_config_task_cfg_overrides_app_cfg(
    make_app: Callable[..., Celery], key_prefix: str
) -> None:
    # upstream: tests/test_singleton.py::TestRaiseOnDuplicateConfig::test__task_cfg_overrides_app_cfg  # noqa: E501
    app = make_app(singleton_raise_on_duplicate=False)

    @app.task(base=Singleton, name=f"{key_prefix}.task", raise_on_duplicate=True, shared=False)
    def task() -> None: ...

    assert task._raise_on_duplicate is True
    assert task.singleton_config.raise_on_duplicate is False


def test_raise_on_duplicate_config_app_cfg_used_when_task_cfg_unset(
    make_app: Callable[..., Celery], key_prefix: str
) -> None:
    # upstream: tests/test_singleton.py::TestRaiseOnDuplicateConfig::test__app_cfg_used_when_task_cfg_unset  # noqa: E501
    app = make_app(singleton_raise_on_duplicate=True)

    @app.task(base=Singleton, name=f"{key_prefix}.task", shared=False)
    def task() -> None: ...

    assert task._raise_on_duplicate is True


def test_lock_expiry_sent_to_backend(app: Celery, r: redis.Redis, key_prefix: str, sl: str) -> None:
    # upstream: tests/test_singleton.py::TestLockExpiry::test__lock_expiry__sent_to_backend
    # (upstream asserted the backend's lock() call: (lock, result.task_id, expiry=60); here the
    # key itself: it holds the job's id, with a ttl of 60 s)
    @app.task(base=Singleton, name=f"{key_prefix}.simple_task", lock_expiry=60, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    result = simple_task.apply_async(args=[1, 2, 3])
    key = md5_key(sl, f"{key_prefix}.simple_task[1, 2, 3]{{}}")
    assert locks(r, sl) == {key: result.task_id}
    assert 55 < r.ttl(key) <= 60


@pytest.fixture(params=ENCODERS)
def encoder(request: pytest.FixtureRequest, app: Celery) -> str:
    """TestCustomJSONEncoder's encoder, given as a class or as a dotted path."""
    app.conf.singleton_json_encoder_class = encoder_setting(request.param)
    return str(request.param)


def uuid_task(app: Celery, mode: Mode | None, key_prefix: str) -> Any:
    @app.task(base=Singleton, name=f"{key_prefix}.uuid_task", shared=False)
    def uuid_task(a: Any, b: Any, c: Any) -> Any:
        if mode is not None:
            mode.running()
        return [str(a), str(b), str(c)]

    return uuid_task


def test_json_encoder_queue_fails_with_non_string_value(
    encoder: str, app: Celery, r: redis.Redis, key_prefix: str
) -> None:
    # upstream: tests/test_singleton.py::TestCustomJSONEncoder::test__queue_fails_with_non_string_value  # noqa: E501
    task = uuid_task(app, None, key_prefix)
    app.conf.singleton_json_encoder_class = None  # settings are read live
    with pytest.raises(TypeError, match=r"Object of type '?UUID'? is not JSON serializable"):
        task.delay(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    assert sorted(r.scan_iter(match=f"{key_prefix}*")) == []  # no lock, no message


def test_json_encoder_queue_duplicates_same_id(
    encoder: str, mode: Mode, app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # upstream: tests/test_singleton.py::TestCustomJSONEncoder::test__json_queue_duplicates__same_id
    task = uuid_task(app, mode, key_prefix)
    ids = [uuid.uuid4() for _ in range(3)]
    key = md5_key(sl, f"{task.name}{json.dumps([str(i) for i in ids])}{{}}")

    def check(first_id: str) -> None:
        assert {task.delay(*ids).id for _ in range(10)} == {first_id}
        assert locks(r, sl) == {key: first_id}

    first = mode.run(lambda: task.delay(*ids), check)
    gone_after_end(mode, r, sl, key, first.id)


def test_json_encoder_queue_duplicates_same_id_via_marshall(
    encoder: str, mode: Mode, app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # upstream: tests/test_singleton.py::TestCustomJSONEncoder::test__queue_duplicates__same_id__via_marshall  # noqa: E501
    # (upstream gave each argument as str(uuid) or uuid at random; here the forms alternate)
    task = uuid_task(app, mode, key_prefix)
    ids = [uuid.uuid4() for _ in range(3)]
    key = md5_key(sl, f"{task.name}{json.dumps([str(i) for i in ids])}{{}}")

    def call(n: int) -> Any:
        return task.delay(*[str(u) if (n + j) % 2 else u for j, u in enumerate(ids)])

    def check(first_id: str) -> None:
        assert {call(n).id for n in range(10)} == {first_id}
        assert locks(r, sl) == {key: first_id}

    first = mode.run(lambda: call(0), check)
    gone_after_end(mode, r, sl, key, first.id)


def test_json_encoder_queue_multiple_uniques_different_ids(
    encoder: str, mode: Mode, app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # upstream: tests/test_singleton.py::TestCustomJSONEncoder::test__queue_multiple_uniques__different_ids  # noqa: E501
    task = uuid_task(app, mode, key_prefix)
    triples = [[uuid.uuid4() for _ in range(3)] for _ in range(5)]
    results = mode.run_all([lambda t=t: task.delay(*t) for t in triples])
    assert len({res.id for res in results}) == 5
    if mode.name == "queued":
        assert len(locks(r, sl)) == 5 and queue_length(r, key_prefix) == 5
    else:
        expected = [[str(u) for u in t] for t in triples]
        assert [res.get(timeout=WAIT) for res in results] == expected
        wait_for(lambda: locks(r, sl) == {}, WAIT, "every key to be released")


# ================================================================ 2. the README's checklist


def test_generate_lock_vectors() -> None:
    # README: the lock key is a hash of the name and the arguments (spec 2.1's vectors)
    assert generate_lock("t", [1, 2, 3], {"b": 1, "a": "x"}) == (
        "SINGLETONLOCK_3fdcc90912ef7297f4bd5f0475eb562f"
    )
    assert generate_lock("t") == "SINGLETONLOCK_19ca1d85f91567a9c6d9273ffc6618b1"
    assert generate_lock("t", (1, 2)) == generate_lock("t", [1, 2])  # a tuple is a JSON list
    assert generate_lock("t", ["é"]) == md5_key("SINGLETONLOCK_", 't["\\u00e9"]{}')


def test_readme_quick_start_two_identical_calls_queue_one_task(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: quick start: @app.task(base=Singleton); two delay(1, 2, 3, a="b") give equal
    # AsyncResults and the task is queued once; different arguments spawn a new task (a != c)
    @app.task(base=Singleton, name=f"{key_prefix}.do_stuff", shared=False)
    def do_stuff(*args: Any, **kwargs: Any) -> None: ...

    a = do_stuff.delay(1, 2, 3, a="b")
    b = do_stuff.delay(1, 2, 3, a="b")
    assert isinstance(a, AsyncResult) and isinstance(b, AsyncResult)
    assert a == b
    assert queue_length(r, key_prefix) == 1
    c = do_stuff.delay(1, 2, 3, a="c")
    assert a != c
    assert queue_length(r, key_prefix) == 2
    assert locks(r, sl) == {
        md5_key(sl, f'{key_prefix}.do_stuff[1, 2, 3]{{"a": "b"}}'): a.id,
        md5_key(sl, f'{key_prefix}.do_stuff[1, 2, 3]{{"a": "c"}}'): c.id,
    }


def test_readme_identical_means_same_name_and_same_json_arguments(
    app: Celery, r: redis.Redis, key_prefix: str
) -> None:
    # README: it works by overriding apply_async(): every way of sending goes through it; two
    # tasks are identical if they have the same name and the same (JSON form of the) arguments
    @app.task(base=Singleton, name=f"{key_prefix}.one", shared=False)
    def one(a: Any, b: Any = 0) -> None: ...

    @app.task(base=Singleton, name=f"{key_prefix}.two", shared=False)
    def two(a: Any, b: Any = 0) -> None: ...

    first = one.delay(1, 2)
    assert one.apply_async(args=[1, 2]).id == first.id
    assert one.apply_async(args=(1, 2)).id == first.id  # a tuple: the same JSON
    assert one.s(1, 2).delay().id == first.id
    assert one.signature((1, 2)).apply_async().id == first.id
    assert two.delay(1, 2).id != first.id  # another name
    assert one.apply_async(args=[1], kwargs={"b": 2}).id != first.id  # other JSON (spec 2.2)
    assert queue_length(r, key_prefix) == 3


def test_readme_key_value_and_setnx_with_the_default_prefix(
    make_app: Callable[..., Celery], r: redis.Redis, key_prefix: str
) -> None:
    # README: the key is <SINGLETONLOCK_><md5 of name and arguments>, its value the new task's
    # id, set with SETNX (racing identical calls publish once); no expiry by default
    app = make_app(singleton_key_prefix=None)  # the default prefix
    name = f"{key_prefix}.t"
    key = md5_key("SINGLETONLOCK_", f'{name}[1, 2, 3]{{"a": "x", "b": 1}}')
    other = md5_key("SINGLETONLOCK_", f"{name}[7]{{}}")

    @app.task(base=Singleton, name=name, shared=False)
    def t(*args: Any, **kwargs: Any) -> None: ...

    try:
        job = t.apply_async([1, 2, 3], {"b": 1, "a": "x"}, task_id=f"{key_prefix}-my-id")
        assert job.id == f"{key_prefix}-my-id"
        assert r.get(key) == job.id
        assert r.ttl(key) == -1
        assert t.delay(1, 2, 3, a="x", b=1).id == job.id
        results = race(16, lambda _: t.delay(7))
        assert len({res.id for res in results}) == 1
        assert r.get(other) == results[0].id
        assert queue_length(r, key_prefix) == 2
    finally:
        r.delete(key, other)  # exactly the keys this test made outside its prefix


def test_readme_lock_in_the_redis_of_the_result_backend(
    make_app: Callable[..., Celery], redis_url: str, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: by default the lock is in the Redis of the result backend (not the broker's)
    with other_db(redis_url, key_prefix) as (broker_url, broker_db):
        app = make_app(broker=broker_url, backend=redis_url)

        @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
        def t(n: int) -> None: ...

        job = t.delay(1)
        assert Config(app).backend_url == redis_url
        assert locks(r, sl) == {md5_key(sl, f"{key_prefix}.t[1]{{}}"): job.id}
        assert locks(broker_db, sl) == {}
        assert t.delay(1).id == job.id


def test_readme_lock_in_the_redis_of_the_broker_without_a_redis_result_backend(
    make_app: Callable[..., Celery], redis_url: str, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: ... otherwise in the broker's Redis
    with other_db(redis_url, key_prefix) as (broker_url, broker_db):
        app = make_app(broker=broker_url, backend=None)

        @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
        def t(n: int) -> None: ...

        job = t.delay(1)
        assert Config(app).backend_url == broker_url
        assert locks(broker_db, sl) == {md5_key(sl, f"{key_prefix}.t[1]{{}}"): job.id}
        assert locks(r, sl) == {}
        assert t.delay(1).id == job.id


def test_readme_singleton_backend_url(
    app: Celery, redis_url: str, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: a Redis of its own: singleton_backend_url
    with other_db(redis_url, key_prefix) as (url, db):
        app.conf.singleton_backend_url = url

        @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
        def t(n: int) -> None: ...

        job = t.delay(1)
        assert locks(db, sl) == {md5_key(sl, f"{key_prefix}.t[1]{{}}"): job.id}
        assert locks(r, sl) == {}
        assert t.delay(1).id == job.id


class MemoryBackend(BaseBackend):
    """The README's custom storage: a BaseBackend subclass (a dict, one per URL)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url, self.kwargs = url, kwargs
        self.locks: dict[str, str] = {}
        self.calls: list[tuple[Any, ...]] = []

    def lock(self, lock: str, task_id: str, expiry: Any = None) -> bool:
        self.calls.append(("lock", lock, task_id, expiry))
        return self.locks.setdefault(lock, task_id) == task_id

    def unlock(self, lock: str) -> None:
        self.calls.append(("unlock", lock))
        self.locks.pop(lock, None)

    def get(self, lock: str) -> Any:
        return self.locks.get(lock)

    def clear(self, key_prefix: str) -> None:
        for key in [k for k in self.locks if k.startswith(key_prefix)]:
            del self.locks[key]


def test_readme_custom_backend_class(
    make_app: Callable[..., Celery], r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: custom storage: subclass BaseBackend, set singleton_backend_class (here as a
    # dotted path) and singleton_backend_kwargs; a real worker releases through it
    app = make_app(
        singleton_backend_class=f"{__name__}.MemoryBackend",
        singleton_backend_url=f"memory://{key_prefix}",
        singleton_backend_kwargs={"option": 1},
        singleton_lock_expiry=50,
    )
    ran: list[int] = []

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> int:
        ran.append(n)
        return n

    backend = t.singleton_backend
    assert isinstance(backend, MemoryBackend)
    assert (backend.url, backend.kwargs) == (f"memory://{key_prefix}", {"option": 1})
    job = t.delay(1)
    assert t.delay(1).id == job.id
    key = md5_key(sl, f"{key_prefix}.t[1]{{}}")
    assert backend.locks == {key: job.id}
    assert locks(r, sl) == {}  # not in Redis
    with worker(app):
        assert job.get(timeout=WAIT) == 1
        wait_for(lambda: backend.locks == {}, WAIT, "the custom backend's lock to be released")
        assert t.delay(1).get(timeout=WAIT) == 1
    assert ran == [1, 1]
    assert backend.calls[:3] == [
        ("lock", key, job.id, 50),
        ("lock", key, backend.calls[1][2], 50),  # the duplicate's attempt
        ("unlock", key),
    ]
    clear_locks(app)  # through the custom backend too
    assert backend.locks == {}


def test_readme_unique_on_username(
    mode: Mode, app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: unique_on=["username"]: only that argument counts (queued, and while it runs)
    @app.task(base=Singleton, name=f"{key_prefix}.sync_user", unique_on=["username"], shared=False)
    def sync_user(username: str, otherarg: int = 0) -> None:
        if username == "bob":
            mode.running()

    bob_key = md5_key(sl, f'{key_prefix}.sync_user[]{{"username": "bob"}}')
    alice_key = md5_key(sl, f'{key_prefix}.sync_user[]{{"username": "alice"}}')
    alices: list[str] = []

    def check(bob: str) -> None:
        assert sync_user.delay(username="bob", otherarg=100).id == bob
        assert sync_user.delay("bob", 5).id == bob  # positional: the same key
        alice = sync_user.delay(username="alice", otherarg=99)
        assert alice.id != bob
        alices.append(alice.id)
        held = locks(r, sl)
        assert held[bob_key] == bob
        if mode.name == "queued":
            assert held == {bob_key: bob, alice_key: alice.id}

    mode.run(lambda: sync_user.delay(username="bob", otherarg=99), check)


def test_unique_on_errors_raise_before_anything_is_taken(
    app: Celery, r: redis.Redis, key_prefix: str
) -> None:
    # spec 2.2 (both versions): a unique_on name the task does not have is a KeyError, a
    # call that does not fit the signature a TypeError, both before any key or message
    @app.task(base=Singleton, name=f"{key_prefix}.unknown", unique_on=["nope"], shared=False)
    def unknown(a: int) -> None: ...

    @app.task(base=Singleton, name=f"{key_prefix}.known", unique_on=["a"], shared=False)
    def known(a: int) -> None: ...

    with pytest.raises(KeyError):
        unknown.delay(1)
    with pytest.raises(TypeError):
        known.delay(1, 2)
    assert sorted(r.scan_iter(match=f"{key_prefix}*")) == []


class VanishingBackend(MemoryBackend):
    """A lock that is gone between the failed SET NX and the GET (spec 3.1, issue #4)."""

    def lock(self, lock: str, task_id: str, expiry: Any = None) -> bool:
        self.calls.append(("lock", lock, task_id, expiry))
        return len(self.calls) > 1  # the first attempt meets a holder that then vanishes

    def get(self, lock: str) -> Any:
        self.calls.append(("get", lock))
        return None


def test_a_lock_that_vanishes_between_set_and_get_is_taken_again(
    make_app: Callable[..., Celery], r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # spec 3.1 step 3 (both versions): SET NX failed, GET found nothing: take it again, with
    # the same task id, and publish once
    app = make_app(
        singleton_backend_class=VanishingBackend, singleton_backend_url=f"memory://{key_prefix}"
    )

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> None: ...

    job = t.delay(1)
    key = md5_key(sl, f"{key_prefix}.t[1]{{}}")
    assert t.singleton_backend.calls == [
        ("lock", key, job.id, None),
        ("get", key),
        ("lock", key, job.id, None),
    ]
    assert queue_length(r, key_prefix) == 1


def test_readme_raise_on_duplicate_app_setting_and_task_override(
    make_app: Callable[..., Celery], key_prefix: str
) -> None:
    # README: app-wide singleton_raise_on_duplicate; the task's option always overrides it
    app = make_app(singleton_raise_on_duplicate=True)

    @app.task(base=Singleton, name=f"{key_prefix}.strict", shared=False)
    def strict(n: int) -> None: ...

    @app.task(base=Singleton, name=f"{key_prefix}.lenient", raise_on_duplicate=False, shared=False)
    def lenient(n: int) -> None: ...

    first = strict.delay(1)
    with pytest.raises(DuplicateTaskError) as err:
        strict.delay(1)
    assert err.value.task_id == first.id
    held = lenient.delay(1)
    duplicate = lenient.delay(1)
    assert isinstance(duplicate, AsyncResult) and duplicate.id == held.id


def test_readme_lock_expiry_frees_a_queued_jobs_key(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: lock_expiry (seconds): the lock expires even if the task has not run; a call
    # after it spawns a new task (task1 != task2)
    @app.task(base=Singleton, name=f"{key_prefix}.t", lock_expiry=1, shared=False)
    def t(n: int) -> None: ...

    task1 = t.delay(1)
    assert t.delay(1).id == task1.id
    key = md5_key(sl, f"{key_prefix}.t[1]{{}}")
    assert 0 < r.pttl(key) <= 1000
    wait_for(lambda: not r.exists(key), 5, "the lock to expire")
    task2 = t.delay(1)
    assert task1 != task2
    assert queue_length(r, key_prefix) == 2


def test_readme_lock_expiry_app_setting_and_task_override(
    make_app: Callable[..., Celery], r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: app-wide singleton_lock_expiry; the task's lock_expiry overrides it
    app = make_app(singleton_lock_expiry=100)

    @app.task(base=Singleton, name=f"{key_prefix}.app_wide", shared=False)
    def app_wide(n: int) -> None: ...

    @app.task(base=Singleton, name=f"{key_prefix}.own", lock_expiry=30, shared=False)
    def own(n: int) -> None: ...

    app_wide.delay(1)
    own.delay(1)
    assert 95 < r.ttl(md5_key(sl, f"{key_prefix}.app_wide[1]{{}}")) <= 100
    assert 25 < r.ttl(md5_key(sl, f"{key_prefix}.own[1]{{}}")) <= 30


def test_readme_clear_locks_on_worker_ready(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # README: deadlocks: a crashed worker leaves its lock; clear_locks(app) from a
    # worker_ready handler removes every lock. (The in-process test worker does not send
    # worker_ready, so the test sends it as `celery worker` does.)
    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> None: ...

    key = md5_key(sl, f"{key_prefix}.t[1]{{}}")
    r.set(key, "dead-task-id")  # left by a worker that died (or by the original package)
    assert t.delay(1).id == "dead-task-id"

    def unlock_all(**kwargs: Any) -> None:
        clear_locks(app)

    signals.worker_ready.connect(unlock_all, weak=False)
    try:
        signals.worker_ready.send(sender=None)
    finally:
        signals.worker_ready.disconnect(unlock_all)
    assert locks(r, sl) == {}
    fresh = t.delay(1)
    assert fresh.id != "dead-task-id"
    assert locks(r, sl) == {key: fresh.id}


def test_readme_config_table_defaults_and_backend_kwargs(
    make_app: Callable[..., Celery], key_prefix: str
) -> None:
    # README: the app config table's defaults; singleton_backend_kwargs reach the Redis client
    config = config_of()
    assert config.backend_kwargs == {}
    assert config.json_encoder_class is None
    assert config.key_prefix == "SINGLETONLOCK_"
    assert config.raise_on_duplicate is None
    assert config.lock_expiry is None
    app = make_app(singleton_backend_kwargs={"client_name": f"{key_prefix}-client"})

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> None: ...

    assert t._raise_on_duplicate is False
    client = t.singleton_backend.redis
    assert client.connection_pool.connection_kwargs["client_name"] == f"{key_prefix}-client"
    assert client.client_getname() == f"{key_prefix}-client"
    assert t.delay(1).id == t.delay(1).id


def test_readme_celery_namespace(redis_url: str, r: redis.Redis, key_prefix: str) -> None:
    # README: with upper-case settings and a namespace: CELERY_SINGLETON_* (spec 1.6)
    class Settings:
        CELERY_BROKER_URL = redis_url
        CELERY_RESULT_BACKEND = redis_url
        CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{key_prefix}:kombu:"}
        CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": f"{key_prefix}:result:"}
        CELERY_TASK_DEFAULT_QUEUE = f"{key_prefix}-q"
        CELERY_TASKDEDUP_KEY_PREFIX = key_prefix
        CELERY_SINGLETON_KEY_PREFIX = f"{key_prefix}:NS_"
        CELERY_SINGLETON_LOCK_EXPIRY = 50
        CELERY_SINGLETON_RAISE_ON_DUPLICATE = True

    app = Celery(key_prefix, set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> None: ...

    job = t.delay(1)
    key = md5_key(f"{key_prefix}:NS_", f"{key_prefix}.t[1]{{}}")
    assert locks(r, f"{key_prefix}:NS_") == {key: job.id}
    assert 45 < r.ttl(key) <= 50
    with pytest.raises(DuplicateTaskError):
        t.delay(1)
    # without the namespace, an upper-case SINGLETON_KEY_PREFIX is not read (as the original)
    plain = Celery("plain", set_as_current=False)
    plain.conf.update(SINGLETON_KEY_PREFIX="UPPER_")
    assert Config(plain).key_prefix == "SINGLETONLOCK_"


# ================================================================ 3/4. where taskdedup differs


def test_retry_keeps_the_lock_through_the_retries_and_releases_it_at_the_end(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # differs: celery-singleton's self.retry() met its own lock (the job ended in RETRY and
    # never ran again, its lock held forever, #20); the drop-in's retry runs again and keeps
    # the lock through every retry, released when the job ends
    reached: queue.Queue[tuple[str, int]] = queue.Queue()
    gates = [threading.Event() for _ in range(3)]
    attempts: list[int] = []

    def on_retry(self: Any, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        n = self.request.retries  # the attempt that asked for a retry (already published)
        reached.put(("between", n))
        assert gates[n].wait(WAIT)

    @app.task(
        base=Singleton,
        name=f"{key_prefix}.flaky",
        bind=True,
        max_retries=5,
        on_retry=on_retry,
        shared=False,
    )
    def flaky(self: Any, n: int) -> str:
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.1)
        reached.put(("running", 2))
        assert gates[2].wait(WAIT)
        return "ok"

    key = md5_key(sl, f"{key_prefix}.flaky[1]{{}}")
    try:
        with worker(app):
            job = flaky.delay(1)
            for expected in [("between", 0), ("between", 1), ("running", 2)]:
                assert reached.get(timeout=WAIT) == expected
                assert flaky.delay(1).id == job.id  # the retrying job still holds the key
                assert locks(r, sl) == {key: job.id}
                if expected[0] == "between":
                    assert r.ttl(key) == -1  # back on the peer's ttl (none) while it waits
                gates[expected[1]].set()
            assert job.get(timeout=WAIT) == "ok"
            wait_for(lambda: locks(r, sl) == {}, WAIT, "the key to be released after success")
            assert attempts == [0, 1, 2]
            fresh = flaky.delay(1)
            assert fresh.id != job.id
            gates[2].set()
            assert reached.get(timeout=WAIT) == ("between", 0)
    finally:
        for gate in gates:
            gate.set()


def test_retry_in_eager_mode_runs_every_attempt_and_releases(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # (as celery-singleton: an eager retry runs the task again in place)
    app.conf.task_always_eager = True
    attempts: list[tuple[int, str, str | None]] = []
    key = md5_key(sl, f"{key_prefix}.flaky[1]{{}}")

    @app.task(base=Singleton, name=f"{key_prefix}.flaky", bind=True, max_retries=5, shared=False)
    def flaky(self: Any, n: int) -> str:
        attempts.append((self.request.retries, flaky.delay(1).id, r.get(key)))
        if self.request.retries < 2:
            raise self.retry(countdown=0.1)
        return "ok"

    job = flaky.delay(1)
    assert job.get() == "ok"
    assert [a for a, _, _ in attempts] == [0, 1, 2]
    assert all(dup == held == job.id for _, dup, held in attempts)
    assert locks(r, sl) == {}


@contextmanager
def listening_worker(app: Celery, key_prefix: str) -> Iterator[str]:
    """An in-process worker that answers control commands but consumes only an idle queue
    until :func:`consume`; yields its hostname."""
    hostname = f"singleton-{key_prefix}@localhost"
    with worker(app, hostname=hostname, queues=[f"{key_prefix}-idle"]):
        yield hostname


def revoke(app: Celery, job_id: str, hostname: str) -> None:
    """Revoke, and return once the worker has handled it."""
    wait_for(
        lambda: app.control.revoke(job_id, destination=[hostname], reply=True, timeout=2),
        WAIT,
        "the worker to answer the revoke",
    )


def test_a_revoked_queued_job_frees_its_key(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # differs: celery-singleton keeps a revoked job's lock forever (#29); the drop-in frees it
    # when the worker discards the revoked message
    ran: list[int] = []

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> int:
        ran.append(n)
        return n

    key = md5_key(sl, f"{key_prefix}.t[1]{{}}")
    with listening_worker(app, key_prefix) as hostname:
        job = t.delay(1)
        assert t.delay(1).id == job.id
        revoke(app, job.id, hostname)
        assert locks(r, sl) == {key: job.id}  # still queued: the worker has not seen it
        wait_for(
            lambda: app.control.add_consumer(
                f"{key_prefix}-q", destination=[hostname], reply=True, timeout=2
            ),
            WAIT,
            "the worker to consume the queue",
        )
        wait_for(lambda: locks(r, sl) == {}, WAIT, "the revoked job's key to be freed")
        fresh = t.delay(1)
        assert fresh.id != job.id
        assert fresh.get(timeout=WAIT) == 1
    assert job.state == "REVOKED"
    assert ran == [1]  # the fresh job only


def scheduled_ids(app: Celery, hostname: str) -> set[str]:
    replies = app.control.inspect([hostname], timeout=2).scheduled() or {}
    return {entry["request"]["id"] for entries in replies.values() for entry in entries}


def test_a_revoked_eta_job_the_worker_holds_frees_its_key(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # differs: as above, for a job sent with a countdown that a worker holds for its ETA: its
    # key is freed at the revoke command, not when the ETA comes
    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> int:
        return n

    hostname = f"singleton-{key_prefix}@localhost"
    with worker(app, hostname=hostname):
        job = t.apply_async((1,), countdown=120)
        wait_for(lambda: job.id in scheduled_ids(app, hostname), WAIT, "the worker to hold it")
        assert t.delay(1).id == job.id
        revoke(app, job.id, hostname)
        wait_for(lambda: locks(r, sl) == {}, 5, "the revoked ETA job's key to be freed")
        fresh = t.delay(1)
        assert fresh.id != job.id
        assert fresh.get(timeout=WAIT) == 1


def test_a_lock_whose_expiry_passes_while_the_job_runs_stays_held_until_it_ends(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # differs: celery-singleton's lock_expiry ends the lock even while the job runs (the
    # README's 12 s task with expiry 10: a second one runs beside it); the drop-in keeps the
    # key of a running job on its lease until the job ends (no second run beside it)
    started, go = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.task(base=Singleton, name=f"{key_prefix}.slow", lock_expiry=1, bind=True, shared=False)
    def slow(self: Any, n: int) -> int:
        runs.append(self.request.id)
        started.set()
        assert go.wait(WAIT)
        return n

    key = md5_key(sl, f"{key_prefix}.slow[1]{{}}")
    try:
        with worker(app):
            job = slow.delay(1)
            assert started.wait(WAIT)
            began = time.monotonic()
            while time.monotonic() < began + 1.6:  # past the expiry, checked all along
                assert slow.delay(1).id == job.id
                assert locks(r, sl) == {key: job.id}
                time.sleep(0.05)
            go.set()
            assert job.get(timeout=WAIT) == 1
            wait_for(lambda: locks(r, sl) == {}, WAIT, "the key to be released at the end")
    finally:
        go.set()
    assert runs == [job.id]


def test_duplicate_task_error_pickles() -> None:
    # differs: the original's DuplicateTaskError could not be unpickled (spec 1.3)
    err = DuplicateTaskError("Attempted to queue a duplicate of task ID abc", task_id="abc")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is DuplicateTaskError
    assert isinstance(again, CelerySingletonException)
    assert again.task_id == "abc"
    assert str(again) == "Attempted to queue a duplicate of task ID abc"
    assert again.args == ("Attempted to queue a duplicate of task ID abc",)


def test_apply_and_a_direct_call_leave_a_queued_jobs_key(
    app: Celery, r: redis.Redis, key_prefix: str, sl: str
) -> None:
    # differs: celery-singleton's task.apply() deleted the lock of a queued job of the same
    # arguments (its on_success deleted unconditionally, spec 3.2); the drop-in frees only the
    # key its own job holds (README: "frees nothing it did not take"). A direct call takes
    # and frees no lock, as the original's.
    ran: list[int] = []

    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> int:
        ran.append(n)
        return n * 2

    assert t.apply(args=[7]).get() == 14  # no job holds the key: it runs
    assert locks(r, sl) == {}  # and took no celery-singleton key
    job = t.delay(7)
    key = md5_key(sl, f"{key_prefix}.t[7]{{}}")
    assert t.apply(args=[7]).get() == 14  # runs beside the queued job, as the original's
    assert t(7) == 14
    assert locks(r, sl) == {key: job.id}
    assert t.delay(7).id == job.id
    assert ran == [7, 7, 7]


def test_apply_runs_the_task_while_a_job_of_the_same_arguments_is_queued(
    app: Celery, key_prefix: str
) -> None:
    # celery-singleton: task.apply() goes through no lock (spec 3.2): it always runs, and the
    # queued job keeps its key
    @app.task(base=Singleton, name=f"{key_prefix}.t", shared=False)
    def t(n: int) -> int:
        return n * 2

    queued = t.delay(7)
    assert t.apply(args=[7]).get() == 14
    assert t.delay(7).id == queued.id


def test_lock_expiry_zero_is_refused_before_anything_is_taken(
    app: Celery, r: redis.Redis, key_prefix: str
) -> None:
    # differs: celery-singleton passed 0 to Redis (ResponseError: invalid expire time); the
    # drop-in refuses it as a configuration error, before any key or message
    @app.task(base=Singleton, name=f"{key_prefix}.t", lock_expiry=0, shared=False)
    def t(n: int) -> None: ...

    with pytest.raises(ConfigError, match="lock_expiry"):
        t.delay(1)
    assert sorted(r.scan_iter(match=f"{key_prefix}*")) == []
