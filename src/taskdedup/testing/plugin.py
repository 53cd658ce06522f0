"""taskdedup's pytest plugin (``pip install 'taskdedup[pytest]'``; registered by entry point, so
its fixtures are there in every test of a project that installs it).

Fixtures:

- ``taskdedup_store``: a store of the test's own, empty when the test starts: the in-memory
  store on ``taskdedup_clock``, or, with ``--taskdedup-redis URL`` (or the
  ``TASKDEDUP_TEST_REDIS_URL`` variable), a Redis store on a private key prefix whose keys are
  deleted after the test. Nothing else on that Redis is read or written.
- ``taskdedup_clock``: the memory store's :class:`~taskdedup.testing.FakeClock`; move time with
  ``advance(seconds)`` (leases, ttls and throttles follow it). A test that asks for it is
  skipped when the store is Redis, whose clock no test can move.
- ``taskdedup_install``: ``taskdedup_install(app_or_broker)`` puts taskdedup on a Celery app or a
  taskiq broker for this test, on ``taskdedup_store``: an app or broker that has it (an app
  module that calls ``install(app)`` at import) is moved to the test's store and back after the
  test; one that has not gets it installed for good (Celery's ``install``, or a
  ``DedupMiddleware`` added), each later test moving it to its own store. The app's own
  ``taskdedup_*`` settings (or the middleware's) apply.

- ``taskdedup_celery_app``: a Celery app with taskdedup installed on ``taskdedup_store``:
  Celery's ``celery_app`` when Celery's pytest fixtures are loaded (pytest-celery installed, or
  ``-p celery.contrib.pytest``), else an app of its own on the ``memory://`` broker. A project
  overrides it in its conftest to test its own app: ``return taskdedup_install(app)``.
- ``taskdedup_celery_worker``: a real in-process worker (Celery's ``start_worker``, the solo
  pool) on ``taskdedup_celery_app``, started after taskdedup is on the app and stopped after
  the test; ``taskdedup_celery_worker_parameters`` (a dict) is passed on to ``start_worker``.

Why a worker fixture of its own: pytest-celery 1.x replaces Celery's in-process
``celery_worker`` with a container worker that needs Docker (celery/pytest-celery#442), so no
fixture here depends on ``celery_worker`` by name. With Docker, a worker in pytest-celery's
``celery_setup`` containers uses its app's own store: the test's side must use that store and
key prefix too (see docs/testing.md), not ``taskdedup_store``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ..stores.base import Store
from ..stores.memory import MemoryStore
from .clock import FakeClock

ENV = "TASKDEDUP_TEST_REDIS_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("taskdedup")
    group.addoption(
        "--taskdedup-redis",
        default=None,
        metavar="URL",
        help=f"run taskdedup's fixtures on this Redis (a private key prefix per test, deleted "
        f"after it) instead of the in-memory store; default: ${ENV}",
    )


def _redis_url(config: pytest.Config) -> str | None:
    return config.getoption("--taskdedup-redis") or os.environ.get(ENV) or None


@pytest.fixture
def taskdedup_clock(request: pytest.FixtureRequest) -> FakeClock:
    if _redis_url(request.config):
        pytest.skip("taskdedup_clock moves the in-memory store's time; the store is Redis")
    return FakeClock()


@pytest.fixture
def taskdedup_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    prefix = f"tdtest-{uuid.uuid4().hex[:12]}"
    url = _redis_url(request.config)
    if url is None:
        clock = request.getfixturevalue("taskdedup_clock")
        yield MemoryStore(key_prefix=prefix, clock=clock)
        return
    from ..stores.redis import RedisStore

    store = RedisStore.from_url(url, key_prefix=prefix)
    try:
        yield store
    finally:
        client = store.client
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.unlink(key)
        store.close()


@pytest.fixture
def taskdedup_install(taskdedup_store: Store) -> Iterator[Callable[[Any], Any]]:
    undo: list[Callable[[], None]] = []

    def install_on(app_or_broker: Any) -> Any:
        """Put taskdedup on ``app_or_broker`` for this test; returns it."""
        undo.append(use_store(app_or_broker, taskdedup_store))
        return app_or_broker

    yield install_on
    for restore in reversed(undo):
        restore()


@pytest.fixture
def taskdedup_celery_app(
    request: pytest.FixtureRequest, taskdedup_install: Callable[[Any], Any]
) -> Iterator[Any]:
    """Celery's ``celery_app`` (when its pytest fixtures are loaded), else an app of this
    fixture's own on ``memory://``, with taskdedup installed on ``taskdedup_store``."""
    try:
        app = request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        yield taskdedup_install(_own_celery_app())
        return
    yield taskdedup_install(app)


def _own_celery_app() -> Any:
    """What Celery's ``celery_app`` fixture would give: a test app on the in-memory transport
    and result backend, not set as the current app."""
    from celery.contrib.testing.app import TestApp

    return TestApp(
        set_as_current=False,
        config={"broker_url": "memory://", "result_backend": "cache+memory://"},
    )


@pytest.fixture
def taskdedup_celery_worker_parameters() -> dict[str, Any]:
    """Keyword arguments for Celery's ``start_worker`` (override to change the pool, the
    queues, the shutdown timeout...)."""
    return {}


@pytest.fixture
def taskdedup_celery_worker(
    taskdedup_celery_app: Any, taskdedup_celery_worker_parameters: dict[str, Any]
) -> Iterator[Any]:
    """A real in-process Celery worker on ``taskdedup_celery_app`` for this test (a
    ``WorkController``; ``.reload()`` after defining a task in the test)."""
    from celery.contrib.testing.worker import start_worker

    options: dict[str, Any] = {"pool": "solo", "perform_ping_check": False}
    options.update(taskdedup_celery_worker_parameters)
    with start_worker(taskdedup_celery_app, **options) as worker:
        yield worker


def use_store(app_or_broker: Any, store: Store) -> Callable[[], None]:
    """Install taskdedup on ``app_or_broker`` if needed and move it to ``store``; returns what
    moves it back (and takes out a middleware added here)."""
    if hasattr(app_or_broker, "get_all_tasks"):  # a taskiq broker
        from ..taskiq import DedupMiddleware

        found = [m for m in app_or_broker.middlewares if isinstance(m, DedupMiddleware)]
        if not found:  # it stays (a middleware cannot be taken out of a broker whole)
            found = [DedupMiddleware()]
            app_or_broker.add_middlewares(found[0])
        return found[0].use_store(store)
    from ..celery import install, integration_for

    integ = integration_for(app_or_broker) or install(app_or_broker)
    return integ.use_store(store)
