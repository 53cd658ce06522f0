"""taskdedup's pytest plugin and testing helpers, as a user's test suite meets them: the
fixtures with Celery's in-process ones and on a real Redis, faithful eager mode, and the
helpers failing where they should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from taskdedup.celery import deduplicate
from taskdedup.testing import assert_deduplicated, assert_not_deduplicated, check_policies

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )


@pytest.mark.parametrize(
    "plugins",
    [(), ("-p", "no:celery"), ("-p", "no:celery", "-p", "celery.contrib.pytest")],
    ids=["pytest-celery", "no-celery-fixtures", "celery-legacy-fixtures"],
)
def test_the_worker_fixture_runs_a_real_worker_with_or_without_pytest_celery(
    plugins: tuple[str, ...],
) -> None:
    """pytest-celery 1.x (installed here, no Docker) makes Celery's ``celery_worker`` a
    container; ``taskdedup_celery_worker`` is in-process whatever is loaded."""
    case = ROOT / "tests" / "plugin_cases" / "case_celery_fixtures.py"
    done = run_pytest(*plugins, str(case))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_project_overrides_the_app_fixture_to_test_its_own_app() -> None:
    done = run_pytest(str(ROOT / "tests" / "plugin_cases" / "case_own_app.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_example_project_passes_on_redis_and_leaves_no_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = set(client.scan_iter(match="tdtest-*", count=1000))
    done = run_pytest("--taskdedup-redis", redis_url, "examples/shop")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout and "1 skipped" in done.stdout  # the fake clock's test
    assert set(client.scan_iter(match="tdtest-*", count=1000)) == before
    client.close()


@pytest.fixture
def shop(taskdedup_install: Any) -> Celery:
    app = Celery("eager-shop", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    return taskdedup_install(app)  # type: ignore[no-any-return]


def test_eager_mode_deduplicates_a_nested_submission_as_a_worker_would(shop: Celery) -> None:
    inner: list[Any] = []

    @deduplicate("until_executed")
    @shop.task(name="eager.build", bind=True, shared=False)
    def build(self: Any, sha: str) -> str:
        if not inner:
            inner.append(build.delay(sha))  # submitted again while it runs
        return sha

    first = build.delay("abc")
    assert first.get() == "abc"
    assert_deduplicated(first, inner[0])
    assert_not_deduplicated(first, build.delay("abc"))  # it ended and let go: runs again


def test_eager_bypass_runs_every_call(taskdedup_install: Any) -> None:
    app = Celery("eager-bypass", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, taskdedup_eager="bypass")
    taskdedup_install(app)
    runs: list[str] = []

    @deduplicate("until_expired", ttl=3600)
    @app.task(name="eager.report", shared=False)
    def report() -> None:
        runs.append("ran")

    assert_not_deduplicated(report.delay(), report.delay())
    assert runs == ["ran", "ran"]


def test_check_policies_passes_a_default_app_and_strict_names_acks_late(
    taskdedup_install: Any,
) -> None:
    """A user's first use of the helper: Celery's defaults (acks_late off) are a sound app."""
    app = Celery("defaults", broker="memory://", set_as_current=False)
    taskdedup_install(app)

    @deduplicate("until_executed")
    @app.task(name="defaults.build", shared=False)
    def build(sha: str) -> None: ...

    assert set(check_policies(app)) == {"defaults.build"}
    with pytest.raises(AssertionError, match=r"acks_late: defaults\.build: acks_late is off"):
        check_policies(app, strict=True)


def test_check_policies_names_each_problem(taskdedup_install: Any) -> None:
    app = Celery("policies", broker="memory://", set_as_current=False)
    taskdedup_install(app)

    @deduplicate("until_executed", ttl=10, lease=60)
    @app.task(name="policies.slow", acks_late=True, shared=False)
    def slow() -> None: ...

    with pytest.raises(AssertionError, match=r"policies\.slow: lease 60s is longer than ttl 10s"):
        check_policies(app)

    short = Celery("short-visibility", broker="redis://127.0.0.1:1/0", set_as_current=False)
    short.conf.broker_transport_options = {"visibility_timeout": 5}  # read, never connected
    taskdedup_install(short)

    @deduplicate("until_executed", lease=10)
    @short.task(name="policies.long", acks_late=True, time_limit=60, shared=False)
    def long() -> None: ...

    with pytest.raises(AssertionError, match="visibility_timeout"):
        check_policies(short)
    assert "policies.long" in check_policies(short, ignore=["visibility"])

    quiet = Celery("debounce-visibility", broker="redis://127.0.0.1:1/0", set_as_current=False)
    quiet.conf.broker_transport_options = {"visibility_timeout": 30}
    taskdedup_install(quiet)

    @deduplicate("debounce", delay=40, max_wait=120, lease=5)
    @quiet.task(name="policies.reindex", acks_late=True, shared=False)
    def reindex() -> None: ...

    # its delivery is held back until the run is due (up to the delay): the broker would
    # deliver it again meanwhile
    with pytest.raises(AssertionError, match=r"and its debounce delay \(40s\)"):
        check_policies(quiet)


def test_a_memory_store_kept_across_tests_can_be_emptied() -> None:
    from taskdedup import Deduplicator, MemoryStore, Policy

    store = MemoryStore()
    dedup = Deduplicator(store)
    policy = Policy("until_executed").bind("ci.build", lambda sha: None)
    dedup.published(dedup.enqueue(policy, ("abc",)))
    assert dedup.enqueue(policy, ("abc",)).deduplicated
    store.clear()
    assert store.names() == [] and dedup.enqueue(policy, ("abc",)).acquired


def test_an_eager_retry_runs_again_under_its_lock(shop: Celery) -> None:
    tries: list[int] = []

    @deduplicate("until_executed")
    @shop.task(name="eager.flaky", bind=True, max_retries=2, shared=False)
    def flaky(self: Any, x: int) -> str:
        tries.append(self.request.retries)
        if len(tries) < 2:
            raise self.retry(countdown=0)
        return "ok"

    result = flaky.delay(1)
    assert (result.state, result.result, tries) == ("SUCCESS", "ok", [0, 1])
    assert_not_deduplicated(result, flaky.delay(1))  # it ended: its key is free again


def test_a_taskiq_broker_moved_to_a_new_store_renews_and_frees_locks_there() -> None:
    import asyncio

    from taskiq import InMemoryBroker

    from taskdedup import MemoryStore
    from taskdedup.taskiq import DedupMiddleware
    from taskdedup.testing.plugin import use_store

    broker = InMemoryBroker().with_middlewares(DedupMiddleware(MemoryStore()))

    @broker.task(task_name="moved.build", deduplicate={"strategy": "until_executed", "lease": 0.3})
    async def build(sha: str) -> str:
        await asyncio.sleep(1.0)  # three leases: only the heartbeat keeps the lock
        return sha

    async def two_tests() -> None:  # in one event loop, as with pytest-asyncio's shared loop
        await broker.startup()
        for _ in range(2):  # each test on its own store
            restore = use_store(broker, MemoryStore())
            try:
                first = await build.kiq("abc")
                await asyncio.sleep(0.7)  # two leases into the run
                assert_deduplicated(first, await build.kiq("abc"))  # renewed in this store
                assert (await first.wait_result(timeout=10)).return_value == "abc"
                again = await build.kiq("abc")  # the job ended: its key is free in this store
                assert_not_deduplicated(first, again)
                await broker.wait_all()
            finally:
                restore()
        await broker.shutdown()

    asyncio.run(asyncio.wait_for(two_tests(), 30))


def test_check_policies_imports_the_apps_task_modules_as_a_worker_does(
    taskdedup_install: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Django's ``autodiscover_tasks()`` and ``include=`` import the tasks lazily: the helper
    imports them as a worker does, rather than pass having checked nothing."""
    (tmp_path / "lazy_tasks.py").write_text(
        "from celery import shared_task\n"
        "from taskdedup.celery import deduplicate\n\n\n"
        '@deduplicate("until_executed")\n'
        '@shared_task(name="lazy.build")\n'
        "def build(sha): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    app = Celery("lazy", broker="memory://", include=["lazy_tasks"], set_as_current=False)
    taskdedup_install(app)
    assert set(check_policies(app)) == {"lazy.build"}
