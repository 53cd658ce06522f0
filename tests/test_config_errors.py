"""Configuration that used to do nothing, silently: each case is now a clear ConfigError that
names the key (and the nearest valid name), or it works.

Celery cases run on a Redis broker under the test's key prefix, with real in-process workers
where a job must hold its key; taskiq cases on InMemoryBroker; the worker that must refuse to
start is a real ``celery worker`` subprocess.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, shared_task
from celery.contrib.testing.worker import start_worker
from taskiq import InMemoryBroker

import taskdedup.celery
from harness import wait_for
from taskdedup import ConfigError, MemoryStore, QuotaExceeded, RedisStore
from taskdedup.celery import deduplicate, install, reserve
from taskdedup.celery.tasks import task_policy
from taskdedup.stores.base import Inspect
from taskdedup.taskiq import DedupMiddleware
from taskdedup.taskiq import deduplicate as taskiq_deduplicate
from test_celery import make_app

SRC = Path(taskdedup.__file__).resolve().parent.parent


def memory_app(**conf: Any) -> Celery:
    """An app on Celery's in-process broker and taskdedup's in-memory store (no server)."""
    app = Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.update(taskdedup_url="memory://", **conf)
    return app


def held(app: Celery, task: Any, *args: Any) -> Any:
    """What the store holds for ``task(*args)``'s key (None: the key is free)."""
    integ = install(app)
    policy = task_policy(task, integ.settings)
    assert policy is not None
    return integ.dedup.store.run(Inspect(policy.key_for(args, {})))


@pytest.fixture
def current_app() -> Iterator[Callable[[Celery | None], None]]:
    """Lets a test choose Celery's current app (``shared_task`` proxies resolve through it);
    afterwards the current and default apps, and the tasks ``shared_task`` registers on
    every app finalized later, are as they were."""
    from celery import _state

    before, default = _state._tls.current_app, _state.default_app
    finalizers = set(_state._on_app_finalizers)
    yield _state._set_current_app
    _state._set_current_app(before)
    _state.set_default_app(default)
    _state._on_app_finalizers.clear()
    _state._on_app_finalizers.update(finalizers)


# ---------------------------------------------------------------- misspelled names


def test_a_misspelled_celery_setting_names_itself_and_the_setting_meant() -> None:
    app = memory_app(taskdedup_lease_secnds=3)
    install(app)
    with pytest.raises(ConfigError) as err:
        app.finalize()
    assert "'taskdedup_lease_secnds'" in str(err.value)
    assert "did you mean 'taskdedup_default_lease'" in str(err.value)
    with pytest.raises(ConfigError, match="taskdedup_lease_secnds"):
        app.tasks  # noqa: B018  (asking again raises again: nothing runs unchecked)


def test_a_misspelled_install_argument_fails_at_install() -> None:
    with pytest.raises(ConfigError, match=r"'lease_secnds'; did you mean 'default_lease'"):
        install(memory_app(), lease_secnds=3)


def test_a_misspelled_django_style_setting_is_named_as_written() -> None:
    settings = types.SimpleNamespace(
        CELERY_BROKER_URL="memory://",
        CELERY_TASKDEDUP_URL="memory://",
        CELERY_TASKDEDUP_DRYRUN=True,
    )
    app = Celery("django-style", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    install(app)
    with pytest.raises(ConfigError, match=r"'CELERY_TASKDEDUP_DRYRUN'.*'CELERY_TASKDEDUP_DRY_RUN'"):
        app.finalize()


def taskiq_broker() -> InMemoryBroker:
    return InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()))


def test_a_misspelled_taskiq_strategy_or_label_fails_and_names_the_one_meant() -> None:
    broker = taskiq_broker()
    with pytest.raises(ConfigError, match=r"'until_executd'.*did you mean 'until_executed'"):

        @broker.task(deduplicate="until_executd")
        async def declared(x: int) -> None: ...

    with pytest.raises(ConfigError, match=r"'deduplicte'.*did you mean 'deduplicate'"):

        @broker.task(deduplicte={"strategy": "until_executed"})
        async def mislabelled(x: int) -> None: ...

    with pytest.raises(ConfigError, match=r"'until_executd'.*did you mean 'until_executed'"):
        taskiq_deduplicate("until_executd")  # type: ignore[arg-type]

    sent: list[int] = []

    @broker.task
    async def plain(x: int) -> None:
        sent.append(x)

    async def kick(**labels: Any) -> None:
        await broker.startup()
        try:
            await plain.kicker().with_labels(**labels).kiq(1)
        finally:
            await broker.shutdown()

    cases = [
        ({"deduplicate": "until_executd"}, "'until_executd'.*did you mean 'until_executed'"),
        ({"deduplicate_tll": 60}, "'deduplicate_tll'.*did you mean 'deduplicate_ttl'"),
        ({"idempotncy_key": "ci-1"}, "'idempotncy_key'.*did you mean 'idempotency_key'"),
    ]
    for labels, words in cases:
        with pytest.raises(ConfigError, match=words):
            asyncio.run(kick(**labels))
    assert sent == []  # nothing was sent for a call taskdedup could not read


def test_a_bad_option_form_policy_names_the_task_once() -> None:
    broker = taskiq_broker()
    with pytest.raises(ConfigError) as err:

        @broker.task(deduplicate={"keys": ["order"]}, task_name="jobs.ship")
        async def ship(order_id: int) -> None: ...

    assert str(err.value).count("jobs.ship") == 1


# ---------------------------------------------------------------- errors at finalize


def test_a_bad_celery_task_option_fails_when_the_app_finalizes_with_one_message() -> None:
    app = memory_app()
    install(app)

    @app.task(name="jobs.ship", shared=False, deduplicate={"keys": ["order"]})
    def ship(order_id: int) -> None: ...

    expected = (
        "task 'jobs.ship': keys= names 'order', which the task does not take; "
        "its parameters are: order_id"
    )
    with pytest.raises(ConfigError) as err:
        app.finalize()
    assert str(err.value) == expected
    with pytest.raises(ConfigError) as again:
        ship.delay(1)
    assert str(again.value) == expected


def test_a_worker_with_a_broken_policy_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text(
        "from celery import Celery\n"
        "from taskdedup.celery import install\n"
        "app = Celery('broken', broker='memory://')\n"
        "app.conf.taskdedup_url = 'memory://'\n"
        "install(app)\n"
        "@app.task(name='jobs.ship', deduplicate={'keys': ['order']})\n"
        "def ship(order_id): ...\n"
    )
    worker = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "broken_app", "worker", "--pool=solo"],
        cwd=tmp_path,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("TASKDEDUP_")},
            "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path)]),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = worker.stdout + worker.stderr
    assert worker.returncode != 0, output
    assert "ConfigError: task 'jobs.ship': keys= names 'order'" in output
    assert "task 'jobs.ship': task 'jobs.ship'" not in output


# ---------------------------------------------------------------- decorator order


@pytest.mark.parametrize("order", ["above", "below"])
def test_the_decorators_work_on_either_side_of_app_task(order: str) -> None:
    app = memory_app()
    install(app)

    def refresh(product_id: int) -> None: ...

    if order == "above":
        task = deduplicate("until_executed")(app.task(name="jobs.refresh", shared=False)(refresh))
    else:
        task = app.task(name="jobs.refresh", shared=False)(deduplicate("until_executed")(refresh))
    first = task.delay(1)
    again = task.delay(1)
    assert getattr(again, "deduplicated", False) and again.id == first.id

    def export(user: int, page: int) -> None: ...

    capped = reserve(max_concurrent=1, scope="user")
    if order == "above":
        cap = capped(app.task(name="jobs.export", shared=False)(export))
    else:
        cap = app.task(name="jobs.export", shared=False)(capped(export))
    cap.delay(7, 1)
    with pytest.raises(QuotaExceeded):
        cap.delay(7, 2)


def django_settings(redis_url: str, prefix: str) -> types.ModuleType:
    """What ``django.conf.settings`` holds for Celery and taskdedup (namespace CELERY)."""
    settings = types.ModuleType("proj.settings")
    settings.DEBUG = False  # type: ignore[attr-defined]
    settings.CELERY_BROKER_URL = redis_url  # type: ignore[attr-defined]
    settings.CELERY_RESULT_BACKEND = redis_url  # type: ignore[attr-defined]
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{prefix}:kombu:"}  # type: ignore[attr-defined]
    settings.CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": f"{prefix}:result:"}  # type: ignore[attr-defined]
    settings.CELERY_TASK_DEFAULT_QUEUE = f"{prefix}-q"  # type: ignore[attr-defined]
    settings.CELERY_WORKER_HIJACK_ROOT_LOGGER = False  # type: ignore[attr-defined]
    settings.CELERY_TASKDEDUP_KEY_PREFIX = prefix  # type: ignore[attr-defined]
    settings.CELERY_TASKDEDUP_DEFAULT_STRATEGY = "until_executed"  # type: ignore[attr-defined]
    return settings


@pytest.mark.parametrize("order", ["above", "below"])
def test_shared_task_in_either_order_with_django_style_settings(
    order: str, redis_url: str, key_prefix: str, current_app: Any
) -> None:
    """Django's way: the app reads ``CELERY_*`` settings, tasks are ``@shared_task`` in a
    module that may be imported before the project's app exists (another app is current)."""
    runs: list[int] = []

    def ship(order_id: int, note: str = "") -> int:
        runs.append(order_id)
        return order_id

    name = f"{key_prefix}.ship"
    current_app(Celery("imported-early", broker="memory://", set_as_current=False))
    if order == "above":
        task = deduplicate(keys=["order_id"])(shared_task(name=name)(ship))
    else:
        task = shared_task(name=name)(deduplicate(keys=["order_id"])(ship))

    app = Celery("proj", set_as_current=False)
    install(app)  # before the settings are loaded: they are read when the app finalizes
    app.config_from_object(django_settings(redis_url, key_prefix), namespace="CELERY")
    current_app(app)

    first = task.delay(1, "a")
    again = task.delay(1, note="b")  # keys=["order_id"]: the same key
    assert getattr(again, "deduplicated", False) and again.id == first.id
    assert install(app).settings.key_prefix == key_prefix
    assert install(app).settings.default_strategy == "until_executed"
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert first.get(timeout=20) == 1
        wait_for(lambda: held(app, app.tasks[name], 1) is None, what="the key to be released")
    assert runs == [1]


# ---------------------------------------------------------------- when app.conf is read


def test_config_loaded_after_install_counts(redis_url: str, key_prefix: str) -> None:
    app = make_app(redis_url, key_prefix)
    integ = install(app)
    app.config_from_object(
        types.SimpleNamespace(
            broker_url=redis_url,
            broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"},
            task_default_queue=f"{key_prefix}-q",
            taskdedup_key_prefix=key_prefix,
            taskdedup_dry_run=True,
        )
    )

    @deduplicate("until_executed")
    @app.task(shared=False)
    def job(x: int) -> None: ...

    assert not job.delay(1).deduplicated and not job.delay(1).deduplicated  # a dry run
    assert integ.settings.dry_run
    assert integ.dedup.stats["enqueue.would_deduplicate"] == 1


def test_a_second_install_with_other_arguments_is_an_error() -> None:
    app = memory_app()
    store = MemoryStore()
    integ = install(app, store, default_lease=10)
    assert install(app, store, default_lease=10) is integ  # the same: harmless
    assert install(app) is integ  # asks for nothing else
    with pytest.raises(ConfigError, match="other arguments"):
        install(app, store, default_lease=20)
    with pytest.raises(ConfigError, match="other arguments"):
        install(app, MemoryStore(), default_lease=10)


# ---------------------------------------------------------------- stores


def test_from_url_with_a_bad_keyword_fails_at_construction(redis_url: str) -> None:
    with pytest.raises(ConfigError, match="'socket_timout'; did you mean 'socket_timeout'"):
        RedisStore.from_url(redis_url, socket_timout=1)


def test_key_prefix_is_the_stores_argument_and_prefix_is_deprecated(redis_url: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MemoryStore(key_prefix="a").prefix == "a"
        assert RedisStore.from_url(redis_url, key_prefix="b").prefix == "b"
        assert RedisStore(url=redis_url, key_prefix="c").prefix == "c"
    with pytest.warns(DeprecationWarning, match="key_prefix"):
        assert MemoryStore(prefix="d").prefix == "d"
    with pytest.warns(DeprecationWarning, match="key_prefix"):
        assert RedisStore.from_url(redis_url, prefix="e").prefix == "e"
    with pytest.warns(DeprecationWarning, match="key_prefix"):
        assert RedisStore(url=redis_url, prefix="f").prefix == "f"


def test_idempotent_is_gone() -> None:
    assert not hasattr(taskdedup.celery, "idempotent")


# ---------------------------------------------------------------- beat


@pytest.mark.parametrize("apart", [False, True], ids=["back_to_back", "ticks_apart"])
@pytest.mark.parametrize("on_conflict", ["drop", "raise"])
def test_beat_logs_a_run_skipped_for_a_running_one_once_and_counts_it(
    on_conflict: str,
    apart: bool,
    redis_url: str,
    key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``apart``: ticks further apart than the publisher remembers a key held (a real beat
    interval), so each takes the publish path that writes its acquire early."""
    from celery.beat import ScheduleEntry, Scheduler
    from celery.schedules import crontab

    app = make_app(redis_url, key_prefix)
    integ = install(app)
    if apart:
        assert integ.publisher is not None
        integ.publisher.recent.seconds = 0.0  # type: ignore[attr-defined]
    started, release = threading.Event(), threading.Event()

    @deduplicate("until_executed", on_conflict=on_conflict)  # type: ignore[arg-type]
    @app.task(shared=False, name=f"{key_prefix}.nightly")
    def nightly() -> None:
        started.set()
        assert release.wait(20)

    scheduler = Scheduler(app, lazy=True)
    minutes = iter(range(10, 0, -1))

    def tick() -> None:  # what beat does with a due entry: each time the next minute's tick
        last = app.now() - timedelta(minutes=next(minutes))
        entry = ScheduleEntry(
            name="nightly", task=nightly.name, schedule=crontab(), last_run_at=last, app=app
        )
        scheduler.apply_entry(entry, producer=scheduler.producer)

    def said() -> tuple[list[str], list[str]]:
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        infos = [
            r.getMessage()
            for r in caplog.records
            if r.name == "taskdedup" and r.levelno == logging.INFO and "nightly" in r.getMessage()
        ]
        return errors, infos

    caplog.set_level(logging.INFO, logger="taskdedup")  # (the worker sets the root to ERROR)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        tick()
        assert started.wait(20)  # the first run is running and holds its key
        caplog.clear()
        for _ in range(3):
            tick()
        errors, infos = said()
        assert errors == []
        assert len(infos) == 1 and infos[0].startswith(f"beat skipped {nightly.name}"), infos
        assert "entry=nightly" in infos[0]
        assert integ.dedup.stats["beat.skipped"] == 3

        started.clear()
        release.set()
        wait_for(lambda: held(app, nightly) is None, what="the first run to end")
        release.clear()
        tick()  # the key is free: this tick sends a run
        assert started.wait(20)
        caplog.clear()
        tick()  # held again: said once more
        tick()
        errors, infos = said()
        assert errors == [] and len(infos) == 1
        assert integ.dedup.stats["beat.skipped"] == 5
        release.set()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"delay": 0}, "delay must be > 0 seconds"),
        ({"delay": float("nan")}, "delay must be a finite number of seconds"),
        ({"delay": 5, "max_wait": 2}, "max_wait (2s) must be >= delay (5s)"),
        ({"delay": 5, "max_wait": -1}, "max_wait must be > 0 seconds"),
        ({"delay": 5, "max_wait": 7200, "ttl": 3600}, "must be shorter than ttl (3600s)"),
        ({}, "debounce needs delay=<seconds>"),
        ({"delay": 5, "on_conflict": "raise"}, "on_conflict='raise' does not apply"),
    ],
)
def test_a_bad_debounce_option_fails_where_the_task_is_defined_naming_task_and_option(
    options: dict[str, Any], says: str
) -> None:
    app = memory_app()
    with pytest.raises(ConfigError) as caught:

        @deduplicate("debounce", **options)
        @app.task(name="search.reindex", shared=False)
        def reindex(doc_id: int) -> None: ...

    assert "task 'search.reindex'" in str(caught.value) and says in str(caught.value)
    broker = InMemoryBroker()
    broker.add_middlewares(DedupMiddleware("memory://"))
    with pytest.raises(ConfigError) as label_form:  # the same checks on a taskiq label

        @broker.task(task_name="search.reindex", deduplicate={"strategy": "debounce", **options})
        async def areindex(doc_id: int) -> None: ...

    assert "search.reindex" in str(label_form.value) and says in str(label_form.value)


@pytest.mark.parametrize(
    ("strategy", "options", "says"),
    [
        ("until_executed", {"delay": 5}, "delay applies to the debounce strategy only"),
        ("until_executing", {"on_conflict": "supersede"}, "'supersede' needs strategy="),
        ("until_executed", {"running": "cancel"}, "add on_conflict='supersede'"),
    ],
)
def test_a_newest_wins_option_on_the_wrong_policy_names_task_and_fix(
    strategy: str, options: dict[str, Any], says: str
) -> None:
    app = memory_app()
    with pytest.raises(ConfigError) as caught:

        @deduplicate(strategy, **options)  # type: ignore[arg-type]
        @app.task(name="docs.render", shared=False)
        def render(doc: str) -> None: ...

    said = str(caught.value)
    assert "task 'docs.render'" in said and says in said


# ------------------------------------------------------------- first-hour rough edges (issue 30)


def test_a_task_class_with_a_bad_declaration_fails_where_it_is_registered() -> None:
    """A class-based task is registered after the app finalized (``register_task`` finalizes
    it first): its bad ``deduplicate`` is raised there, not at its first ``delay()``."""
    app = memory_app()
    install(app)

    class Build(app.Task):  # type: ignore[name-defined,misc]
        name = "jobs.build"
        deduplicate = {"keys": ["nope"]}

        def run(self, sha: str) -> str:
            return sha

    expected = (
        "task 'jobs.build': keys= names 'nope', which the task does not take; "
        "its parameters are: sha"
    )
    with pytest.raises(ConfigError) as err:
        app.register_task(Build())
    assert str(err.value) == expected


def test_a_bad_reserve_option_names_the_task_once() -> None:
    app = memory_app()
    install(app)

    @app.task(name="jobs.x", shared=False, reserve={"scope": "nope", "max_concurrent": 2})
    def x(a: int) -> None: ...

    with pytest.raises(ConfigError) as err:
        app.finalize()
    assert str(err.value) == (
        "task 'jobs.x': reserve: scope='nope' is not one of its parameters (a); "
        "name one, or pass a callable"
    )
    with pytest.raises(ConfigError) as decorated:

        @reserve(2, scope="nope")
        @app.task(name="jobs.y", shared=False)
        def y(a: int) -> None: ...

    assert str(decorated.value).count("jobs.y") == 1


def test_a_taskiq_task_declared_before_the_middleware_is_refused_at_broker_startup() -> None:
    broker = InMemoryBroker()

    @broker.task(deduplicate="until_executd", task_name="jobs.ship")
    async def ship(order_id: int) -> None: ...

    broker.add_middlewares(DedupMiddleware(MemoryStore()))
    with pytest.raises(ConfigError, match=r"'jobs.ship'.*'until_executd'.*'until_executed'"):
        asyncio.run(broker.startup())
