"""The real workers the demo runs, as subprocesses: ``celery worker`` and ``taskiq worker``.

Each runs in a session of its own (so kill -9 of one pool process, and the final stop, reach
exactly what the demo started), with the private Redis's URL in ``DEMO_REDIS_URL`` and its log
in a file that the demo shows the end of when something fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from examples.demo.journal import Journal

ROOT = Path(__file__).resolve().parents[2]  # the repository: ``examples`` is imported from it

CELERY = [
    "celery", "-A", "examples.demo.celery_app", "worker",
    "--pool", "prefork", "--concurrency", "2",  # real pool processes: one is killed in check 3
    "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
]  # fmt: skip
TASKIQ = [
    "taskiq", "worker", "examples.demo.taskiq_app:broker",
    "--workers", "1", "--log-level", "INFO", "--shutdown-timeout", "2",
    # On SIGTERM taskiq's worker waits for the message its idle BRPOP may yet return, which
    # never comes (taskiq 0.13); the process manager's own SIGINT a second later then ends it.
    "--hardkill-count", "0",
]  # fmt: skip


def stop_all(workers: list[Worker]) -> None:
    """Stop the workers together (each one's warm shutdown takes about a second)."""
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop()


def show_logs(workers: list[Worker]) -> None:
    """The end of each worker's log, to tell why something failed."""
    for worker in workers:
        tail = worker.log_tail()
        if tail:
            print(f"--- the end of the {worker.name} worker's log ---\n{tail}", flush=True)


class Worker:
    """``python -m <command>`` in the background; :meth:`stop` ends it (terminate, then kill)."""

    def __init__(self, name: str, command: list[str], redis_url: str, logs: Path) -> None:
        self.name = name
        self.log_path = logs / f"{name}-worker.log"
        env = dict(os.environ, DEMO_REDIS_URL=redis_url)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *command],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def wait_ready(self, journal: Journal, timeout: float = 30.0) -> float:
        """Poll until the worker says it takes jobs; the seconds that took."""
        deadline = self.started + timeout
        while not journal.is_ready(self.name):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} worker exited ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} worker was not ready within {timeout:.0f} s")
            time.sleep(0.05)
        return time.monotonic() - self.started

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        """SIGTERM to the worker's whole session: a warm shutdown."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)

    def stop(self, timeout: float = 5.0) -> None:
        """:meth:`terminate`, then SIGKILL if it has not exited after ``timeout`` seconds."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout)
        self._signal(signal.SIGKILL)  # pool processes left behind, if any

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)
