"""What the SQL stores promise beyond the shared contract (tests/test_store_contract.py runs
that on both): round trips per operation counted on the wire, the database's clock, expired
rows purged by traffic and by ``taskdedup purge``, nothing left in the session (PgBouncer's
transaction pooling), the schema made and checked, and the URLs."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from harness import race, wait_for
from taskdedup import Deduplicator, Policy
from taskdedup.cli import cli
from taskdedup.errors import ConfigError
from taskdedup.stores import from_url
from taskdedup.stores.base import Acquire, Claim, Confirm, Finish, Inspect, Retry
from taskdedup.stores.postgres import PostgresStore
from taskdedup.stores.postgres_schema import WIDENED, functions
from taskdedup.stores.sql import SCHEMA_VERSION
from taskdedup.stores.sqlite import SqliteStore
from turns_proxy import TurnsProxy

HOUR = 3_600_000


def build(sha: str) -> None: ...


BUILD = Policy("until_executed").bind("ci.build", build)


@pytest.fixture
def pg(postgres_url: str, key_prefix: str) -> Iterator[PostgresStore]:
    store = PostgresStore(postgres_url, key_prefix=key_prefix)
    yield store
    store.close()


@pytest.fixture
def proxied(postgres_url: str, key_prefix: str) -> Iterator[tuple[PostgresStore, TurnsProxy]]:
    """A store whose every byte goes through a proxy that counts round trips."""
    info = psycopg.conninfo.conninfo_to_dict(postgres_url)
    if str(info.get("host", "")).startswith("/"):
        pytest.skip("the database listens on a socket only: nothing for a TCP proxy")
    proxy = TurnsProxy(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432))
    info.update(host="127.0.0.1", port=proxy.port)
    store = PostgresStore(psycopg.conninfo.make_conninfo(**info), key_prefix=key_prefix)
    store.run(Inspect("warm-up"))  # the schema made, a connection open
    yield store, proxy
    store.close()
    proxy.close()


def test_an_enqueue_a_duplicate_a_claim_and_a_finish_take_one_round_trip_each(
    proxied: tuple[PostgresStore, TurnsProxy],
) -> None:
    store, proxy = proxied
    race(4, lambda i: store.run(Inspect("warm-up")))  # the pool's connections, open
    dedup = Deduplicator(store)

    def trips(n: int) -> tuple[int, ...]:
        """One key's enqueue, duplicate, claim and finish, each counted. (A background
        thread, the confirmer's or the pool's, can add a turn to a window, or the proxy's
        threads be late to one: the count most of three runs agree on is the operation's.)"""
        first = dedup.enqueue(BUILD, (f"abc{n}",), job_id=f"j{n}")
        dedup.published(first)
        dedup.confirmer.flush()  # (the confirmation goes out in a batch of its own)
        enqueue = proxy.count(lambda: dedup.enqueue(BUILD, (f"new{n}",), job_id=f"n{n}"))
        duplicate = proxy.count(lambda: dedup.enqueue(BUILD, (f"abc{n}",), job_id=f"d{n}"))
        key, job = first.key, first.job_id
        claim = Claim(key, job, "w", 30_000, HOUR, "hold", False, HOUR, nonce=f"c{n}")  # type: ignore[arg-type]
        claimed = proxy.count(lambda: store.run(claim))
        finished = proxy.count(lambda: store.run(Finish(key, job, False, HOUR)))  # type: ignore[arg-type]
        return enqueue, duplicate, claimed, finished

    runs = [trips(n) for n in range(3)]
    print("round trips per run:", runs)
    enqueue, duplicate, claim, finish = (
        max(each, key=each.count) for each in zip(*runs, strict=True)
    )
    assert (enqueue, duplicate, claim, finish) == (1, 1, 1, 1)  # (the finish notes a duplicate)


def test_the_asyncio_path_takes_as_many(
    proxied: tuple[PostgresStore, TurnsProxy],
) -> None:
    store, proxy = proxied

    async def acquire() -> None:
        await store.arun(Acquire("warm", "j0", HOUR, HOUR))  # the loop's pool opened
        before = proxy.turns
        assert (await store.arun(Acquire("k", "j1", HOUR, HOUR))).acquired
        assert proxy.turns - before == 1
        before = proxy.turns
        await store.arun(Claim("k", "j1", "w", 30_000, HOUR, "hold", False, HOUR, 0))
        assert proxy.turns - before == 1
        await store.arun(Retry("k", "j1", HOUR, attempt=1))
        await store.arun(Confirm((("k", "j1"),)))
        before = proxy.turns  # off the path: the retry's claim writes in a second statement
        retried = await store.arun(Claim("k", "j1", "w", 30_000, HOUR, "hold", False, HOUR, 1))
        assert proxy.turns - before == 2 and retried.outcome == "run"
        before = proxy.turns
        assert (await store.arun(Finish("k", "j1", False, HOUR, attempt=1))).released
        assert proxy.turns - before == 1
        await store.aclose()

    asyncio.run(acquire())


def test_time_is_the_databases_clock(pg: PostgresStore) -> None:
    pg.run(Acquire("k", "j1", HOUR, HOUR))
    info = pg.run(Inspect("k"))
    with pg._pool().connection() as conn:
        row = conn.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
        db_now = row.fetchone()[0]  # type: ignore[index]
    assert info is not None and info.since_ms is not None
    assert 0 <= db_now - info.since_ms < 5_000


def test_nothing_is_left_in_the_session_for_a_pooler_to_carry_over(pg: PostgresStore) -> None:
    for i in range(20):  # past psycopg's threshold for preparing a statement (5)
        pg.run(Acquire(f"k{i}", "j", HOUR, HOUR))
    with pg._pool().connection() as conn:
        prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        timeout = conn.execute("SHOW statement_timeout").fetchone()
        locks = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()
    assert prepared == (0,) and timeout == ("0",) and locks == (0,)


def _rows(store: PostgresStore) -> int:
    with store._pool().connection() as conn:
        return int(conn.execute(f"SELECT count(*) FROM {store.table}").fetchone()[0])  # type: ignore[index]


def test_expired_rows_read_as_absent_at_once_and_purge_removes_them(pg: PostgresStore) -> None:
    for i in range(10):
        pg.run(Acquire(f"short{i}", "j", 200, 200))
    pg.run(Acquire("long", "j", HOUR, HOUR))
    wait_for(lambda: pg.run(Inspect("short9")) is None, 5, "the short locks to expire")
    assert pg.run(Acquire("short0", "j2", HOUR, HOUR)).acquired  # expired: free at once
    assert _rows(pg) == 11  # (short0 rewritten; nine expired rows still there)
    result = CliRunner().invoke(cli, ["purge", "--url", pg.conninfo, "--prefix", pg.prefix])
    assert result.exit_code == 0, result.output
    assert "9 expired row(s) removed" in result.output
    assert _rows(pg) == 2


def test_normal_traffic_purges_expired_rows_a_batch_at_a_time(pg: PostgresStore) -> None:
    for i in range(50):
        pg.run(Acquire(f"short{i}", "j", 100, 100))
    wait_for(lambda: pg.run(Inspect("short49")) is None, 5, "the short locks to expire")
    for i in range(70):  # one write in PURGE_EVERY (64) also purges
        pg.run(Acquire(f"long{i}", "j", HOUR, HOUR))
    assert _rows(pg) == 70


def test_the_schema_is_made_once_by_racing_processes_and_checked(
    postgres_url: str, key_prefix: str
) -> None:
    stores = [PostgresStore(postgres_url, key_prefix=key_prefix) for _ in range(8)]
    assert race(8, lambda i: stores[i].migrate()) == [SCHEMA_VERSION] * 8
    for store in stores:
        store.close()
    other = f"{key_prefix}-none"
    absent = PostgresStore(postgres_url, key_prefix=other, migrate=False)
    try:
        with pytest.raises(ConfigError, match="taskdedup migrate"):
            absent.run(Inspect("k"))
    finally:
        absent.close()


def test_migrate_on_the_command_line_is_idempotent(postgres_url: str, key_prefix: str) -> None:
    for _ in range(2):
        result = CliRunner().invoke(cli, ["migrate", "--url", postgres_url, "--prefix", key_prefix])
        assert result.exit_code == 0, result.output
    table = key_prefix.replace("-", "_")
    assert f"{table}_records: schema version {SCHEMA_VERSION}" in result.output
    doctor = CliRunner().invoke(cli, ["--url", postgres_url, "--prefix", key_prefix, "doctor"])
    assert "schema     " in doctor.output, doctor.output
    assert f"version {SCHEMA_VERSION}" in doctor.output, doctor.output


def test_urls_make_the_sql_stores_with_their_options(postgres_url: str, tmp_path: Path) -> None:
    joined = "&" if "?" in postgres_url else "?"
    pg = from_url(postgres_url + joined + "pool_size=3&timeout=2&synchronous_commit=on")
    assert isinstance(pg, PostgresStore)
    assert (pg.pool_size, pg.timeout, pg.synchronous_commit) == (3, 2.0, "on")
    lite = from_url(f"sqlite:///{tmp_path}/t.db", key_prefix="p")
    assert isinstance(lite, SqliteStore) and lite.path == f"{tmp_path}/t.db"
    assert isinstance(from_url("sqlite://"), SqliteStore)
    named = from_url(postgres_url + joined + "application_name=two%20words")
    try:  # libpq's options pass through as they were written (a space stays a space)
        with named._pool().connection() as conn:  # type: ignore[attr-defined]
            assert conn.execute("SHOW application_name").fetchone() == ("two words",)
    finally:
        named.close()


def test_a_sqlite_file_is_shared_by_processes_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    one = SqliteStore(str(path), key_prefix="p")
    two = SqliteStore(str(path), key_prefix="p")
    assert one.run(Acquire("k", "j1", HOUR, HOUR)).acquired
    assert two.run(Acquire("k", "j2", HOUR, HOUR)).holder == "j1"
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()
    assert mode == ("wal",)
    one.close()
    two.close()


def test_a_key_prefix_names_its_own_tables(postgres_url: str) -> None:
    prefix = f"td.Test-{uuid.uuid4().hex[:6]}"
    store = PostgresStore(postgres_url, key_prefix=prefix)
    try:
        store.run(Acquire("k", "j", HOUR, HOUR))
        assert store.table == prefix.lower().replace(".", "_").replace("-", "_") + "_records"
    finally:
        store.drop_tables()
        store.close()


def test_the_printed_migration_run_by_hand_is_what_the_store_needs(
    postgres_url: str, key_prefix: str
) -> None:
    """A team's own migration (``taskdedup migrate --sql``, run as it is) satisfies a store
    that is told not to migrate."""
    printed = CliRunner().invoke(cli, ["migrate", "--sql", "--prefix", key_prefix])
    assert printed.exit_code == 0, printed.output
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        for statement in printed.output.split(";\n\n"):
            if statement.strip():
                conn.execute(statement)
    store = PostgresStore(postgres_url, key_prefix=key_prefix, migrate=False)
    try:
        assert store.run(Acquire("k", "j", HOUR, HOUR)).acquired
    finally:
        store.close()


def test_after_a_restart_the_dead_pooled_connections_are_replaced_at_once(key_prefix: str) -> None:
    """A process whose pool held several connections when the database restarted: its next
    calls are answered (the first failure drops every dead connection, then runs again)."""
    from postgres_server import PrivatePostgres

    server = PrivatePostgres().start()
    store = PostgresStore(server.url, key_prefix=key_prefix, pool_size=4)
    try:
        race(4, lambda i: store.run(Acquire(f"k{i}", "j", HOUR, HOUR)))  # four connections
        server.down()
        server.up()
        replies = [store.run(Acquire(f"k{i}", "j2", HOUR, HOUR)) for i in range(4)]
        assert [r.holder for r in replies] == ["j"] * 4  # the locks survived, and it answers
    finally:
        store.close()
        server.stop()


def test_behind_pgbouncer_in_transaction_pooling_64_threads_take_one_lock(
    postgres_url: str, key_prefix: str
) -> None:
    """Sixty-four threads through PgBouncer (transaction pooling, two server connections,
    so successive transactions of one client land on different sessions): one acquires,
    and the claim and finish that follow work as on a direct connection."""
    import shutil

    from postgres_server import PgBouncer

    if shutil.which("pgbouncer") is None:
        pytest.skip("no pgbouncer on PATH (Debian: apt install pgbouncer)")
    if str(psycopg.conninfo.conninfo_to_dict(postgres_url).get("host", "")).startswith("/"):
        pytest.skip("the database listens on a socket only")
    bouncer = PgBouncer(postgres_url)
    store = PostgresStore(bouncer.url, key_prefix=key_prefix, pool_size=20)
    try:
        replies = race(64, lambda i: store.run(Acquire("k", f"j{i}", HOUR, HOUR)))
        winners = [r.holder for r in replies if r.acquired]
        assert len(winners) == 1 and {r.holder for r in replies} == set(winners)
        claim = store.run(Claim("k", winners[0], "w", 30_000, HOUR, "hold", False, HOUR))
        assert claim.outcome == "run"
        assert store.run(Finish("k", winners[0], False, HOUR)).released
        assert store.run(Inspect("k")) is None
    finally:
        store.close()
        bouncer.stop()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_the_operators_commands_work_on_the_sql_stores(
    kind: str, store_url: Any, key_prefix: str
) -> None:
    url = store_url(kind)
    store = from_url(url, key_prefix=key_prefix)
    dedup = Deduplicator(store)
    ticket = dedup.enqueue(BUILD, ("abc",), job_id="j1")
    dedup.published(ticket)
    dedup.close()
    base = ["--url", url, "--prefix", key_prefix]

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, [*base, *args])
        assert result.exit_code == 0, result.output
        return result.output

    assert "j1" in run("locks") and "ci.build" in run("locks", "--json")
    assert "j1" in run("show", str(ticket.key))
    assert "ci.build" in run("stats")
    assert run("explain", str(ticket.key))
    assert "freed" in run("unlock", str(ticket.key), "--yes")
    assert "0 lock(s)" in run("locks")
    store.close()


def test_a_redelivered_copy_takes_the_longer_way_and_keeps_the_answers(pg: PostgresStore) -> None:
    """Off the ordinary path (a record of the job exists: a redelivery), the one-statement
    claim writes nothing and the open/save path answers, as the contract says."""
    pg.run(Acquire("k", "j1", HOUR, HOUR))
    first = pg.run(Claim("k", "j1", "w1", 30_000, HOUR, "hold", False, HOUR, nonce="n1"))
    again = pg.run(Claim("k", "j1", "w1", 30_000, HOUR, "hold", False, HOUR, nonce="n1"))
    copy = pg.run(Claim("k", "j1", "w2", 30_000, HOUR, "hold", False, HOUR, nonce="n2"))
    assert (first.outcome, again.outcome, copy.outcome) == ("run", "run", "running")
    assert again.fence == first.fence and copy.holder == "w1"


def test_off_the_ordinary_path_a_claim_and_a_finish_take_two_round_trips(
    proxied: tuple[PostgresStore, TurnsProxy],
) -> None:
    """A retry's next attempt, a redelivered copy of a finished job and an attempt that a
    newer one overtook are off the one-statement path: the function writes nothing and
    answers the rows it read; the transition's writes go out in a second statement (none
    when it writes nothing). Each is counted on the wire, the answers are the contract's."""
    store, proxy = proxied
    race(4, lambda i: store.run(Inspect("warm-up")))

    def claim(key: str, job: str, attempt: int, nonce: str) -> Claim:
        return Claim(key, job, "w", 30_000, HOUR, "hold", False, HOUR, attempt, nonce=nonce)  # type: ignore[arg-type]

    def trips(n: int) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        key, job = f"k{n}", f"j{n}"
        store.run(Acquire(key, job, HOUR, HOUR))
        store.run(claim(key, job, 0, f"a{n}"))
        store.run(Retry(key, job, HOUR, attempt=1))  # attempt 0 failed and is retried
        store.run(Confirm(((key, job),)))  # (its retry went out)
        answers: list[Any] = []

        def run(op: Any) -> None:
            answers.append(store.run(op))

        retried = proxy.count(lambda: run(claim(key, job, 1, f"b{n}")))  # its next attempt
        stale = proxy.count(lambda: run(Finish(key, job, False, HOUR, attempt=0)))
        done = proxy.count(lambda: run(Finish(key, job, False, HOUR, attempt=1)))
        copy = proxy.count(lambda: run(claim(key, job, 1, f"c{n}")))  # a redelivered copy
        return (retried, stale, done, copy), tuple(
            getattr(a, "outcome", getattr(a, "released", None)) for a in answers
        )

    runs = [trips(n) for n in range(3)]
    print("round trips and answers per run:", runs)
    counts = tuple(max(each, key=each.count) for each in zip(*[r[0] for r in runs], strict=True))
    assert runs[0][1] == ("run", False, True, "done")
    # (the stale finish and the last one write nothing off the path; the copy's discard is
    # written to the job's record; the general way alone would have cost 3 for each)
    assert counts == (2, 1, 1, 2)


def test_rows_changed_between_the_two_statements_send_it_the_general_way(
    pg: PostgresStore,
) -> None:
    """The second statement writes only if the rows are still the ones the first read:
    here another writer changes them in between (a stand-in for a concurrent claim), the
    write is refused, and the operation runs again the general way on the new rows."""
    from taskdedup.stores import postgres_ops

    pg.run(Acquire("k", "j1", HOUR, HOUR))
    pg.run(Claim("k", "j1", "w1", 30_000, HOUR, "hold", False, HOUR, 0, nonce="n1"))
    pg.run(Retry("k", "j1", HOUR, attempt=1))
    pg.run(Confirm((("k", "j1"),)))
    real = postgres_ops._Call.closing_if
    seen: list[Any] = []

    def meddle(call: Any, read: Any) -> Any:
        save = real(call, read)
        if not seen:  # the first time only: another writer renews the lock in between
            with pg._pool().connection() as conn:
                conn.execute(
                    f"UPDATE {pg.where}{pg.table} SET expires_at = expires_at + 1 "
                    "WHERE tag = 'k' AND part = 'lock'"
                )
        seen.append(save)
        return save

    postgres_ops._Call.closing_if = meddle  # type: ignore[method-assign]
    try:
        again = pg.run(Claim("k", "j1", "w2", 30_000, HOUR, "hold", False, HOUR, 1, nonce="n2"))
    finally:
        postgres_ops._Call.closing_if = real  # type: ignore[method-assign]
    assert len(seen) == 1 and seen[0] is not None  # it had writes, and they were refused
    assert again.outcome == "run" and again.holder == "w2"
    info = pg.run(Inspect("k"))
    assert info is not None and info.state == "running"


def test_a_version_1_schema_is_upgraded_and_a_newer_one_refused(
    postgres_url: str, key_prefix: str
) -> None:
    """Version 2 widened the claim and finish functions' answers (CREATE OR REPLACE cannot):
    a database left at version 1 is upgraded on first use; one newer than this taskdedup is
    an error that says what to do, never a downgrade."""
    store = PostgresStore(postgres_url, key_prefix=key_prefix)
    store.run(Inspect("k"))  # made at the current version
    f = functions(store.prefix, store.where)
    with store._pool().connection() as conn:  # as version 1 left them
        conn.execute(f"DROP FUNCTION {f.claim}")
        conn.execute(f"DROP FUNCTION {f.finish}")
        for name, answer in (
            (f.claim, "o_outcome text, o_fence bigint"),
            (f.finish, "o_outcome text"),
        ):
            signature = WIDENED[name.rsplit("_", 1)[1]]
            conn.execute(
                f"CREATE FUNCTION {name}({signature}) RETURNS TABLE ({answer}) "
                "LANGUAGE plpgsql AS $$ BEGIN RETURN; END $$"
            )
        conn.execute(f"DELETE FROM {store.where}{store.version_table}")
        conn.execute(f"INSERT INTO {store.where}{store.version_table} VALUES (1)")
        conn.commit()
    store.close()
    upgraded = PostgresStore(postgres_url, key_prefix=key_prefix)
    try:
        upgraded.run(Acquire("k", "j1", HOUR, HOUR))
        assert upgraded.schema_version() == SCHEMA_VERSION
        first = upgraded.run(Claim("k", "j1", "w", 30_000, HOUR, "hold", False, HOUR, 0, nonce="a"))
        upgraded.run(Retry("k", "j1", HOUR, attempt=1))
        upgraded.run(Confirm((("k", "j1"),)))
        retry = upgraded.run(Claim("k", "j1", "w", 30_000, HOUR, "hold", False, HOUR, 1, nonce="b"))
        assert (first.outcome, retry.outcome) == ("run", "run")
        assert upgraded.run(Finish("k", "j1", False, HOUR, attempt=1)).released
        with upgraded._pool().connection() as conn:
            newer = SCHEMA_VERSION + 1
            conn.execute(f"INSERT INTO {upgraded.where}{upgraded.version_table} VALUES ({newer})")
            conn.commit()
    finally:
        upgraded.close()
    older = PostgresStore(postgres_url, key_prefix=key_prefix)
    try:
        with pytest.raises(ConfigError, match="newer than this taskdedup knows"):
            older.run(Inspect("k"))
    finally:
        older.close()
