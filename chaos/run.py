"""The soak: servers, workers, producers, faults on a schedule, drain, then the invariants.

The store is a private redis-server (``--store redis``, the default) or a private PostgreSQL
(``--store postgres``); the broker and the records server are redis-servers either way. What
the soak checks does not depend on the store: only how the store is faulted (PostgreSQL is not
stalled, see :class:`chaos.servers.PostgresServer`) and how its held locks are read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from . import check
from .config import (
    ACKED,
    DEBOUNCE_DELAY,
    DEBOUNCE_MAX_WAIT,
    EXCLUSIVE,
    GRACE,
    HELD,
    KINDS,
    LEASE,
    LEDGER,
    MESSAGES,
    NEWEST,
    POPPED,
    PUBLISHED,
    PUBLISHES,
    RECEIVED,
    RUNNING,
    RUNS,
    STORE_PREFIX,
    signature,
    task_name,
)
from .procs import ROOT, Worker, kill_pid, start_producer, wait_gone
from .servers import PostgresServer, RedisServer

EXCLUSIVE_TASKS = {task_name(s) for s in EXCLUSIVE}
NEWEST_TASKS = {task_name(s) for s in NEWEST}
#: seconds after a burst's first submission past which a debounced run is late (check.lapsed_jobs)
LAPSE = {task_name("debounce"): DEBOUNCE_MAX_WAIT + GRACE}


@dataclasses.dataclass
class Options:
    seconds: float = 180.0
    producers: int = 4
    rate: float = 4.0  # submissions per second per producer (before immediate repeats)
    names: int = 75  # names per task: 7 x 75 = 525 keys
    workers: int = 2
    kill_every: float = 4.0
    stall_seconds: float = 3.0
    outage_seconds: float = 3.0
    drain_timeout: float = 120.0
    seed: int = 0
    dedup: bool = True
    faults: bool = True  # store stall and stop, broker restart
    store: str = "redis"  # the store's server: "redis" or "postgres" (STORES)
    output: Path = ROOT / "chaos" / "last-run.json"
    keep_logs: bool = False

    @classmethod
    def short(cls) -> Options:
        return cls(seconds=90.0, rate=3.5, names=60, kill_every=3.5, drain_timeout=75.0)


#: the stores the soak can run on (``--store``)
STORES = ("redis", "postgres")
#: How long a worker that said Celery gave up may take to exit (its warm shutdown lets the
#: bodies running end: a few seconds) before the supervisor's kill -9, as systemd's
#: TimeoutStopSec would.
WORKER_STOP_TIMEOUT = 20.0
#: Seconds the drain waits with messages pending and nothing moving before it restarts the
#: workers (a liveness probe's failure threshold; ETAs and retries here are a few seconds).
NO_PROGRESS = 15.0


def say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Soak:
    def __init__(self, options: Options) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.logs = Path(tempfile.mkdtemp(prefix="taskdedup-chaos-logs-"))
        if options.store not in STORES:
            raise ValueError(f"unknown store {options.store!r}: one of {', '.join(STORES)}")
        self.store: RedisServer | PostgresServer = (
            PostgresServer("store")
            if options.store == "postgres"
            else RedisServer("store", persistent=True)
        )
        self.broker = RedisServer("broker", persistent=True)
        self.recorder = RedisServer("records", persistent=False)
        self.kills: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.workers: list[Worker] = []
        self.restarts = 0
        self.deaths: list[float] = []  # whole workers found dead (not killed by us): crashes
        self.hung: list[dict[str, Any]] = []  # workers that gave up but did not exit
        self.stuck: dict[str, Any] = {}  # what kept the queues from draining, if they did not
        self.stuck_restarts: list[dict[str, Any]] = []  # the drain's liveness-probe restarts
        self.gone_bodies = 0  # bodies struck from RUNNING: their processes were gone
        self.max_held_seen = 0
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ set-up and tear-down

    def env(self) -> dict[str, str]:
        env = {
            "CHAOS_BROKER_URL": self.broker.url,
            "CHAOS_STORE_URL": self.store.url,
            "CHAOS_RECORDS_URL": self.recorder.url,
        }
        if not self.o.dedup:
            env["TASKDEDUP_ENABLED"] = "false"
        return env

    def run(self) -> dict[str, Any]:
        try:
            for server in (self.store, self.broker, self.recorder):
                server.start()
            self.records = redis.Redis.from_url(self.recorder.url, decode_responses=True)
            if isinstance(self.store, PostgresServer):
                make_tables(self.store.url)
            say(
                f"store {self.store.url} ({self.store.durability}), broker {self.broker.url} "
                f"(appendonly yes, appendfsync always), records {self.recorder.url}; logs in "
                f"{self.logs}"
            )
            return self.soak()
        finally:
            for worker in self.workers:
                worker.stop()
            for server in (self.store, self.broker, self.recorder):
                server.destroy()
            if self.o.keep_logs:
                say(f"logs kept in {self.logs}")
            else:
                shutil.rmtree(self.logs, ignore_errors=True)

    def soak(self) -> dict[str, Any]:
        env = self.env()
        self.workers = [Worker(i, env, self.logs) for i in range(self.o.workers)]
        for worker in self.workers:
            worker.start()
        self.wait_ready()
        say(f"{len(self.workers)} prefork workers ready; load for {self.o.seconds:g}s")
        producers = [
            start_producer(
                [
                    "--id",
                    str(i),
                    "--seconds",
                    str(self.o.seconds),
                    "--rate",
                    str(self.o.rate),
                    "--names",
                    str(self.o.names),
                    "--seed",
                    str(self.o.seed * 100 + i),
                ],
                {**env, "TASKDEDUP_ON_STORE_ERROR": "raise" if i % 2 else "enqueue"},
                self.logs / f"producer-{i}.log",
            )
            for i in range(self.o.producers)
        ]
        started = time.monotonic()
        faults = threading.Thread(target=self.fault_schedule, args=(started,), daemon=True)
        faults.start()
        self.kill_loop(started, producers)
        faults.join()
        for proc in producers:
            proc.wait(60)
        bad = [i for i, proc in enumerate(producers) if proc.returncode != 0]
        if bad:
            raise RuntimeError(f"producers {bad} failed; see {self.logs}")
        say("load stopped; waiting for the queues to drain")
        drained = self.drain()
        wait = LEASE + GRACE + 1
        say(f"drained={drained}; holding {wait:g}s (one lease + grace) before reading the store")
        time.sleep(wait)  # the promise under test: nothing held one lease (+ grace) later
        return self.verdict(drained)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.records.get(f"ready:{w.tag}") for w in self.workers):
                return
            for worker in self.workers:
                if not worker.alive():
                    raise RuntimeError(f"worker {worker.tag} exited; see {self.logs}")
            time.sleep(0.1)
        raise RuntimeError(f"workers not ready after {timeout}s; see {self.logs}")

    # ------------------------------------------------------------------ faults

    def fault_schedule(self, started: float) -> None:
        """Store stall (SIGSTOP), store stop, broker restart, at fixed points of the load. A
        store that is not stalled (PostgreSQL: see PostgresServer) is stopped there instead,
        so the store meets as many outages, of the same length."""
        t = self.o.seconds
        if not self.o.faults:
            return
        stall = "stall" if self.store.stalls else "store_stop"
        plan = [(0.22 * t, stall), (0.42 * t, "store_stop"), (0.62 * t, "broker_restart")]
        if t >= 150:
            plan += [(0.75 * t, stall), (0.85 * t, "store_stop")]
        for at, what in plan:
            while time.monotonic() - started < at:
                time.sleep(0.05)
            began = time.time()
            if what == "stall":
                assert isinstance(self.store, RedisServer)
                self.store.pause()
                time.sleep(self.o.stall_seconds)
                self.store.resume()
            elif what == "store_stop":
                self.store.stop()
                time.sleep(self.o.outage_seconds)
                self.store.start()
            else:
                self.broker.stop()
                time.sleep(self.o.outage_seconds)
                self.broker.start()
            with self.lock:
                self.faults.append({"fault": what, "from": began, "to": time.time()})
            say(f"{what}: {time.time() - began:.1f}s")

    def kill_loop(self, started: float, producers: list[Any]) -> None:
        """kill -9 a pool child (usually one running a body) or a whole worker, every few
        seconds; restart whole workers that died; sample how many locks the store holds."""
        next_kill = started + self.o.kill_every
        while time.monotonic() - started < self.o.seconds:
            self.restart_dead()
            self.sample_locks()
            if self.o.kill_every > 0 and time.monotonic() >= next_kill:
                self.kill_one()
                next_kill = time.monotonic() + self.rng.uniform(
                    0.6 * self.o.kill_every, 1.4 * self.o.kill_every
                )
            time.sleep(0.5)

    def restart_dead(self) -> None:
        """Start again a worker found dead, as a supervisor would; and, as its stop timeout
        would, kill -9 one that said Celery gave up (see Worker.crashed_at) but is still
        there after WORKER_STOP_TIMEOUT: its consumer is gone, so it holds its messages and
        takes no more."""
        for worker in self.workers:
            crashed = worker.crashed_at() if worker.alive() else None
            if crashed is not None and time.time() - crashed > WORKER_STOP_TIMEOUT:
                self.hung.append({"worker": worker.tag, "t": time.time(), "log": worker.log_tail()})
                pids = worker.kill_all()
                if pids:
                    self.records.hdel(RUNNING, *[str(p) for p in pids])
                self.kills.append(
                    {"t": time.time(), "pids": pids, "kind": "worker", "worker": worker.tag}
                )
            if not worker.alive():
                self.deaths.append(time.time())
                worker.start()
                self.restarts += 1

    def kill_one(self) -> None:
        ready = [w for w in self.workers if w.alive() and self.records.get(f"ready:{w.tag}")]
        if not ready:
            return
        worker = self.rng.choice(ready)
        if self.rng.random() < 0.3:
            pids = worker.kill_all()
            kind = "worker"
        else:
            running = {int(pid) for pid in self.records.hkeys(RUNNING)}
            children = worker.children()
            busy = [pid for pid in children if pid in running]
            choice = busy or children
            if not choice:
                return
            pid = self.rng.choice(choice)
            if not kill_pid(pid):
                return
            wait_gone(pid)
            pids, kind = [pid], "child"
        now = time.time()
        if pids:
            self.records.hdel(RUNNING, *[str(p) for p in pids])
        self.kills.append({"t": now, "pids": pids, "kind": kind, "worker": worker.tag})
        if kind == "worker":
            worker.start()
            self.restarts += 1

    def sample_locks(self) -> None:
        """Count the locks the store holds now (nothing when it cannot answer at once)."""
        try:
            held = len(self.held(timeout=0.3))
        except StoreDown:
            return
        self.max_held_seen = max(self.max_held_seen, held)

    def held(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """The store's live lock and run-lock records (:func:`held_records` or
        :func:`held_rows`); ``timeout``: seconds to connect and to answer (None: no limit).
        Raises StoreDown when the store does not answer."""
        if isinstance(self.store, PostgresServer):
            return held_rows(self.store.url, timeout)
        client = redis.Redis.from_url(
            self.store.url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        try:
            return held_records(client)
        except (redis.RedisError, OSError) as exc:
            raise StoreDown(str(exc)) from exc
        finally:
            client.close()

    # ------------------------------------------------------------------ the end

    def drain(self) -> bool:
        """True once the broker's queues and unacked set are empty and no body runs, three
        checks in a row; False at the deadline.

        Meanwhile it is the workers' supervisor: a dead worker is started again; a body the
        records say runs in a process that is gone is struck from them (its run stays open
        in the history, where the checker judges it); and when messages wait but nothing
        moved (no run started, nothing consumed) for NO_PROGRESS seconds, every worker is
        killed -9 and started again, as a liveness probe would: Celery's consumer can stay
        alive without consuming after a broker restart (celery/celery#10302, kombu 5.7).
        Each such restart keeps what was stuck before it, in the report."""
        broker = redis.Redis.from_url(self.broker.url, decode_responses=True)
        deadline = time.monotonic() + self.o.drain_timeout
        quiet = 0
        moved, seen = time.monotonic(), (-1, -1)
        try:
            while time.monotonic() < deadline:
                self.restart_dead()
                self.strike_gone_bodies()
                pending = broker.hlen("unacked")
                for name in broker.scan_iter(count=1000):
                    if broker.type(name) == "list":
                        pending += broker.llen(name)
                running = self.records.hlen(RUNNING)
                quiet = quiet + 1 if pending == 0 and running == 0 else 0
                if quiet >= 3:
                    return True
                now, progress = time.monotonic(), (pending, self.records.llen(RUNS))
                if progress != seen:
                    moved, seen = now, progress
                elif pending and not running and now - moved > NO_PROGRESS:
                    self.restart_stuck(broker)
                    moved = now
                time.sleep(1.0)
            self.stuck = self.what_is_stuck(broker)
            return False
        finally:
            broker.close()

    def strike_gone_bodies(self) -> None:
        """Strike from RUNNING the bodies whose processes are gone (not by our kill -9, whose
        bodies kill_one strikes itself): they will never say they ended."""
        for pid in self.records.hkeys(RUNNING):
            try:
                os.kill(int(pid), 0)
            except OSError:
                self.records.hdel(RUNNING, pid)
                self.gone_bodies += 1

    def restart_stuck(self, broker: redis.Redis) -> None:  # type: ignore[type-arg]
        """Kill -9 every worker and let restart_dead start them again (the liveness probe's
        restart); what was stuck is kept for the report."""
        self.stuck_restarts.append({"t": time.time(), "stuck": self.what_is_stuck(broker)})
        for worker in self.workers:
            if worker.alive():
                pids = worker.kill_all()
                if pids:
                    self.records.hdel(RUNNING, *[str(p) for p in pids])
                self.kills.append(
                    {"t": time.time(), "pids": pids, "kind": "worker", "worker": worker.tag}
                )

    def what_is_stuck(self, broker: redis.Redis) -> dict[str, Any]:  # type: ignore[type-arg]
        """What kept the queues from draining, for the report: the broker's lists and unacked
        messages (task, job, seconds since delivered, ETA), the bodies the records say run
        (and whether their processes live), each worker's state and the end of its log."""
        now = time.time()
        lists = {}
        for name in broker.scan_iter(count=1000):
            if broker.type(name) == "list":
                lists[name] = broker.llen(name)
        delivered = {
            tag: float(t) for tag, t in broker.zrange("unacked_index", 0, -1, withscores=True)
        }
        unacked = []
        for tag, raw in list(broker.hgetall("unacked").items())[:50]:
            try:
                message = json.loads(raw)[0]
                headers = message.get("headers", {})
                unacked.append(
                    {
                        "task": headers.get("task"),
                        "job": headers.get("id"),
                        "eta": headers.get("eta"),
                        "retries": headers.get("retries"),
                        "seconds_since_delivered": round(now - delivered.get(tag, now), 1),
                    }
                )
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                unacked.append({"raw": str(raw)[:200]})
        running = []
        for pid, job in self.records.hgetall(RUNNING).items():
            try:
                os.kill(int(pid), 0)
                alive = True
            except OSError:
                alive = False
            running.append({"pid": int(pid), "job": job, "process_alive": alive})
        workers = [
            {
                "worker": w.tag,
                "alive": w.alive(),
                "children": w.children(),
                "crashed_at": w.crashed_at(),
                "log": w.log_tail(),
            }
            for w in self.workers
        ]
        return {
            "lists": lists,
            "unacked": broker.hlen("unacked"),
            "unacked_sample": unacked,
            "running": running,
            "workers": workers,
        }

    def verdict(self, drained: bool) -> dict[str, Any]:
        now = time.time()
        events = [json.loads(x) for x in self.records.lrange(RUNS, 0, -1)]
        ledger = [json.loads(x) for x in self.records.lrange(LEDGER, 0, -1)]
        held = self.held()
        if self.o.keep_logs:
            raw = {
                "runs": events,
                "ledger": ledger,
                "kills": self.kills,
                "held": held,
                "faults": self.faults,
                "messages": self.records.hgetall(MESSAGES),
                "deaths": self.deaths,
            }
            (self.logs / "raw.json").write_text(json.dumps(raw))
        runs, tally = check.build_runs(events, self.kills, now)
        ids = {e["job"] for e in ledger if e["ev"] in ("submit", "revoke") and "job" in e}
        ids |= {h["job"] for h in held if h.get("job")}
        jobs = check.Jobs(
            ledger,
            self.result_states(sorted(ids)),
            set(self.records.smembers(PUBLISHED)),
            {k: int(v) for k, v in self.records.hgetall(RECEIVED).items()},
            drained,
            {k: int(v) for k, v in self.records.hgetall(PUBLISHES).items()},
            {k: int(v) for k, v in self.records.hgetall(POPPED).items()},
            sorted(
                [kill["t"] for kill in self.kills if kill["kind"] == "worker"]
                + self.deaths
                + [f["from"] for f in self.faults if f["fault"] == "broker_restart"]
            ),
            {
                tag: (entry["job"], entry["t"])
                for tag, entry in (
                    (tag, json.loads(raw)) for tag, raw in self.records.hgetall(MESSAGES).items()
                )
            },
            {tag: float(t) for tag, t in self.records.hgetall(HELD).items()},
            {tag: float(t) for tag, t in self.records.hgetall(ACKED).items()},
            [(f["from"], f["to"]) for f in self.faults if f["fault"] in ("stall", "store_stop")],
            sorted([kill["t"] for kill in self.kills if kill["kind"] == "worker"] + self.deaths),
        )
        digests, mismatched = key_digests(events, self.o.names)
        submits = [e for e in ledger if e["ev"] == "submit"]
        report: dict[str, Any] = {
            "options": {k: str(v) for k, v in dataclasses.asdict(self.o).items()},
            "store": {"kind": self.o.store, "durability": self.store.durability},
            "drained": drained,
            "stuck": self.stuck,
            "workers_hung_after_crash": self.hung,
            "workers_restarted_for_no_progress": self.stuck_restarts,
            "bodies_whose_process_was_gone": self.gone_bodies,
            "totals": {
                "submissions": len(submits),
                "accepted_fresh": sum(1 for e in submits if "job" in e and not e["dedup"]),
                "deduplicated": sum(1 for e in submits if e.get("dedup")),
                "refused_with_error": sum(1 for e in submits if "error" in e),
                "errors_by_type": count_by(
                    e["error"].split(":")[0] for e in submits if "error" in e
                ),
                "revokes_sent": sum(1 for e in ledger if e["ev"] == "revoke" and "error" not in e),
                "with_expires": sum(1 for e in submits if e["mode"] == "expires"),
                "with_countdown": sum(1 for e in submits if e["mode"] == "countdown"),
                "runs": len(runs),
                "runs_ended": tally["end"],
                "runs_cut_by_kill": tally["kill"],
                "runs_open_unexplained": tally["open"],
                "outcomes": count_by(r.outcome for r in runs if r.outcome),
                "kills_child": sum(1 for k in self.kills if k["kind"] == "child"),
                "kills_worker": sum(1 for k in self.kills if k["kind"] == "worker"),
                "worker_restarts": self.restarts,
                "faults": [{**f, "seconds": round(f["to"] - f["from"], 2)} for f in self.faults],
                "max_locks_held_during_load": self.max_held_seen,
                "key_digest_mismatches": mismatched,
                "kills": self.kills,
                "newest_wins": {
                    task: {
                        "submissions": sum(1 for e in submits if e["task"] == task),
                        "deduplicated": sum(
                            1 for e in submits if e["task"] == task and e.get("dedup")
                        ),
                        "runs": sum(1 for r in runs if r.task == task),
                        "outcomes": count_by(r.outcome for r in runs if r.task == task),
                    }
                    for task in sorted(NEWEST_TASKS)
                },
            },
            "overlaps": check.overlaps(runs, EXCLUSIVE_TASKS, jobs),
            "unfinished": check.unfinished(runs, jobs),
            "held": check.still_held(held, digests, jobs, runs),
            "latest_arguments": check.latest_arguments(runs, jobs, NEWEST_TASKS, LAPSE),
            "one_run_per_burst": check.one_run_per_burst(
                runs, jobs, {task_name("debounce")}, DEBOUNCE_DELAY, DEBOUNCE_MAX_WAIT, LAPSE
            ),
            "newest_ran": check.newest_ran(runs, jobs, NEWEST_TASKS, LAPSE),
        }
        report["violations"] = {
            "overlaps": report["overlaps"]["count"],
            "accepted but never finished": report["unfinished"]["count"],
            "keys still held one lease after the load": report["held"]["count"],
            "revoked/expired keys still held": report["held"]["revoked_count"],
            "runs not of the latest arguments": report["latest_arguments"]["count"],
            "debounce bursts not run once": report["one_run_per_burst"]["count"],
            "submissions whose arguments (or newer) never ran": report["newest_ran"]["count"],
            # the bug the soak found (fixed in 2d47df2, see check.lapsed_jobs): a debounced
            # run later than max_wait + grace lost the burst's latest arguments
            "debounce: latest arguments lost by a run past max_wait + grace": (
                report["latest_arguments"]["lapsed_count"]
                + report["one_run_per_burst"]["lapsed_count"]
                + report["newest_ran"]["lapsed_count"]
            ),
        }
        return report

    def result_states(self, jobs: list[str]) -> dict[str, dict[str, Any]]:
        states: dict[str, dict[str, Any]] = {}
        pipe = self.records.pipeline()
        for job in jobs:
            pipe.get(f"celery-task-meta-{job}")
        for job, raw in zip(jobs, pipe.execute(), strict=True):
            if raw:
                states[job] = json.loads(raw)
        return states


class StoreDown(Exception):
    """The store did not answer the orchestrator's read of its locks."""


def held_records(client: redis.Redis) -> list[dict[str, Any]]:
    """The store's lock and run-lock records (``<prefix>:{<key>}:lock`` / ``:run``)."""
    found = []
    for name in client.scan_iter(match=f"{STORE_PREFIX}:{{*}}:*", count=1000):
        name = name.decode() if isinstance(name, bytes) else name
        kind = name.rsplit(":", 1)[1]
        if kind not in ("lock", "run"):
            continue
        job = client.hget(name, "j")
        pttl = client.pttl(name)
        if pttl == -2:
            continue
        job = job.decode() if isinstance(job, bytes) else job
        digest = name[name.index("{") + 1 : name.rindex("}")]
        found.append({"digest": digest, "kind": kind, "job": job, "pttl_ms": pttl})
    return found


def held_rows(url: str, timeout: float | None = None) -> list[dict[str, Any]]:
    """:func:`held_records` on PostgreSQL: the live rows of parts ``lock`` and ``run`` in
    ``<prefix>_records`` (the tag is the key's digest, the body's ``j`` its holder), live by
    the database's clock, as the store reads them. ``timeout``: seconds to connect (at least
    2, libpq's least) and for the query (None: no limit). Raises StoreDown when it does not
    answer (stopped, starting, shutting down)."""
    import psycopg

    from taskdedup.stores.sql import tables

    table = tables(STORE_PREFIX)[0]
    limits: dict[str, Any] = {}
    if timeout is not None:
        limits["connect_timeout"] = max(2, math.ceil(timeout))
        limits["options"] = f"-c statement_timeout={int(timeout * 1000)}"
    query = (
        "WITH now AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms) "
        f"SELECT r.tag, r.part, r.body::json ->> 'j', r.expires_at - now.ms FROM {table} AS r, "
        "now WHERE r.part IN ('lock', 'run') AND r.expires_at > now.ms"
    )
    try:
        with psycopg.connect(url, autocommit=True, **limits) as conn:
            rows = conn.execute(query).fetchall()
    except psycopg.Error as exc:
        raise StoreDown(str(exc)) from exc
    return [
        {"digest": tag, "kind": part, "job": job, "pttl_ms": int(left)}
        for tag, part, job, left in rows
    ]


def make_tables(url: str) -> None:
    """Create the store's tables and functions on PostgreSQL once, before any worker or
    producer starts (each would otherwise make them on its first call, waiting on the others),
    so that the orchestrator's reads of the table find it from the start."""
    from taskdedup.stores.postgres import PostgresStore

    store = PostgresStore(url, key_prefix=STORE_PREFIX)
    try:
        store.migrate()
    finally:
        store.close()


def key_digests(events: list[dict[str, Any]], names: int) -> tuple[dict[str, tuple[str, str]], int]:
    """Key digest -> (task, name), computed with the public Policy API for every name the
    producers use; checked against the digests the bodies saw (the count of mismatches)."""
    from taskdedup import Policy

    table: dict[str, tuple[str, str]] = {}
    for kind in KINDS:
        task = task_name(kind)  # (the digest is the task's name and the key's arguments)
        policy = Policy("until_executed", keys=["name"]).bind(task, signature)
        for i in range(names):
            table[policy.key_for((), {"name": f"k{i}"})] = (task, f"k{i}")
    mismatched = 0
    for e in events:
        seen = e["ev"] == "start" and e.get("dkey")
        if seen and table.get(e["dkey"]) != (e["task"], e["name"]):
            mismatched += 1
    return table, mismatched


def count_by(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out
