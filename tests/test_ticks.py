"""A scheduler's ticks (issue 27), what beat and taskiq's scheduler send, without a worker.

The sends go to the real broker (Celery: Redis) or taskiq's in-memory broker; what a test
checks is what the caller of the scheduler sees: the same job for a tick sent twice or late,
a new one for the next tick, and the overlap an entry names. The schedulers themselves, two
of them for a minute with a real worker, are in tests/test_schedules.py.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab
from taskiq import TaskiqScheduler
from taskiq.scheduler.scheduled_task import ScheduledTask

from taskdedup import ConfigError
from taskdedup.celery import deduplicate, install
from test_celery import make_app
from test_taskiq import NoSchedules, make_broker, run, started


def beat_send(app: Celery, task: Any, last_run_at: datetime, **options: Any) -> Any:
    """What a beat whose entry last ran at ``last_run_at`` sends for its every-minute tick."""
    entry = ScheduleEntry(
        name="minutely",
        task=task.name,
        schedule=crontab(),
        last_run_at=last_run_at,
        options=options,
        app=app,
    )
    return Scheduler(app, lazy=True).apply_async(entry)


def test_a_tick_sent_by_two_beats_and_late_by_a_third_is_one_job(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix)
    install(app)

    @deduplicate("until_executed")
    @app.task(shared=False, name=f"{key_prefix}.minutely")
    def minutely() -> None: ...

    now = app.now()
    first = beat_send(app, minutely, now - timedelta(seconds=70))
    assert not getattr(first, "deduplicated", False)
    second = beat_send(app, minutely, now - timedelta(seconds=70))  # another beat, same tick
    assert second.deduplicated and second.id == first.id
    late = beat_send(app, minutely, now - timedelta(seconds=130))  # a beat a tick behind
    assert late.deduplicated and late.id == first.id


@pytest.mark.parametrize("once_per_tick", ["all", "off"])
def test_any_entry_is_sent_once_per_tick_with_once_per_tick_all(
    once_per_tick: str, redis_url: str, key_prefix: str
) -> None:
    """A task without a dedup policy: "all" sends its tick once, "off" (and the default,
    "deduplicated") as often as beats send it."""
    app = make_app(redis_url, key_prefix, taskdedup_once_per_tick=once_per_tick)
    install(app)

    @app.task(shared=False, name=f"{key_prefix}.plain")
    def plain() -> None: ...

    ids = [beat_send(app, plain, app.now() - timedelta(seconds=70)).id for _ in range(3)]
    assert len(set(ids)) == (1 if once_per_tick == "all" else 3), ids


def test_an_entry_that_allows_overlap_sends_each_tick_beside_the_queued_one(
    redis_url: str, key_prefix: str
) -> None:
    """``options={"overlap": "allow"}`` on the entry: each tick is its own job, under a key of
    its own, while the task's own policy skips; a second send of one tick is still one job."""
    app = make_app(redis_url, key_prefix)
    install(app)

    @deduplicate("until_executed")
    @app.task(shared=False, name=f"{key_prefix}.report")
    def report() -> None: ...

    now = app.now()
    ticks = [now - timedelta(seconds=s) for s in (250, 190, 130, 70)]
    sent = [beat_send(app, report, last, overlap="allow") for last in ticks]
    assert len({r.id for r in sent}) == 4 and not any(r.deduplicated for r in sent)
    again = beat_send(app, report, ticks[-1], overlap="allow")
    assert again.deduplicated and again.id == sent[-1].id
    direct = report.delay()  # the task's own key is free: the ticks hold keys of their own
    assert not direct.deduplicated and report.delay().id == direct.id


def test_an_entry_asking_buffer_one_of_a_task_that_owes_no_run_is_refused_naming_both(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix)
    install(app)

    @deduplicate("until_executed")
    @app.task(shared=False, name=f"{key_prefix}.digest")
    def digest() -> None: ...

    with pytest.raises(Exception, match=r"digest'.*minutely.*buffer_one.*declare overlap"):
        beat_send(app, digest, app.now() - timedelta(seconds=70), overlap="buffer_one")
    with pytest.raises(Exception, match=r"unknown overlap of schedule entry 'minutely'"):
        beat_send(app, digest, app.now() - timedelta(seconds=70), overlap="sometimes")


def test_an_entry_overlap_for_a_task_without_a_policy_is_refused_naming_both(
    redis_url: str, key_prefix: str
) -> None:
    app = make_app(redis_url, key_prefix)
    install(app)

    @app.task(shared=False, name=f"{key_prefix}.cleanup")
    def cleanup() -> None: ...

    with pytest.raises(Exception, match=r"cleanup'.*'minutely' names overlap='skip'.*no dedup"):
        beat_send(app, cleanup, app.now() - timedelta(seconds=70), overlap="skip")


def test_a_tick_whose_publish_failed_goes_out_from_the_other_beat(
    redis_url: str, key_prefix: str
) -> None:
    """Beat A's broker is unreachable: its publish of the tick fails (beat logs it), and the
    tick is forgotten, so beat B's send of the same tick is published, not answered with a job
    that never went out."""
    down = make_app(redis_url, key_prefix, taskdedup_url=redis_url)
    down.conf.broker_url = "redis://127.0.0.1:1/0"
    down.conf.broker_connection_retry = False
    down.conf.broker_connection_max_retries = 0
    down.conf.broker_transport_options = {"max_retries": 0}
    up = make_app(redis_url, key_prefix, taskdedup_url=redis_url)
    jobs = []
    for app in (down, up):
        install(app)

        @deduplicate("until_executed")
        @app.task(shared=False, name=f"{key_prefix}.hourly")
        def hourly() -> None: ...

        jobs.append(hourly)
    last = up.now() - timedelta(seconds=70)
    with pytest.raises(Exception):  # noqa: B017 (kombu's OperationalError, wrapped by beat)
        beat_send(down, jobs[0], last)
    sent = beat_send(up, jobs[1], last)
    assert not sent.deduplicated
    assert beat_send(up, jobs[1], last).id == sent.id  # and once only


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"overlap": "sometimes"}, r"task 'bad\.tick': unknown overlap 'sometimes'"),
        ({"overlap": "buffer_one"}, r"task 'bad\.tick': overlap='buffer_one' needs strategy"),
    ],
)
def test_a_bad_overlap_is_refused_at_definition_naming_the_task(
    options: dict[str, Any], says: str
) -> None:
    app = Celery("bad-overlap", set_as_current=False)
    install(app)
    with pytest.raises(ConfigError, match=says):

        @deduplicate("until_executing", **options)
        @app.task(shared=False, name="bad.tick")
        def tick() -> None: ...


def test_the_once_per_tick_setting_is_checked() -> None:
    from taskdedup import Settings

    with pytest.raises(ConfigError, match="once_per_tick must be"):
        Settings(once_per_tick="sometimes")  # type: ignore[arg-type]
    assert Settings.load(environ={"TASKDEDUP_ONCE_PER_TICK": "all"}).once_per_tick == "all"


def test_two_taskiq_schedulers_with_label_schedules_send_a_tick_once() -> None:
    """Two schedulers of one label-based schedule (each gives it a random schedule_id) send
    its tick: one job runs; another schedule's tick (a second later) runs too."""
    broker, _ = make_broker()
    ran: list[str] = []

    @broker.task(deduplicate="until_executed")
    async def heartbeat_report(team: str) -> None:
        ran.append(team)

    def entry(at: datetime) -> ScheduledTask:
        return ScheduledTask(
            task_name=heartbeat_report.task_name, labels={}, args=["core"], kwargs={}, time=at
        )

    a, b = TaskiqScheduler(broker, []), TaskiqScheduler(broker, [])
    due = datetime.now(timezone.utc).replace(microsecond=0)

    async def body() -> None:
        await a.on_ready(NoSchedules(), entry(due))  # type: ignore[arg-type]
        await b.on_ready(NoSchedules(), entry(due))  # type: ignore[arg-type]
        await broker.wait_all()
        await asyncio.sleep(0)
        await b.on_ready(NoSchedules(), entry(due + timedelta(seconds=1)))  # type: ignore[arg-type]

    run(started(broker, body))
    assert ran == ["core", "core"], ran


def test_a_taskiq_schedule_label_allows_overlap_for_its_entry() -> None:
    """``labels={"deduplicate_overlap": "allow"}`` on a schedule: each of its ticks runs under
    a key of its own while the task's own policy would skip them."""
    broker, _ = make_broker()
    started_runs: list[str] = []
    release = asyncio.Event()

    @broker.task(deduplicate="until_executed")
    async def sync_ledger(team: str) -> None:
        started_runs.append(team)
        await release.wait()

    scheduler = TaskiqScheduler(broker, [])
    due = datetime.now(timezone.utc).replace(microsecond=0)

    def entry(at: datetime, **labels: Any) -> ScheduledTask:
        return ScheduledTask(
            task_name=sync_ledger.task_name, labels=labels, args=["core"], kwargs={}, time=at
        )

    async def body() -> None:
        fire = scheduler.on_ready
        await fire(NoSchedules(), entry(due))  # type: ignore[arg-type]  # holds the task's key
        for n in (1, 2):  # allowed: each beside it, under a key of its own
            at = due + timedelta(seconds=n)
            await fire(NoSchedules(), entry(at, deduplicate_overlap="allow"))  # type: ignore[arg-type]
        await fire(NoSchedules(), entry(due + timedelta(seconds=3)))  # type: ignore[arg-type]
        for _ in range(100):
            if len(started_runs) >= 3:
                break
            await asyncio.sleep(0.02)
        release.set()

    run(started(broker, body))
    assert started_runs == ["core", "core", "core"], started_runs  # the 4th was skipped


def test_stacked_caps_as_a_celery_task_option(redis_url: str, key_prefix: str) -> None:
    from taskdedup import QuotaExceeded

    app = make_app(redis_url, key_prefix)
    install(app)

    @app.task(
        shared=False,
        name=f"{key_prefix}.mail",
        reserve=[{"max_concurrent": 2}, {"max_concurrent": 1, "scope": "user"}],
    )
    def mail(user: str) -> None: ...

    mail.delay("ann")
    with pytest.raises(QuotaExceeded, match="scope user=ann"):
        mail.delay("ann")
    mail.delay("bob")
    with pytest.raises(QuotaExceeded, match=f"scope {mail.name}"):
        mail.delay("cid")
