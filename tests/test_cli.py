"""The ``taskdedup`` command, run as users run it (the installed script, in a subprocess),
against a real Redis holding locks that a real prefork worker took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness import wait_for
from taskdedup import Deduplicator, Policy, RedisStore
from taskdedup.stores.base import Inspect, Retry
from test_celery_prefork import start, worker_env  # noqa: F401  (fixtures)
from worker_process import HERE, WorkerProcess

SCRIPT = str(Path(sys.executable).parent / "taskdedup")


def taskdedup(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ``taskdedup`` script with ``env`` added (the test app's settings)."""
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join([str(HERE), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [SCRIPT, *args], input=stdin, capture_output=True, text=True, env=environ, cwd=HERE,
        timeout=60,
    )  # fmt: skip


@pytest.fixture
def app_env(redis_url: str, key_prefix: str) -> dict[str, str]:
    return {"TD_REDIS_URL": redis_url, "TD_PREFIX": key_prefix}


def test_locks_shows_what_a_worker_holds_and_unlock_frees_it(
    worker_env: Any,  # noqa: F811
    start: Callable[..., WorkerProcess],  # noqa: F811
    app_env: dict[str, str],
    key_prefix: str,
) -> None:
    worker = start()
    app = worker_env.app
    first = worker_env.revoke_until_executed.delay("cli", 60)
    wait_for(lambda: worker.mark("pid:cli"), 30, "the job to run on the worker")
    again = worker_env.revoke_until_executed.delay("cli", 60)
    assert again.deduplicated and again.id == first.id

    listed = taskdedup("-A", "celery_worker_app", "locks", "--json", **app_env)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    mine = [r for r in rows if r["job_id"] == first.id]
    assert len(mine) == 1, rows
    lock = mine[0]
    assert lock["task"] == "sub.revoke_until_executed" and lock["strategy"] == "until_executed"
    assert lock["state"] == "running" and lock["attempts"] == 1 and lock["duplicates"] == 1
    pid = int(worker.mark("pid:cli") or 0)
    assert lock["worker"].endswith(f":{pid}")  # the pool process that runs it
    assert 0 <= lock["age_s"] < 60
    table = taskdedup("-A", "celery_worker_app", "locks", "--task", lock["task"], **app_env)
    assert first.id in table.stdout and "until_executed" in table.stdout, table.stdout

    key = lock["key"]
    story = taskdedup(
        "-A", "celery_worker_app", "explain", "sub.revoke_until_executed", "cli", "60", **app_env
    )
    assert story.returncode == 0, story.stderr
    lines = story.stdout.splitlines()
    assert lines[0] == (
        f"key {key}: running, held by {first.id} on {lock['worker']} "
        "(sub.revoke_until_executed); it answered 1 duplicate so far"
    )  # counted on the lock while it lives (asked before a job id was made: no last id)
    said = [line.split("  ", 2)[-1] for line in lines[1:]]  # newest first, without the time
    assert said == [
        f"started: {first.id} runs on {lock['worker']} (attempt 1)",
        f"accepted: {first.id} took the key (sub.revoke_until_executed)",
    ]
    by_job = taskdedup("-A", "celery_worker_app", "explain", first.id, **app_env)
    assert by_job.stdout == story.stdout
    store = RedisStore.from_url(app_env["TD_REDIS_URL"], key_prefix=key_prefix)
    dry = taskdedup("-A", "celery_worker_app", "unlock", key, "--dry-run", **app_env)
    assert dry.returncode == 0 and f"would free {key}" in dry.stdout
    refused = taskdedup("-A", "celery_worker_app", "unlock", key, stdin="n\n", **app_env)
    assert refused.returncode != 0 and "Aborted" in refused.stderr
    assert store.run(Inspect(key)) is not None  # neither freed anything
    freed = taskdedup("-A", "celery_worker_app", "unlock", key, "--yes", **app_env)
    assert freed.returncode == 0 and f"freed {key}" in freed.stdout, freed.stderr
    assert store.run(Inspect(key)) is None
    after = taskdedup("-A", "celery_worker_app", "explain", key, **app_env)
    assert f"key {key}: free\n" in after.stdout
    assert f"unlocked by an operator (it was {first.id}'s)" in after.stdout
    # the lock's end writes its duplicates to the history, in one line
    assert f"deduplicated: a submission was answered with {first.id}" in after.stdout
    fresh = worker_env.revoke_until_executed.delay("cli", 0)
    assert not fresh.deduplicated  # the key is free: a new job takes it
    gone = taskdedup("-A", "celery_worker_app", "show", "no-such-key", **app_env)
    assert gone.returncode == 1 and "nothing holds" in gone.stderr
    app.control.revoke(first.id, terminate=True)
    store.close()


def test_locks_and_stats_from_a_bare_url(redis_url: str, key_prefix: str) -> None:
    def build(sha: str) -> None: ...

    empty = taskdedup("--url", redis_url, "--prefix", key_prefix, "locks")
    assert empty.returncode == 0 and "0 lock(s)" in empty.stdout, empty.stderr
    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix))
    policy = Policy("until_executed").bind("ci.build", build)
    ticket = dedup.enqueue(policy, ("abc",), job_id="job-1")
    dedup.published(ticket)
    dedup.enqueue(policy, ("abc",), job_id="job-2")  # a duplicate
    shown = taskdedup("--url", redis_url, "--prefix", key_prefix, "show", ticket.key or "")
    assert shown.returncode == 0, shown.stderr
    assert "ci.build" in shown.stdout and "job-1" in shown.stdout and "queued" in shown.stdout
    counted = taskdedup("--url", redis_url, "--prefix", key_prefix, "stats")
    assert counted.returncode == 0
    assert any(line.split() == ["ci.build", "queued", "1"] for line in counted.stdout.splitlines())
    # (a ttl long enough for the CLI calls below on a loaded machine: the retry sets its own)
    brief = Policy("until_executed", ttl=30).bind("ci.brief", build)
    short = dedup.enqueue(brief, ("x",), job_id="job-3")
    dedup.published(short)
    dedup.confirmer.flush()
    live = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", short.key or "")
    assert "accepted: job-3 took the key (ci.brief)" in live.stdout  # told by the lock
    assert dedup.enqueue(brief, ("x",), job_id="job-4").deduplicated
    counted_live = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", short.key or "")
    # counted on the lock (two commands per duplicate), told while the lock lives
    assert "it answered 1 duplicate so far, the last job-4" in counted_live.stdout
    store = dedup.store
    assert store.run(Retry(short.key or "", "job-3", ttl_ms=1000, grace_ms=500))  # a retry...
    wait_for(lambda: store.run(Inspect(short.key or "")) is None, 5, "the lock's ttl to end")
    lapsed = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", short.key or "")
    # ...whose publish was never confirmed: the lock lapsed after the last decision
    assert "free: its ttl or lease ran out after the last decision (expired)" in lapsed.stdout
    assert "retrying: job-3 keeps the key for its retry" in lapsed.stdout
    debounced = Policy("debounce", delay=30, max_wait=60).bind("search.reindex", build)
    burst = dedup.enqueue(debounced, ("doc",), job_id="job-d")
    dedup.published(burst)
    dedup.confirmer.flush()
    due = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", burst.key or "")
    assert "queued, held by job-d (search.reindex); its run is due in 29." in due.stdout
    assert dedup.enqueue(debounced, ("doc",), job_id="job-e", payload='["doc"]').deduplicated
    folded = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", burst.key or "")
    assert "1 submission debounced onto it so far, the last job-e" in folded.stdout
    table = taskdedup("--url", redis_url, "--prefix", key_prefix, "locks").stdout.splitlines()
    assert table[0].split()[-2:] == ["DUPS", "DUE"]
    assert any(line.split()[-1] in ("29s", "30s") for line in table if "job-d" in line)
    unused = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", "never-used")
    assert unused.returncode != 0  # no key, no job, no task of that name
    waiting = dedup.enqueue(policy, ("queued",), job_id="job-5")  # not started: found by its lock
    dedup.published(waiting)
    by_lock = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", "job-5")
    assert by_lock.returncode == 0 and "queued, held by job-5 (ci.build)" in by_lock.stdout
    ended = dedup.enqueue(policy, ("ended",), job_id="job-6")
    dedup.published(ended)
    assert dedup.enqueue(policy, ("ended",), job_id="job-7").deduplicated
    assert dedup.claim(policy, "job-6", key=ended.key).should_run
    dedup.finish(policy, ended.key or "", "job-6")
    story = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", ended.key or "")
    assert f"key {ended.key}: free: job-6 ran and finished" in story.stdout  # not "expired"
    dedup.close()


def test_without_a_target_it_says_what_to_pass() -> None:
    told = taskdedup("locks")
    assert told.returncode == 2 and "-A proj.celery_app" in told.stderr


@pytest.fixture
def evicting(private_redis_url: str) -> Iterator[str]:
    """A private Redis set up to evict keys when full (restored after)."""
    admin = redis.Redis.from_url(private_redis_url)
    before = admin.config_get("maxmemory*")
    admin.config_set("maxmemory", "1gb")
    admin.config_set("maxmemory-policy", "allkeys-lru")
    yield private_redis_url
    admin.config_set("maxmemory", before["maxmemory"])
    admin.config_set("maxmemory-policy", before["maxmemory-policy"])
    admin.close()


def test_doctor_catches_a_short_visibility_timeout_and_an_eviction_policy(
    app_env: dict[str, str], private_redis_url: str, evicting: str
) -> None:
    clean = taskdedup("-A", "celery_worker_app", "doctor", **app_env)
    errors = [line for line in clean.stdout.splitlines() if line.startswith("error")]
    assert clean.returncode in (0, 1) and errors == [], clean.stdout + clean.stderr
    assert "acks_late is off" in clean.stdout  # a warning, exit 1

    short = dict(app_env, TD_VISIBILITY_TIMEOUT="2")
    found = taskdedup("-A", "celery_worker_app", "doctor", **short)
    assert found.returncode == 2
    assert "visibility_timeout (2.0s) is shorter" in found.stdout, found.stdout

    evicts = dict(app_env, TD_STORE_URL=evicting)
    found = taskdedup("-A", "celery_worker_app", "doctor", **evicts)
    assert found.returncode == 2
    assert "maxmemory-policy is allkeys-lru" in found.stdout, found.stdout

    down = taskdedup("--url", "redis://127.0.0.1:1/0", "doctor")
    assert down.returncode == 2 and "does not answer" in down.stdout


def test_locks_of_a_taskiq_broker(app_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--broker-module``: the broker's DedupMiddleware gives the store and the policies."""
    import asyncio

    monkeypatch.syspath_prepend(str(HERE))
    for name, value in app_env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("taskiq_worker_app", None)
    import taskiq_worker_app as tq

    async def kick() -> str:
        await tq.broker.startup()
        try:
            task = await tq.long_job.kiq("tq-cli", 0)  # queued: no worker reads this queue
            return str(task.task_id)
        finally:
            await tq.broker.shutdown()

    job_id = asyncio.run(kick())
    listed = taskdedup("--broker-module", "taskiq_worker_app:broker", "locks", "--json", **app_env)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["task"], r["strategy"], r["state"]) for r in rows if r["job_id"] == job_id] == [
        ("sub.long_job", "until_executed", "queued")
    ]


def test_explain_says_what_the_duplicates_of_the_newest_wins_modes_did() -> None:
    """The history's line for a lock's duplicates names what they did: debounced onto the
    burst's job, superseded its arguments, asked it to stop."""
    from taskdedup.cli.explain import says
    from taskdedup.stores.base import Event

    def line(what: str, last: str, holder: str, count: int) -> str:
        return says(Event(0, what, last, (holder, str(count))))

    assert line("debounced", "B9", "A", 3) == (
        "debounced: 3 submissions were debounced onto A (the last: B9); it ran with the last"
        " one's arguments"
    )
    assert line("superseded", "C", "A", 1) == (
        "superseded: A's arguments were superseded by those of the submission C, which it ran with"
    )
    assert line("cancel_requested", "N", "A", 2) == (
        "cancel requested: 2 submissions asked A to stop while it ran (the last: N); one run,"
        " with the last one's arguments, followed it"
    )
    assert line("deduplicated", "-", "A", 1) == "deduplicated: a submission was answered with A"


@pytest.mark.parametrize("layout", ["store apart", "fused"])
def test_explain_tells_the_duplicates_a_double_click_was_answered_with(
    redis_url: str, key_prefix: str, layout: str
) -> None:
    """A double click: the second and third ``delay()`` are answered with the first job (the
    recent-keys path, while the first job's confirmation still waits in this process). The
    lock counts them, so ``locks`` and ``explain <job>`` say why those calls did not run."""
    from celery import Celery

    from taskdedup.celery import deduplicate, install

    broker = redis_url if layout == "fused" else redis_url.rsplit("/", 1)[0] + "/1"
    app = Celery(key_prefix, broker=broker, set_as_current=False)
    app.conf.update(taskdedup_url=redis_url, taskdedup_key_prefix=key_prefix)
    install(app)

    @deduplicate("until_executed")
    @app.task(name="ci.build", shared=False)
    def build(sha: str) -> str:
        return sha

    first = build.delay("abc")
    repeats = [build.delay("abc"), build.delay("abc")]
    assert [r.id for r in repeats] == [first.id, first.id]
    assert all(r.deduplicated for r in repeats)
    told = ""

    def counted() -> bool:
        nonlocal told
        told = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", first.id).stdout
        return "it answered 2 duplicates so far" in told

    wait_for(counted, 10, "explain to tell the two duplicates")
    assert f"held by {first.id} (ci.build)" in told
    table = taskdedup("--url", redis_url, "--prefix", key_prefix, "locks").stdout.splitlines()
    assert table[1].split()[table[0].split().index("DUPS")] == "2"
    app.close()


def test_a_broker_module_in_the_current_directory_is_found(tmp_path: Path) -> None:
    """As ``celery -A`` and ``taskiq worker`` find it (no PYTHONPATH=. needed)."""
    (tmp_path / "shop_tasks.py").write_text(
        "from taskiq import InMemoryBroker\n"
        "from taskdedup.taskiq import DedupMiddleware\n\n"
        "broker = InMemoryBroker().with_middlewares(DedupMiddleware('memory://'))\n\n\n"
        "@broker.task(deduplicate='until_executed', task_name='shop.receipt')\n"
        "async def receipt(order_id: int) -> None: ...\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [SCRIPT, "--broker-module", "shop_tasks:broker", "stats"],
        capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_locks_lists_locks_not_idempotency_records(redis_url: str, key_prefix: str) -> None:
    """An idempotency key's record is kept beside the locks, but it is no lock: ``locks``
    showed it as a queued lock of task ``?`` for a day (the demo's section 6)."""
    from taskdedup.idempotency import IdempotencyKeys

    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix))
    keys = IdempotencyKeys(dedup)
    assert dedup.run(keys.plan("ci-run-41", "ci.build", "f1", "job-1")).outcome == "new"
    table = taskdedup("--url", redis_url, "--prefix", key_prefix, "locks").stdout
    assert table.splitlines()[-1] == "0 lock(s)", table
    dedup.close()


def ledger_job(redis_url: str, key_prefix: str, job_id: str) -> tuple[Deduplicator, Any, str]:
    """A published ``ledger.sync`` job (until_executed, a 1 s lease): its Deduplicator, policy
    and key."""
    dedup = Deduplicator(RedisStore.from_url(redis_url, key_prefix=key_prefix))

    def sync(account: str) -> None: ...

    policy = Policy("until_executed", lease=1).bind("ledger.sync", sync)
    ticket = dedup.enqueue(policy, ("acme",), job_id=job_id)
    dedup.published(ticket)
    return dedup, policy, ticket.key or ""


def test_explain_tells_a_job_recovered_after_kill_9_ran_and_finished(
    redis_url: str, key_prefix: str
) -> None:
    """The demo's kill -9: a redelivered copy waited while the dead run's lease lasted, then
    ran and finished. explain said the key had expired (it read the waited entry's worker as
    the job)."""
    dedup, policy, key = ledger_job(redis_url, key_prefix, "job-1")
    assert dedup.claim(policy, "job-1", key=key).should_run  # its worker is killed here
    assert dedup.claim(policy, "job-1", key=key).outcome == "running"  # the copy waits
    wait_for(lambda: dedup.claim(policy, "job-1", key=key).should_run, 10, "the lease to end")
    dedup.finish(policy, key, "job-1")
    told = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", key).stdout
    assert f"key {key}: free: job-1 ran and finished" in told, told
    dedup.close()


def test_explain_of_a_job_that_left_no_history_tells_it_finished(
    redis_url: str, key_prefix: str
) -> None:
    """A killed run's copy that came after the lease ended (Celery noticed the death late)
    waited for nothing, so the key keeps no history: asked by its job id, explain reads the
    job's record rather than say only "free"."""
    dedup, policy, key = ledger_job(redis_url, key_prefix, "job-9")
    assert dedup.claim(policy, "job-9", key=key).should_run
    dedup.finish(policy, key, "job-9")
    told = taskdedup("--url", redis_url, "--prefix", key_prefix, "explain", "job-9").stdout
    assert f"key {key}: free: job-9 ran and finished" in told, told
    dedup.close()
