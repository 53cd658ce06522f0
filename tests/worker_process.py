"""A real worker (Celery or taskiq) as a subprocess of the test, for kill -9 and redelivery.

The worker app module reads the Redis URL and the test's key prefix from the environment and
marks what it does (ready, pids, runs) under ``<prefix>:mark:*``, which the test reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from harness import wait_for

HERE = Path(__file__).resolve().parent


class WorkerProcess:
    """``command`` run in its own session with the test's environment; stopped by ``stop``."""

    def __init__(
        self,
        command: list[str],
        redis_url: str,
        prefix: str,
        logs: Path,
        ready: Callable[[WorkerProcess], object],
        **env: str,
    ) -> None:
        self.prefix = prefix
        self.client = redis.Redis.from_url(redis_url)
        environ = dict(os.environ, TD_REDIS_URL=redis_url, TD_PREFIX=prefix, **env)
        environ["PYTHONPATH"] = os.pathsep.join([str(HERE), environ.get("PYTHONPATH", "")])
        self.log_path = logs / f"worker-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *command],
            env=environ,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=HERE,
        )
        wait_for(lambda: ready(self) or self._died(), 60, "the worker to start")

    def _died(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited: {self.log_path.read_text()[-3000:]}")
        return False

    def mark(self, name: str) -> bytes | None:
        return self.client.get(f"{self.prefix}:mark:{name}")  # type: ignore[return-value]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s: a taskiq worker on RedisStreamBroker does not exit
        on SIGTERM at all (taskiq 0.13 / taskiq-redis 1.2.4, with or without taskdedup: its
        worker process stays in ``receiver.listen`` after "Stopping prefetching messages")."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.client.close()
        self.log.close()
