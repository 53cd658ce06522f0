"""Worker and producer subprocesses: start, find pool children, kill -9, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (a prefork worker's pool processes), from /proc."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


class Worker:
    """A ``celery worker --pool prefork --concurrency 2`` in its own session (process group)."""

    def __init__(self, index: int, env: dict[str, str], logs: Path) -> None:
        self.index = index
        self.env = env
        self.logs = logs
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tag(self) -> str:
        return f"w{self.index}-{self.incarnation}"

    def start(self) -> None:
        self.incarnation += 1
        log = open(self.logs / f"worker-{self.tag}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "chaos.app",
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                "2",
                "--loglevel",
                "INFO",
                "-n",
                f"w{self.index}@chaos",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env=child_env({**self.env, "CHAOS_WORKER_TAG": self.tag, "CHAOS_ROLE": "worker"}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        log.close()

    def crashed_at(self) -> float | None:
        """When this incarnation's log said Celery gave up ("Unrecoverable error": kombu's
        reconnect crashes the consumer at a broker restart, kombu 5.7), as the log file's
        modification time once it says so; None: it did not."""
        log = self.logs / f"worker-{self.tag}.log"
        try:
            if b"Unrecoverable error" in log.read_bytes():
                return log.stat().st_mtime
        except OSError:
            pass
        return None

    def log_tail(self, lines: int = 15) -> list[str]:
        """The last lines of this incarnation's log (for a report)."""
        try:
            text = (self.logs / f"worker-{self.tag}.log").read_text(errors="replace")
        except OSError:
            return []
        return [line[:300] for line in text.splitlines()[-lines:]]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        return child_pids(self.proc.pid) if self.alive() and self.proc else []

    def kill_all(self) -> list[int]:
        """kill -9 the whole worker (main process and pool); returns the pids killed."""
        assert self.proc is not None
        pids = [self.proc.pid, *self.children()]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return pids

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):  # pool children left behind, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def start_producer(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.producer", *args],
        env=child_env(env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
    )
    log.close()
    return proc


def kill_pid(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if ") Z" in fh.read():
                    return
        except OSError:
            return
        time.sleep(0.01)
