"""Pacing (issue 27): a scope's submissions spread out to a rate, delayed, never dropped.

The store's primitive (``Pace``, a GCRA) is held to the contract on every store in
``taskdedup.testing.contract``; here: the policy's options and errors, the kill switch and the
dry run, and two real producer processes sharing one scope on Redis.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import textwrap

import pytest

from taskdedup import ConfigError, MemoryStore, PacePolicy, Pacer, Settings
from taskdedup.testing import FakeClock


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"rate": "10 per minute"}, "pace rate '10 per minute' does not parse; write it as"),
        ({"rate": "0/s"}, "pace rate '0/s' must be above 0"),
        ({"rate": "10/fortnight"}, "does not parse"),
        ({"rate": "10/ms"}, "pace rate '10/ms' does not parse"),  # not 10 a minute
        ({"rate": "2000/s"}, "is over 1000/s, the finest pace (1 ms apart)"),
        ({"rate": 10}, "pace rate 10 does not parse"),
        ({"rate": "10/s", "burst": 0}, "pace burst must be an int >= 1, not 0"),
        ({"rate": "10/s", "burst": True}, "pace burst must be an int >= 1, not True"),
        ({"rate": "10/s", "scope": ""}, "pace scope must be an argument name, a callable or None"),
        ({"rate": "10/s", "every": 3}, "unknown pace option(s) every; use rate, burst, scope"),
    ],
)
def test_a_bad_pace_is_a_config_error_that_says_what_to_write(
    options: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        PacePolicy.from_options(options)  # type: ignore[arg-type]
    assert says in str(caught.value)


def test_rates_scopes_and_the_task_as_the_default_scope() -> None:
    assert PacePolicy("10/s").interval_seconds == pytest.approx(0.1)
    assert PacePolicy("100/m").interval_seconds == pytest.approx(0.6)
    assert PacePolicy("5/30s").interval_seconds == pytest.approx(6.0)
    assert PacePolicy("2/hours").interval_seconds == pytest.approx(1800)
    assert PacePolicy.from_options("1/d") == PacePolicy("1/d")

    def sync(tenant: str, report: str = "daily") -> None: ...

    by_task = PacePolicy("1/s")
    assert by_task.scope_for("reports.sync", sync, ("acme",), {}) == "reports.sync"
    by_tenant = PacePolicy("1/s", scope="tenant")
    assert by_tenant.scope_for("reports.sync", sync, ("acme",), {}) == "tenant=acme"
    by_call = PacePolicy("1/s", scope=lambda tenant, report: f"{tenant}/{report}")
    assert by_call.scope_for("reports.sync", sync, ("acme",), {}) == "acme/daily"


def test_off_sends_nothing_and_a_dry_run_holds_nothing_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore(clock=FakeClock())  # (time stands still: the wait is exactly 60 s)
    policy = PacePolicy("1/m")
    off = Pacer(store, Settings(enabled=False))
    assert [off.delay("s", policy) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert store.names() == []  # no store command at all (G16)
    caplog.set_level(logging.INFO, logger="taskdedup")
    dry = Pacer(store, Settings(dry_run=True))
    assert [dry.delay("s", policy) for _ in range(2)] == [0.0, 0.0]
    assert "pace would_delay scope=s by 6" in caplog.text  # the second would wait ~60 s
    paced = Pacer(MemoryStore())
    assert paced.delay("s", policy) == 0.0 and 59 < paced.delay("s", policy) <= 60


PRODUCER = textwrap.dedent(
    """
    import json, sys, time
    from taskdedup import PacePolicy, Pacer, RedisStore
    url, prefix, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pacer = Pacer(RedisStore.from_url(url, key_prefix=prefix))
    policy = PacePolicy("10/s", burst=1)
    starts = []
    for _ in range(n):
        wait = pacer.delay("reports", policy)
        starts.append(time.time() + wait)
    print(json.dumps(starts))
    """
)


def test_two_producer_processes_share_one_pace_none_dropped_in_order(
    redis_url: str, key_prefix: str
) -> None:
    """100 submissions in one burst from 2 processes at 10/s, burst 1: 100 starts (none
    dropped), at least 90 ms apart, and each process's starts in its submission order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, redis_url, key_prefix, "50"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    per_process = [json.loads(out) for out in outs]
    for starts in per_process:
        assert starts == sorted(starts)  # in submission order
    every = sorted(start for starts in per_process for start in starts)
    assert len(every) == 100
    gaps = [b - a for a, b in itertools.pairwise(every)]
    assert min(gaps) >= 0.09, gaps
    assert every[-1] - every[0] >= 99 * 0.1 - 0.1  # the whole burst spread over ~10 s


def test_a_bad_pace_on_a_task_is_refused_at_definition_naming_the_task() -> None:
    from celery import Celery
    from taskiq import InMemoryBroker

    from taskdedup.celery import pace
    from taskdedup.taskiq import pace as pace_taskiq

    app = Celery("pacing-errors", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigError, match=r"task 'reports\.sync': pace rate '10 per minute'"):

        @pace("10 per minute")
        @app.task(name="reports.sync", shared=False)
        def sync(tenant: str) -> None: ...

    with pytest.raises(ConfigError, match=r"pace: scope='nope' is not one of its parameters"):

        @pace("10/m", scope="nope")
        @app.task(name="reports.other", shared=False)
        def other(tenant: str) -> None: ...

    broker = InMemoryBroker()
    with pytest.raises(ConfigError, match="pace burst must be an int >= 1, not 0"):

        @pace_taskiq("1/s", burst=0)
        @broker.task(task_name="reports.render")
        async def render(tenant: str) -> None: ...
