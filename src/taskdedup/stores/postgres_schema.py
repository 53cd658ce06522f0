"""The PostgreSQL schema: the records table (``sql.schema``) and the functions operations call.

The general way is two short statements: ``<base>_open`` (lock the keys, read the clock and
the rows) and ``<base>_save`` (write the changes, purge a batch of expired rows). The common
operations each have a one-statement twin of their ordinary path (``_acquire``, ``_claim``,
``_finish``, ``_confirm``). Off that path ``_claim`` and ``_finish`` write nothing and answer
the rows they read with a digest (``_seen``); the caller's writes then go out only if the
rows still match it (``_save_if``): two statements in all.

Functions rather than statements sent each time: PL/pgSQL plans its queries once per server
connection, with no prepared statement in the session (so PgBouncer's transaction pooling is
fine), where a fresh statement is planned on every call (about 0.6 ms of an operation here).
"""

from __future__ import annotations

from typing import NamedTuple

from .base import HISTORY_MS, HISTORY_SIZE
from .sql import SCHEMA_VERSION, schema, tables

#: How each function starts: its waits bounded by the store's ``timeout`` and its commit's
#: ``synchronous_commit`` set, for its own transaction only (``set_config(..., true)``);
#: NULL for the caller's own transaction, whose settings stay as they are.
SETTINGS = """  IF wait_ms IS NOT NULL THEN
    PERFORM set_config('lock_timeout', wait_ms, true);
    PERFORM set_config('statement_timeout', wait_ms, true);
    PERFORM set_config('synchronous_commit', sync, true);
  END IF;
"""


#: How a one-statement function on one key starts: its settings, the key's advisory lock (the
#: transaction's), then the database's clock read after it.
BEGIN_KEY = (
    SETTINGS
    + """  PERFORM pg_advisory_xact_lock(cls, hashtext(k));
  now_us := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
  now_ms := now_us / 1000;
"""
)


def _read_job_and_lock(table: str) -> str:
    """The claim's and the finish's reads: the job's live record (jb) and the key's live
    lock (lb), each NULL when absent or expired."""
    return f"""  SELECT r.body::jsonb INTO jb FROM {table} AS r
    WHERE r.tag = k AND r.part = 'job:' || job AND r.expires_at > now_ms;
  SELECT r.body::jsonb INTO lb FROM {table} AS r
    WHERE r.tag = k AND r.part = 'lock' AND r.expires_at > now_ms;"""


def qualifier(schema_name: str) -> str:
    """``"name".``: what starts every name of ours, so that a session with another search
    path (a caller's transaction we join: a tenant's schema, a test's) finds them."""
    return '"' + schema_name.replace('"', '""') + '".'


class Functions(NamedTuple):
    """The qualified names of a prefix's functions."""

    open: str
    save: str
    acquire: str
    claim: str
    finish: str
    note: str
    confirm: str
    seen: str
    save_if: str


def functions(key_prefix: str, where: str = "") -> Functions:
    """The names of ``key_prefix``'s functions (``<base>_open``, ...)."""
    base = where + tables(key_prefix)[0].removesuffix("_records")
    return Functions(*(f"{base}_{name}" for name in Functions._fields))


#: The signatures whose answers version 2 widened (CREATE OR REPLACE cannot change them).
WIDENED = {
    "claim": "int, text, text, text, bigint, bigint, bigint, text, text, text, text, boolean, "
    "boolean",
    "finish": "int, text, text, boolean, bigint, bigint, text, text, boolean, boolean",
}


def _widen(name: str, signature: str) -> str:
    """Drop a version-1 function whose answer version 2 widened (``o_seen``, ``o_rows`` added
    at the end, so a version-1 client reading the first columns still works): once only."""
    return f"""DO $$ BEGIN
  IF to_regprocedure('{name}({signature})') IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_proc
      WHERE oid = to_regprocedure('{name}({signature})') AND 'o_rows' = ANY(proargnames)) THEN
    DROP FUNCTION {name}({signature});
  END IF;
END $$"""


def postgres_schema(key_prefix: str, where: str) -> list[str]:
    """Every statement of the current schema, each safe to run again."""
    t = where + tables(key_prefix)[0]
    f = functions(key_prefix, where)
    open_, save, acquire, claim, finish, note, confirm = f[:7]
    return [
        *schema(key_prefix, where=where),
        *(_widen(getattr(f, name), signature) for name, signature in WIDENED.items()),
        f"""CREATE OR REPLACE FUNCTION {f.seen}(tags text[], jtags text[], jparts text[])
RETURNS text LANGUAGE sql STABLE AS $$
-- The rows <base>_open reads (the keys' own rows but their jobs', the jobs named, the job of
-- each key's lock and run holder) as one JSON text in a set order: what a one-statement
-- function read before it answered 'fallback', and what <base>_save_if compares with.
  SELECT coalesce(json_agg(json_build_array(x.tag, x.part, x.body, x.expires_at)
    ORDER BY x.tag, x.part), '[]')::text FROM (
    SELECT r.tag, r.part, r.body, r.expires_at FROM {t} AS r
      WHERE r.tag = ANY(tags) AND r.part NOT LIKE 'job:%'
    UNION
    SELECT r.tag, r.part, r.body, r.expires_at FROM {t} AS r
      JOIN unnest(jtags, jparts) AS w(tag, part) ON r.tag = w.tag AND r.part = w.part
    UNION
    SELECT j.tag, j.part, j.body, j.expires_at FROM {t} AS l JOIN {t} AS j
      ON j.tag = l.tag AND j.part = 'job:' || (l.body::json ->> 'j')
      WHERE l.tag = ANY(tags) AND l.part IN ('lock', 'run')) AS x
$$""",
        f"""CREATE OR REPLACE FUNCTION {confirm}(cls int, keys text[], jobs text[], wait_ms text,
    sync text)
RETURNS bigint LANGUAGE plpgsql AS $$
-- A batch of published locks confirmed (transitions.confirm's twin): each still queued and
-- unconfirmed lock of its job lives until its ttl; a retry's job record learns that its retry
-- went out. Answers how many locks were confirmed.
DECLARE
  h int;
  now_ms bigint;
  n bigint;
BEGIN
{SETTINGS}  FOR h IN SELECT DISTINCT hashtext(k) FROM unnest(keys) AS k ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(cls, h);
  END LOOP;
  now_ms := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
  UPDATE {t} AS r SET body = (r.body::jsonb || '{{"c": 1}}'::jsonb)::text
    FROM unnest(keys, jobs) AS w(k, j)
    WHERE r.tag = w.k AND r.part = 'job:' || w.j AND r.expires_at > now_ms
      AND r.body::jsonb->>'s' = 'q';
  WITH done AS (
    UPDATE {t} AS r SET body = (r.body::jsonb || '{{"c": 1}}'::jsonb)::text,
      expires_at = (r.body::jsonb->>'e')::bigint
    FROM unnest(keys, jobs) AS w(k, j)
    WHERE r.tag = w.k AND r.part = 'lock' AND r.expires_at > now_ms
      AND r.body::jsonb->>'j' = w.j AND r.body::jsonb->>'s' = 'q'
      AND (r.body::jsonb->>'c')::int = 0
    RETURNING 1)
  SELECT count(*) INTO n FROM done;
  RETURN n;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {note}(k text, entry text, now_ms bigint)
RETURNS void LANGUAGE plpgsql AS $$
-- One entry at the head of the key's decision history (history.remember_event's twin):
-- newest first, at most {HISTORY_SIZE}, kept {HISTORY_MS} ms after the last.
DECLARE
  v jsonb;
BEGIN
  SELECT r.body::jsonb->'v' INTO v FROM {t} AS r
    WHERE r.tag = k AND r.part = 'log' AND r.expires_at > now_ms;
  v := jsonb_build_array(entry) || coalesce(v, '[]'::jsonb);
  IF jsonb_array_length(v) > {HISTORY_SIZE} THEN
    v := (SELECT jsonb_agg(e ORDER BY i) FROM jsonb_array_elements(v) WITH ORDINALITY AS x(e, i)
      WHERE i <= {HISTORY_SIZE});
  END IF;
  INSERT INTO {t} AS r (tag, part, body, expires_at)
    VALUES (k, 'log', jsonb_build_object('v', v)::text, now_ms + {HISTORY_MS})
    ON CONFLICT (tag, part) DO UPDATE SET body = excluded.body,
      expires_at = excluded.expires_at;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {claim}(cls int, k text, job text, owner text,
    lease bigint, memory bigint, attempt bigint, nonce text, mode text, wait_ms text,
    sync text, history boolean, handoff boolean)
RETURNS TABLE (o_outcome text, o_fence bigint, o_seen text, o_rows text)
LANGUAGE plpgsql AS $$
-- A job's first claim in one statement (transitions.claim's twin on its ordinary path: no
-- record of the job yet, its own queued lock, no debounce, no run owed to hand the lock to).
-- Anything else (a redelivery, a stale copy, a debounced run, a hand-off) writes nothing and
-- answers 'fallback' with the rows <base>_open would read (the clock first) and their
-- digest: the caller runs the shared transition on them and writes with <base>_save_if.
DECLARE
  now_us bigint;
  now_ms bigint;
  jb jsonb;
  lb jsonb;
  fence bigint;
  v text;
BEGIN
{BEGIN_KEY}{_read_job_and_lock(t)}
  IF nonce <> '' AND jb->>'k' = nonce AND jb->>'s' = 'r' AND (jb->>'a')::int = 1 THEN
    -- this very claim, sent again (its reply was lost with its connection): its answer
    RETURN QUERY SELECT 'run'::text, (jb->>'f')::bigint, NULL::text, NULL::text;
    RETURN;
  END IF;
  IF jb IS NOT NULL OR lb IS NULL OR lb->>'j' <> job OR lb->>'s' <> 'q' OR lb ? 'u'
     OR (mode = 'release' AND handoff AND (lb->>'d')::bigint > 0) THEN
    v := {f.seen}(ARRAY[k], ARRAY[k], ARRAY['job:' || job]);
    RETURN QUERY SELECT 'fallback'::text, now_us, md5(v), v;
    RETURN;
  END IF;
  fence := (lb->>'f')::bigint;
  IF mode = 'hold' THEN  -- it was published: it runs
    UPDATE {t} AS r SET body = (lb || '{{"s": "r", "c": 1}}'::jsonb)::text,
      expires_at = now_ms + lease WHERE r.tag = k AND r.part = 'lock';
  ELSIF mode = 'release' THEN  -- the duplicates it answered go to the key's history
    IF history AND (lb->>'d')::bigint > 0 THEN
      PERFORM {note}(k, now_ms || ' deduplicated ' || coalesce(lb->>'l', '-') || ' ' || job
        || ' ' || (lb->>'d'), now_ms);
    END IF;
    DELETE FROM {t} AS r WHERE r.tag = k AND r.part = 'lock';
  END IF;
  INSERT INTO {t} AS r (tag, part, body, expires_at) VALUES (k, 'job:' || job,
    jsonb_build_object('s', 'r', 'o', owner, 'u', now_ms + lease, 'a', 1, 'n', attempt,
      'f', fence, 'm', memory, 'k', nonce, 'l', 0, 'b', now_ms)::text,
    now_ms + lease + memory)
    ON CONFLICT (tag, part) DO UPDATE SET body = excluded.body,
      expires_at = excluded.expires_at;
  RETURN QUERY SELECT 'run'::text, fence, NULL::text, NULL::text;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {finish}(cls int, k text, job text, throttle boolean,
    memory bigint, attempt bigint, wait_ms text, sync text, history boolean, handoff boolean)
RETURNS TABLE (o_outcome text, o_now bigint, o_seen text, o_rows text)
LANGUAGE plpgsql AS $$
-- A job's end in one statement (transitions.finish's twin on its ordinary path: not stale,
-- no run owed to hand the lock to, no stop asked). Anything else writes nothing and answers
-- 'fallback' with the rows and their digest, as <base>_claim does.
DECLARE
  now_us bigint;
  now_ms bigint;
  jb jsonb;
  lb jsonb;
  v text;
BEGIN
{BEGIN_KEY}{_read_job_and_lock(t)}
  IF (attempt IS NOT NULL AND jb->>'n' IS NOT NULL AND attempt < (jb->>'n')::bigint)
     OR (lb->>'j' = job AND (lb ? 'x' OR (handoff AND (lb->>'d')::bigint > 0))) THEN
    v := {f.seen}(ARRAY[k], ARRAY[k], ARRAY['job:' || job]);
    RETURN QUERY SELECT 'fallback'::text, now_us, md5(v), v;
    RETURN;
  END IF;
  IF jb ? 's' THEN  -- done: remembered for redelivered copies
    UPDATE {t} AS r SET body = (jb || '{{"s": "d"}}'::jsonb)::text,
      expires_at = now_ms + memory WHERE r.tag = k AND r.part = 'job:' || job;
  ELSE
    INSERT INTO {t} AS r (tag, part, body, expires_at) VALUES (k, 'job:' || job,
      jsonb_build_object('s', 'd', 'o', '', 'a', 1, 'n', attempt, 'f', 0, 'm', 0)::text,
      now_ms + memory)
      ON CONFLICT (tag, part) DO UPDATE SET body = excluded.body,
        expires_at = excluded.expires_at;
  END IF;
  IF jb IS NULL OR coalesce((jb->>'l')::int, 1) <> 0 THEN  -- the run lock, if this run's
    DELETE FROM {t} AS r WHERE r.tag = k AND r.part = 'run' AND r.body::jsonb->>'j' = job;
  END IF;
  IF lb IS NULL OR lb->>'j' <> job THEN
    RETURN QUERY SELECT 'kept'::text, now_us, NULL::text, NULL::text;  -- not its lock
    RETURN;
  END IF;
  IF history AND (lb->>'d')::bigint > 0 THEN  -- the duplicates it answered, in the history
    PERFORM {note}(k, now_ms || ' deduplicated ' || coalesce(lb->>'l', '-') || ' ' || job
      || ' ' || (lb->>'d'), now_ms);
  END IF;
  IF throttle AND (lb->>'e')::bigint > now_ms THEN  -- until_expired: held until its ttl
    UPDATE {t} AS r SET body = (lb || '{{"s": "t"}}'::jsonb)::text,
      expires_at = (lb->>'e')::bigint WHERE r.tag = k AND r.part = 'lock';
  ELSE
    DELETE FROM {t} AS r WHERE r.tag = k AND r.part = 'lock';
  END IF;
  RETURN QUERY SELECT 'released'::text, now_us, NULL::text, NULL::text;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {acquire}(cls int, k text, job text, ttl bigint,
    grace bigint, counted boolean, task text, wait_ms text, sync text, purge_n int,
    peek boolean)
RETURNS TABLE (o_acquired boolean, o_holder text, o_fence bigint, o_dups bigint,
    o_pending boolean, o_running boolean)
LANGUAGE plpgsql AS $$
-- An enqueue's acquire in one statement (transitions.acquire's twin, for a call with no
-- debounce, no cancel and no payload; the others take the open/save path): the key's lock,
-- then its lock row read, counted as a duplicate or written as new. With peek, a look before
-- the acquire (transitions.peek's twin): a free key answers no row and takes nothing.
DECLARE
  now_us bigint;
  now_ms bigint;
  b jsonb;
  expires bigint;
BEGIN
{BEGIN_KEY}  IF purge_n > 0 THEN  -- a batch of expired rows, as <prefix>_save removes one
    DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t}
      WHERE expires_at <= now_ms LIMIT purge_n FOR UPDATE SKIP LOCKED));
  END IF;
  SELECT r.body::jsonb, r.expires_at INTO b, expires FROM {t} AS r
    WHERE r.tag = k AND r.part = 'lock';
  IF b IS NOT NULL AND expires > now_ms AND peek THEN
    IF b->>'s' = 'q' AND (b->>'c')::int = 0 THEN  -- a holder that may yet fail: not counted
      RETURN QUERY SELECT false, b->>'j', (b->>'f')::bigint, (b->>'d')::bigint, true, false;
      RETURN;
    END IF;
    IF counted THEN  -- (no job id was made for it)
      b := b || jsonb_build_object('d', (b->>'d')::bigint + 1, 'l', '-');
      UPDATE {t} AS r SET body = b::text WHERE r.tag = k AND r.part = 'lock';
    END IF;
    RETURN QUERY SELECT false, b->>'j', (b->>'f')::bigint, (b->>'d')::bigint, false, false;
    RETURN;
  END IF;
  IF peek THEN
    RETURN;  -- free: nothing taken
  END IF;
  IF b IS NOT NULL AND expires > now_ms THEN
    IF b->>'j' = job THEN  -- the holder again: no change
      RETURN QUERY SELECT true, job, (b->>'f')::bigint, (b->>'d')::bigint, false, false;
      RETURN;
    END IF;
    IF counted THEN  -- one more duplicate, the latest one's id kept
      b := b || jsonb_build_object('d', (b->>'d')::bigint + 1, 'l', job);
      UPDATE {t} AS r SET body = b::text WHERE r.tag = k AND r.part = 'lock';
    END IF;
    RETURN QUERY SELECT false, b->>'j', (b->>'f')::bigint, (b->>'d')::bigint,
      b->>'s' = 'q' AND (b->>'c')::int = 0, b->>'s' = 'r';
    RETURN;
  END IF;
  b := jsonb_build_object('j', job, 's', 'q', 'f', now_us, 'd', 0, 'e', now_ms + ttl,
    'c', CASE WHEN grace >= ttl THEN 1 ELSE 0 END, 't', task, 'a', now_ms);
  INSERT INTO {t} AS r (tag, part, body, expires_at)
    VALUES (k, 'lock', b::text, now_ms + least(grace, ttl))
    ON CONFLICT (tag, part) DO UPDATE SET body = excluded.body,
      expires_at = excluded.expires_at;
  RETURN QUERY SELECT true, job, now_us, 0::bigint, false, false;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {open_}(cls int, tags text[], jtags text[],
    jparts text[], wait_ms text, sync text)
RETURNS TABLE (o_tag text, o_part text, o_body text, o_expires bigint)
LANGUAGE plpgsql AS $$
-- Lock the keys (sorted: no two callers wait on each other in a circle), then read the
-- clock (the first row) and the rows: the keys' own rows but their jobs', the jobs named,
-- and the job of each key's lock and run holder. Each query sees what was committed
-- before the locks were taken (a volatile function's statements take fresh snapshots).
DECLARE h int;
BEGIN
{SETTINGS}  FOR h IN SELECT DISTINCT hashtext(k) FROM unnest(tags) AS k ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(cls, h);
  END LOOP;
  RETURN QUERY SELECT NULL::text, NULL::text, NULL::text,
    (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
  RETURN QUERY SELECT r.tag, r.part, r.body, r.expires_at FROM {t} AS r
    WHERE r.tag = ANY(tags) AND r.part NOT LIKE 'job:%';
  RETURN QUERY SELECT r.tag, r.part, r.body, r.expires_at FROM {t} AS r
    JOIN unnest(jtags, jparts) AS w(tag, part) ON r.tag = w.tag AND r.part = w.part;
  RETURN QUERY SELECT j.tag, j.part, j.body, j.expires_at FROM {t} AS l JOIN {t} AS j
    ON j.tag = l.tag AND j.part = 'job:' || (l.body::json ->> 'j')
    WHERE l.tag = ANY(tags) AND l.part IN ('lock', 'run');
END $$""",
        f"""CREATE OR REPLACE FUNCTION {save}(tags text[], parts text[], bodies text[],
    exps bigint[], dtags text[], dparts text[], purge_before bigint, purge_n int)
RETURNS void LANGUAGE plpgsql AS $$
-- Write the rows an operation changed, delete the ones it dropped, and maybe remove a
-- batch of expired rows (skipping any another transaction holds).
BEGIN
  IF cardinality(tags) > 0 THEN
    INSERT INTO {t} AS r (tag, part, body, expires_at)
      SELECT * FROM unnest(tags, parts, bodies, exps)
      ON CONFLICT (tag, part) DO UPDATE SET body = excluded.body,
        expires_at = excluded.expires_at;
  END IF;
  IF cardinality(dtags) > 0 THEN
    DELETE FROM {t} AS r USING unnest(dtags, dparts) AS d(tag, part)
      WHERE r.tag = d.tag AND r.part = d.part;
  END IF;
  IF purge_n > 0 THEN
    DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t}
      WHERE expires_at <= purge_before LIMIT purge_n FOR UPDATE SKIP LOCKED));
  END IF;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {f.save_if}(cls int, tags text[], jtags text[],
    jparts text[], seen text, wtags text[], wparts text[], bodies text[], exps bigint[],
    dtags text[], dparts text[], purge_before bigint, purge_n int, wait_ms text, sync text)
RETURNS boolean LANGUAGE plpgsql AS $$
-- The second round trip after a one-statement function answered 'fallback': lock the keys
-- again and, if their rows are still the ones it read (the digest it answered), write the
-- shared transition's changes as <base>_save does; else write nothing and answer false (the
-- caller then takes the open/save way).
DECLARE h int;
BEGIN
{SETTINGS}  FOR h IN SELECT DISTINCT hashtext(x) FROM unnest(tags) AS x ORDER BY 1 LOOP
    PERFORM pg_advisory_xact_lock(cls, h);
  END LOOP;
  IF md5({f.seen}(tags, jtags, jparts)) IS DISTINCT FROM seen THEN
    RETURN false;
  END IF;
  PERFORM {save}(wtags, wparts, bodies, exps, dtags, dparts, purge_before, purge_n);
  RETURN true;
END $$""",
    ]


def migration(key_prefix: str = "taskdedup", schema_name: str = "public") -> list[str]:
    """What ``taskdedup migrate`` runs, for a team that runs its own migrations (a Django
    ``RunSQL`` of each, an Alembic ``op.execute`` of each): the table, its index, the two
    functions and the version row. Idempotent; then give the store ``migrate=0``."""
    where = qualifier(schema_name)
    version = where + tables(key_prefix)[1]
    return [
        *postgres_schema(key_prefix, where),
        f"INSERT INTO {version} (version) SELECT {SCHEMA_VERSION} WHERE NOT EXISTS "
        f"(SELECT 1 FROM {version} WHERE version >= {SCHEMA_VERSION})",
    ]


class Queries:
    """The statements an operation sends (the functions above do the work)."""

    def __init__(self, key_prefix: str, where: str) -> None:
        t = where + tables(key_prefix)[0]
        open_, save, acquire, claim, finish, _, confirm, _, save_if = functions(key_prefix, where)
        self.confirm = f"SELECT {confirm}(%s, %s, %s, %s, %s)"
        self.claim = f"SELECT * FROM {claim}({', '.join(['%s'] * 13)})"
        self.finish = f"SELECT * FROM {finish}(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
        self.acquire = f"SELECT * FROM {acquire}(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
        self.open = f"SELECT * FROM {open_}(%s, %s::text[], %s::text[], %s::text[], %s, %s)"
        self.save = (
            f"SELECT {save}(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[], "
            "%s::text[], %s, %s)"
        )
        self.save_if = f"SELECT {save_if}({', '.join(['%s'] * 15)})"
        #: the tools' scans: the clock, then every live row (no locks)
        self.all = (
            "SELECT NULL, NULL, NULL, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
            f" UNION ALL SELECT tag, part, body, expires_at FROM {t} "
            "WHERE expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
        )
        #: ``taskdedup purge``: a batch of expired rows (skipping any another transaction holds)
        self.purge = (
            f"DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE expires_at <= "
            "(extract(epoch FROM clock_timestamp()) * 1000)::bigint LIMIT %s FOR UPDATE SKIP "
            "LOCKED))"
        )
