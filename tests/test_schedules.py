"""One run per scheduler tick, with two real schedulers (issue 27).

Two ``celery beat`` processes (or two ``taskiq scheduler`` processes) send the same 1 s
schedule to one real worker for about a minute; one scheduler is killed with SIGKILL midway
and started again. Each run notes the slot of the tick it was sent for (the
``taskdedup_tick`` header or label), its job, and when it started and ended. Then:

- ``every-second`` (a quick body): every tick from the first to the last ran, exactly once;
- ``overrun-skip`` (a 2.2 s body, overlap "skip"): no two runs at once, and the ticks while
  one runs are skipped (the next run starts at a tick after it ended, not at its end);
- ``overrun-buffer`` (a 2.2 s body, overlap "buffer_one"): no two runs at once, and each run
  is followed by exactly one, right after it ends (the buffered tick), so they run back to
  back.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness import wait_for
from test_celery_prefork import CELERY_WORKER as PREFORK_WORKER
from test_celery_prefork import celery_ready
from test_taskiq_workers import children_ready
from worker_process import WorkerProcess

#: How long both schedulers run, and when one of them is killed and started again.
RUN_FOR, KILL_AT, RESTART_AFTER = 60.0, 25.0, 3.0
#: The overrunning bodies' length (tests/celery_worker_app.py, tests/taskiq_worker_app.py).
OVERRUN = 2.2

#: The prefork worker of tests/test_celery_prefork.py, with room for the three entries' runs.
CELERY_WORKER = [*PREFORK_WORKER]
CELERY_WORKER[CELERY_WORKER.index("--concurrency") + 1] = "4"


def celery_beat(schedule: Path) -> list[str]:
    return ["celery", "-A", "celery_worker_app", "beat", "-s", str(schedule), "-l", "INFO"]


TASKIQ_WORKER = ["taskiq", "worker", "taskiq_worker_app:broker", "--workers", "1"]
TASKIQ_SCHEDULER = ["taskiq", "scheduler", "taskiq_worker_app:scheduler"]


def log_says(text: str) -> Callable[[WorkerProcess], bool]:
    return lambda process: text in process.log_path.read_text()


@pytest.fixture
def processes(redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    started: list[WorkerProcess] = []

    def launch(command: list[str], ready: Callable[[WorkerProcess], object]) -> WorkerProcess:
        process = WorkerProcess(command, redis_url, key_prefix, tmp_path, ready)
        started.append(process)
        return process

    yield launch
    for process in started:
        process.stop()


def run_two_schedulers(scheduler: Callable[[str], WorkerProcess]) -> None:
    """Both schedulers for RUN_FOR s; the first is killed with SIGKILL at KILL_AT and started
    again RESTART_AFTER s later (from the same schedule file: a beat's shelve may be torn)."""
    a, b = scheduler("a"), scheduler("b")
    began = time.monotonic()
    time.sleep(KILL_AT)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(10)
    time.sleep(RESTART_AFTER)
    a = scheduler("a")
    time.sleep(max(RUN_FOR - (time.monotonic() - began), 0.0))
    for process in (a, b):
        process.stop()


def runs(redis_url: str, prefix: str, entry: str) -> list[tuple[int | None, str, float, float]]:
    """(slot, job, start, end) of each run of ``entry`` that ended, by start (the slot is
    None for a buffered run: the worker sends it, not a scheduler)."""
    client = redis.Redis.from_url(redis_url)
    lines = [line.decode().split() for line in client.lrange(f"{prefix}:mark:ticks:{entry}", 0, -1)]
    client.close()
    starts = {job: (slot, float(at)) for event, slot, job, at in lines if event == "start"}
    ends = {job: float(at) for event, _, job, at in lines if event == "end"}
    return sorted(
        (
            (None if slot == "None" else int(slot), job, at, ends[job])
            for job, (slot, at) in starts.items()
            if job in ends
        ),
        key=lambda run: run[2],
    )


def check_runs(redis_url: str, prefix: str) -> None:
    ticks = runs(redis_url, prefix, "every-second")
    slots = [slot for slot, *_ in ticks]
    assert None not in slots, ticks  # every run was sent by a scheduler, naming its tick
    assert len(slots) == len(set(slots)), "a tick ran twice: " + str(sorted(slots))
    first, last = min(slots), max(slots)
    missing = sorted(set(range(first, last + 1, 1000)) - set(slots))
    assert missing == [], f"ticks that never ran: {missing} (of {len(slots)})"
    assert len(slots) >= RUN_FOR - 10, len(slots)

    for entry in ("overrun-skip", "overrun-buffer"):
        done = runs(redis_url, prefix, entry)
        assert len(done) >= 10, (entry, done)
        for before, after in itertools.pairwise(done):
            assert after[2] >= before[3], f"{entry}: two runs at once: {before} {after}"
        sent = [slot for slot, *_ in done if slot is not None]
        assert len(set(sent)) == len(sent), (entry, done)  # no tick ran twice
    skip = runs(redis_url, prefix, "overrun-skip")
    buffered = runs(redis_url, prefix, "overrun-buffer")
    skip_gaps = [after[2] - before[3] for before, after in itertools.pairwise(skip)]
    buffer_gaps = [after[2] - before[3] for before, after in itertools.pairwise(buffered)]
    # skip: the next run waits for a tick after the end (0.8 s later on the 1 s grid); the
    # ticks in between are not run
    assert statistics.median(skip_gaps) > 0.5, skip_gaps
    assert len(skip) < len(slots) / 2, (len(skip), len(slots))
    # buffer_one: the one buffered run starts when the last ends, never a tick later
    assert statistics.median(buffer_gaps) < 0.5, buffer_gaps
    assert max(buffer_gaps) < 1.0, buffer_gaps
    assert len(buffered) > len(skip), (len(buffered), len(skip))


def test_two_celery_beats_run_every_tick_once_across_a_kill_9(
    processes: Callable[..., WorkerProcess],
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    worker = processes(CELERY_WORKER, celery_ready)
    wait_for(lambda: worker.mark("ready"), 60, "the worker to start")

    def beat(name: str) -> WorkerProcess:
        return processes(celery_beat(tmp_path / f"beat-{name}"), log_says("beat: Starting"))

    run_two_schedulers(beat)
    time.sleep(OVERRUN + 1.5)  # the runs in flight end
    check_runs(redis_url, key_prefix)


def test_two_taskiq_schedulers_run_every_tick_once_across_a_kill_9(
    processes: Callable[..., WorkerProcess],
    redis_url: str,
    key_prefix: str,
) -> None:
    worker = processes(TASKIQ_WORKER, children_ready)
    wait_for(lambda: children_ready(worker), 60, "the worker to start")

    def scheduler(name: str) -> WorkerProcess:
        return processes(TASKIQ_SCHEDULER, log_says("Starting scheduler"))

    run_two_schedulers(scheduler)
    time.sleep(OVERRUN + 1.5)  # the runs in flight end
    check_runs(redis_url, key_prefix)
