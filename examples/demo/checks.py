"""The demo's six checks: each submits real jobs, waits (polling, with a deadline) for what the
workers did, and prints one line per fact it verified.

A fact that does not hold raises :class:`Failed`; the script then prints ``FAILED: ...`` and
exits 1. ``DEMO_BREAK=dedup`` (for the demo's own test) makes check 1 submit two different
orders, so that its check must fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from examples.demo.journal import PREFIX, Entry, Journal
from examples.demo.workers import Worker

T = TypeVar("T")
TICK = 0.02


class Failed(Exception):
    """Something the demo shows did not happen."""


def say(text: str = "") -> None:
    print(text, flush=True)


def passed(fact: str) -> None:
    say(f"   {fact:<74} ✓")


def require(condition: bool, why: str) -> None:
    if not condition:
        raise Failed(why)


def poll(what: str, predicate: Callable[[], T | None], timeout: float = 20.0) -> T:
    """``predicate()``'s first truthy value; :class:`Failed` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _in_time(what, deadline, timeout)
        time.sleep(TICK)
    return value


async def apoll(what: str, predicate: Callable[[], T | None], timeout: float = 20.0) -> T:
    """:func:`poll` for a coroutine: waits with ``asyncio.sleep``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _in_time(what, deadline, timeout)
        await asyncio.sleep(TICK)
    return value


def _in_time(what: str, deadline: float, timeout: float) -> None:
    if time.monotonic() > deadline:
        raise Failed(f"{what} did not happen within {timeout:.0f} s")


def starts(runs: list[Entry]) -> list[Entry]:
    return [entry for entry in runs if entry.event == "start"]


def ends(runs: list[Entry]) -> list[Entry]:
    return [entry for entry in runs if entry.event == "end"]


def short(job_id: str) -> str:
    return job_id[:8]


@dataclass
class Demo:
    """What the checks share: the private Redis, the Celery worker (check 3 kills one of its
    pool processes), the apps (imported once the Redis URL is in the environment) and check
    3's job (check 6 explains it)."""

    redis_url: str
    journal: Journal
    celery_worker: Worker
    celery: Any
    taskiq: Any
    killed: str = ""  # check 3's job, killed mid-run and recovered

    # ------------------------------------------------------------------ 1. a double click
    def double_click(self) -> None:
        say("1. A double click: two .delay() calls, one job (Celery, until_executed)")
        receipt = self.celery.send_receipt
        first = receipt.delay(1001, "ada@example.com")
        other = 1002 if os.environ.get("DEMO_BREAK") == "dedup" else 1001
        again = receipt.delay(other, "ada@example.com")
        require(
            again.deduplicated and again.id == first.id,
            f"the second .delay() was published as job {again.id}, not answered with "
            f"job {first.id}",
        )
        passed(f"the second call got the first's job {short(first.id)}, nothing was published")
        poll("send_receipt's start", lambda: starts(self.journal.runs("send_receipt")))
        self.journal.open_gate("send_receipt")
        poll("send_receipt's end", lambda: ends(self.journal.runs("send_receipt")))
        runs = starts(self.journal.runs("send_receipt"))
        require(len(runs) == 1, f"send_receipt ran {len(runs)} times")
        passed("ran 1 time")

    # ------------------------------------------------------------- 2. reschedule_once
    def reschedule_once(self) -> None:
        say("2. reschedule_once: resubmitted twice while it runs, one more run with the latest")
        say("   arguments (Celery, until_executed, on_conflict='reschedule_once')")
        render = self.celery.render
        first = render.delay("handbook", 1)
        poll("render v1's start", lambda: starts(self.journal.runs("render")))
        second = render.delay("handbook", 2)
        third = render.delay("handbook", 3)
        require(
            second.id == first.id and third.id == first.id,
            "a resubmission while v1 runs did not get v1's handle",
        )
        passed(f"v1 running; v2 and v3 submitted meanwhile got its job {short(first.id)}")
        self.journal.open_gate("render")
        runs = poll("the owed run", lambda: _at_least(ends(self.journal.runs("render")), 2))
        versions = [entry.args[1] for entry in starts(self.journal.runs("render"))]
        require(versions == [1, 3], f"render ran with versions {versions}, not [1, 3]")
        require(runs[1].job != first.id, "the owed run reused v1's job id")
        passed("then exactly one more run, with v3 (v2 folded into it): runs were v1, v3")

    # ------------------------------------------------------------------ 3. kill -9
    def kill_9(self) -> None:
        say("3. kill -9 mid-job: the job is delivered again and finishes, never twice at once")
        say("   (Celery, prefork, acks_late + reject_on_worker_lost, taskdedup lease 2 s)")
        job = self.celery.sync_ledger.delay("acme")
        self.killed = job.id
        first = poll("sync_ledger's start", lambda: starts(self.journal.runs("sync_ledger")))[0]
        worker_group = self.celery_worker.proc.pid
        require(
            os.getpgid(first.pid) == worker_group,
            f"pid {first.pid} is not a process of the demo's Celery worker",
        )
        os.kill(first.pid, signal.SIGKILL)
        killed_at = time.time()
        passed(f"job {short(job.id)} running in pool process {first.pid}: kill -9 {first.pid}")
        self.journal.open_gate("sync_ledger")  # the next run goes straight through
        done = poll(
            "the killed job's second run", lambda: ends(self.journal.runs("sync_ledger")), 30
        )[0]
        runs = starts(self.journal.runs("sync_ledger"))
        require(len(runs) == 2, f"sync_ledger started {len(runs)} times, not 2")
        again = runs[1]
        require(again.job == job.id and done.job == job.id, "the second run was another job's")
        passed(
            f"the same job ran again in process {again.pid}, done "
            f"{done.at - killed_at:.1f} s after the kill"
        )
        require(
            again.at > killed_at,
            f"the second run started {killed_at - again.at:.2f} s before the first was killed",
        )
        passed(
            f"no overlap: run 1 {0:.2f}-{killed_at - first.at:.2f} s (killed), "
            f"run 2 {again.at - first.at:.2f}-{done.at - first.at:.2f} s"
        )

    # ------------------------------------------------------- 4 and 5, on taskiq
    def on_taskiq(self) -> None:
        asyncio.run(self._taskiq_checks())

    async def _taskiq_checks(self) -> None:
        broker = self.taskiq.broker
        await broker.startup()
        try:
            await self.idempotency_key()
            say()
            await self.reservation_cap()
        finally:
            await broker.shutdown()

    async def idempotency_key(self) -> None:
        say("4. An idempotency key: a CI step retried with the same key (taskiq)")
        key = "gh-acme/shop-4f2a9c1"
        kicker = self.taskiq.build_image.kicker().with_labels(idempotency_key=key)
        first = await kicker.kiq("acme/shop", "4f2a9c1")
        again = await kicker.kiq("acme/shop", "4f2a9c1")
        require(
            again.idempotent_hit and again.task_id == first.task_id,
            f"the retry was sent as job {again.task_id}, not answered with {first.task_id}",
        )
        passed(f"the retry got the original job {short(first.task_id)} (idempotent_hit)")
        await _result(first, "build_image")
        runs = starts(self.journal.runs("build_image"))
        require(len(runs) == 1, f"build_image ran {len(runs)} times")
        passed("ran 1 time")

    async def reservation_cap(self) -> None:
        from taskdedup import QuotaExceeded

        say("5. A reservation cap: at most 2 exports in flight per user (taskiq, @reserve)")
        export = self.taskiq.export
        jobs = [await export.kiq(42, "csv"), await export.kiq(42, "xlsx")]
        await apoll("2 exports running", lambda: _at_least(starts(self.journal.runs("export")), 2))
        passed("2 exports of user 42 running")
        try:
            refused = await export.kiq(42, "pdf")
        except QuotaExceeded as err:
            passed("the third refused, nothing sent: QuotaExceeded")
            say(f"     {err}")
        else:
            raise Failed(f"the third export was accepted as job {refused.task_id}")
        self.journal.open_gate("export")
        for job in jobs:
            await _result(job, "export")
        later = await export.kiq(42, "pdf")
        await _result(later, "export")
        passed("once they ended, the same export was accepted and ran")

    # ----------------------------------------------------------- 6. the taskdedup command
    def command_line(self) -> None:
        say("6. The taskdedup command on the private Redis: `locks` and `explain`")
        report = self.celery.build_report
        first = report.delay("weekly")
        again = report.delay("weekly")
        require(again.id == first.id, "the report's duplicate was published")
        poll("build_report's start", lambda: starts(self.journal.runs("build_report")))
        listing = self.taskdedup("locks")
        require(first.id in listing, f"`taskdedup locks` does not show job {first.id}")
        passed(f"`locks` shows reports.build held by its running job {short(first.id)}")
        why = self.taskdedup("explain", first.id)
        require("it answered 1 duplicate" in why, f"`explain {first.id}` counts no duplicate")
        passed("`explain` tells why the second call did not run: it answered 1 duplicate")
        self.journal.open_gate("build_report")
        poll("build_report's end", lambda: ends(self.journal.runs("build_report")))
        story = self.taskdedup("explain", self.killed)
        require(
            f"free: {self.killed} ran and finished" in story,
            f"`explain {self.killed}` does not tell that check 3's job ran again and finished",
        )
        passed("`explain` tells check 3's end: the killed job ran again and finished")

    def taskdedup(self, *args: str) -> str:
        """Run the real ``taskdedup`` command on the private Redis; print its output indented."""
        options = ["--url", self.redis_url, "--prefix", PREFIX]
        say(f"   $ taskdedup {' '.join([*options, *args])}")
        done = subprocess.run(
            [*_taskdedup_command(), *options, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = (done.stdout + done.stderr).rstrip()
        for line in output.splitlines():
            say(f"     {line}")
        require(done.returncode == 0, f"`taskdedup {args[0]}` exited {done.returncode}")
        return output


def _at_least(items: list[Entry], count: int) -> list[Entry] | None:
    return items if len(items) >= count else None


async def _result(job: Any, task: str, timeout: float = 20.0) -> Any:
    result = await job.wait_result(timeout=timeout)
    require(not result.is_err, f"{task} failed: {result.error!r}")
    return result.return_value


def _taskdedup_command() -> list[str]:
    """The ``taskdedup`` console script beside this Python, else the CLI from this Python."""
    script = Path(sys.executable).parent / "taskdedup"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from taskdedup.cli import main; sys.exit(main())"]


#: The numbered checks the demo shows.
CHECK_COUNT = 6
#: What the script runs, in order (4 and 5 share one event loop).
CHECKS: list[Callable[[Demo], None]] = [
    Demo.double_click,
    Demo.reschedule_once,
    Demo.kill_9,
    Demo.on_taskiq,
    Demo.command_line,
]
