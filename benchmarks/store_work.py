"""The store's work per operation, counted by Redis itself (``INFO commandstats``), not timed.

For plain Celery (the baseline), taskdedup, celery-once, celery-singleton and taskdedup's
drop-ins for those two (``taskdedup.compat``) on each layout of the publish rows, and for plain
taskiq, taskdedup and taskiq-deduplication on a taskiq-redis ``ListQueueBroker``: the commands
and the server time (``usec``) of

- an enqueue of a new key (producer side, with taskdedup's background confirmations: each
  batch is followed by a wait until the counters stop moving for longer than the confirmer's
  interval, so its last batch is in);
- a duplicate enqueue of a queued job (its lock confirmed): the key's first duplicate, and a
  later one (taskdedup counts each on the lock; it checks the lock's ttl at a holder's second
  duplicate and every 64th, and writes the duplicates to the key's history as the lock ends);
- taskdedup's debounce (store apart only): a debounced duplicate also reads the server's clock
  (its run moves) and carries the call's arguments (the run takes the latest);
- a drained job (a solo-pool worker's claim, run and finish; Redis broker layouts), also over
  plain Celery's own per-job work where the broker is the same Redis;

and what a finished job leaves under the library's key prefix: the keys, and their
steady-state memory (MEMORY USAGE x remaining ttl) in MB per million jobs a day.

The counters are read by diffing two snapshots of a Redis that only the benchmark uses: a
private ``redis-server`` started for this section (the one of ``tests/redis_server.py``), so
another client of the shared server does not add its commands. Every cmdstat_* entry is summed
but our own INFO: a command a Lua script runs counts once as itself and once inside its
EVALSHA's time, so the summed usec counts a script's inner commands twice. The JSON also has
``script_usec_per_op`` (the scripts' own time, inner commands included once) and
``server_cpu_usec_per_op`` (the server process's CPU from INFO cpu, network I/O included, and
so is the idle server's during the quiet wait: plain's row on RabbitMQ shows that floor), and
each command's calls per operation. The batches are separate from the timed rounds of the
other groups; the libraries take turns, median over ``rounds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from benchmarks import taskiq_kiq
from benchmarks.celery_publish import AMQP_URL, _answers, other_db
from benchmarks.common import ROOT
from taskdedup import RedisStore
from taskdedup.celery import deduplicate, install

#: Commands of ours, left out of the sums (the snapshots and the quiet-wait's polling).
OURS = frozenset({"info"})
#: Commands that run a script: their usec includes the commands the script runs.
SCRIPTS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})
#: A batch is over once the counters stood still this long: for taskdedup longer than its
#: confirmer waits for a batch to gather (0.25 s), so its last confirmation is counted; the
#: others do all their work in the call (or, on the worker, before the job's end).
QUIET = 0.4
QUIET_SYNC = 0.1
POLL = 0.05
NEW, FIRST, AGAIN, DRAINED = (
    "enqueue, new key",
    "duplicate, first of its key",
    "duplicate, key already duplicated",
    "drained job",
)
DAY_MS = 86_400_000
PRIVATE = "a private redis-server"


@dataclass
class Snapshot:
    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float  # the server process's CPU, user + sys

    @classmethod
    def take(cls, admin: redis.Redis) -> Snapshot:
        info = admin.execute_command("INFO", "commandstats", "cpu")
        calls, usec = {}, {}
        for name, stats in info.items():
            if name.startswith("cmdstat_") and name[8:] not in OURS:
                calls[name[8:]] = int(stats["calls"])
                usec[name[8:]] = int(stats["usec"])
        return cls(calls, usec, float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))


@dataclass
class Work:
    """What the server did between two snapshots, for ``ops`` operations."""

    ops: int
    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, ops: int) -> Work:
        calls = {k: v - before.calls.get(k, 0) for k, v in after.calls.items()}
        usec = {k: v - before.usec.get(k, 0) for k, v in after.usec.items()}
        calls = {k: v for k, v in calls.items() if v}
        return cls(max(ops, 1), calls, {k: usec[k] for k in calls}, after.cpu_s - before.cpu_s)

    def figures(self) -> dict[str, Any]:
        n = self.ops
        return {
            "commands_per_op": sum(self.calls.values()) / n,
            "usec_per_op": sum(self.usec.values()) / n,
            "scripts_per_op": sum(v for k, v in self.calls.items() if k in SCRIPTS) / n,
            "script_usec_per_op": sum(v for k, v in self.usec.items() if k in SCRIPTS) / n,
            "usec": {k: v / n for k, v in sorted(self.usec.items())},
            "server_cpu_usec_per_op": self.cpu_s * 1e6 / n,
            "commands": {k: v / n for k, v in sorted(self.calls.items())},
        }


def settle(admin: redis.Redis, quiet: float, timeout: float = 30.0) -> Snapshot:
    """A snapshot taken once the counters have not moved for ``quiet`` seconds (or after
    ``timeout``: an idle worker's BRPOP returns every second, which leaves gaps enough)."""
    last = Snapshot.take(admin)
    since = time.monotonic()
    deadline = since + timeout
    while time.monotonic() - since < quiet:
        time.sleep(POLL)
        now = Snapshot.take(admin)
        if now.calls == last.calls:
            last.cpu_s = now.cpu_s
        elif time.monotonic() > deadline:
            print(f"(store work: the counters did not settle in {timeout:.0f} s)")
            return now
        else:
            last, since = now, time.monotonic()
    return last


async def asettle(admin: redis.Redis, quiet: float) -> Snapshot:
    """:func:`settle` for an event loop that must go on meanwhile."""
    last = Snapshot.take(admin)
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        await asyncio.sleep(POLL)
        now = Snapshot.take(admin)
        if now.calls != last.calls:
            last, since = now, time.monotonic()
        else:
            last.cpu_s = now.cpu_s
    return last


def leftovers(admin: redis.Redis, patterns: tuple[str, ...], jobs: int) -> dict[str, Any]:
    """The keys matching ``patterns`` and their steady-state memory per job: each key's
    MEMORY USAGE x its remaining ttl in days, summed, per job: at a million jobs a day that
    many bytes x 1e6 are resident, i.e. that many MB."""
    keys = list({k for p in patterns for k in admin.scan_iter(match=p, count=1000)})
    byte_days, no_ttl, size = 0.0, 0, 0
    for key in keys:
        used = admin.memory_usage(key, samples=0) or 0
        ttl = admin.pttl(key)
        size += used
        if ttl == -1:
            no_ttl += 1
        elif ttl > 0:
            byte_days += used * ttl / DAY_MS
    return {
        "jobs": jobs,
        "keys_left": len(keys),
        "keys_per_job": len(keys) / jobs,
        "keys_without_ttl": no_ttl,
        "bytes_per_job": size / jobs,
        "mb_per_million_jobs_a_day": byte_days / jobs,  # (x 1e6 jobs / 1e6 bytes)
    }


def _unlink(client: redis.Redis, pattern: str) -> None:
    keys = list(client.scan_iter(match=pattern, count=1000))
    for start in range(0, len(keys), 500):
        client.unlink(*keys[start : start + 500])


@contextlib.contextmanager
def private_redis(url: str) -> Iterator[str | None]:
    """A redis-server of our own (its counters are ours alone), else None."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from redis_server import PrivateRedis  # type: ignore[import-not-found]

        server = PrivateRedis().start()
    except Exception as exc:
        print(f"(store work: no private redis-server ({exc}); counting on {url})")
        yield None
        return
    finally:
        sys.path.remove(str(ROOT / "tests"))
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def peers_on(url: str) -> Iterator[None]:
    """celery-once and celery-singleton each keep one Redis client per process, made from the
    first app's settings (``celery_once.backends.redis.redis``,
    ``celery_singleton.backends._backend``): an earlier group's apps would have them write to
    its Redis. Point them at ``url`` for this section, then back. Their drop-ins keep theirs
    per URL (``taskdedup.compat.celery_once._CLIENTS``) and per settings
    (``taskdedup.compat.celery_singleton._BACKENDS``): this section starts them empty, so its
    clients (and the scripts they load) are made here, and closes them after."""
    from celery_once.backends import redis as once_redis
    from celery_singleton import backends as singleton_backends
    from celery_singleton.backends.redis import RedisBackend

    from taskdedup.compat import celery_once as once_compat
    from taskdedup.compat import celery_singleton as singleton_compat

    kept = once_redis.redis, singleton_backends._backend
    kept_compat = dict(once_compat._CLIENTS), dict(singleton_compat._BACKENDS)
    once_compat._CLIENTS.clear()
    singleton_compat._BACKENDS.clear()
    once_redis.redis = redis.StrictRedis.from_url(url)
    singleton_backends._backend = RedisBackend(url)
    try:
        yield
    finally:
        once_redis.redis.close()
        singleton_backends._backend.redis.close()
        once_redis.redis, singleton_backends._backend = kept
        for client in once_compat._CLIENTS.values():
            client.close()
        for backend in singleton_compat._BACKENDS.values():
            with contextlib.suppress(Exception):
                backend.redis.close()
        once_compat._CLIENTS.clear()
        singleton_compat._BACKENDS.clear()
        once_compat._CLIENTS.update(kept_compat[0])
        singleton_compat._BACKENDS.update(kept_compat[1])


# --- Celery -------------------------------------------------------------------------------


@dataclass
class Subject:
    """One library's app, task and key pattern, counting the jobs its worker ran."""

    library: str
    app: Celery
    send: Callable[[int], Any]
    keys: tuple[str, ...]  # SCAN patterns of what the library leaves in the store
    queue: str
    quiet: float = QUIET_SYNC
    ran: int = 0
    target: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def body(self, x: int) -> None:
        self.ran += 1
        if self.ran >= self.target:
            self.done.set()


def _subject(library: str, store: str, broker: str) -> Subject:
    tag = "tdbench-" + uuid.uuid4().hex[:8]
    app = Celery(tag, broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{tag}-q",
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_transport_options={"global_keyprefix": f"{tag}-broker:"},
    )
    subject = Subject(library, app, lambda x: None, (), f"{tag}-q")
    name = f"{tag}.work"

    def body(x: int) -> None:
        subject.body(x)

    if library == "plain Celery":
        task = app.task(shared=False, name=name)(body)
        subject.send = lambda x: task.apply_async((x,))
        return subject
    if library.startswith("taskdedup"):
        _install(app, tag, store, broker)
        strategy = library.split(", ")[1]
        # debounce: its run due a millisecond after the burst's last submission, so the drain
        # measures the store's work, not the wait
        delays = {"delay": 0.001, "max_wait": 1} if strategy == "debounce" else {}
        task = deduplicate(strategy, **delays)(app.task(shared=False, name=name)(body))
        subject.keys = (f"{tag}:*",)
        subject.quiet = QUIET
        subject.send = lambda x: task.apply_async((x,))
        return subject
    compat = library.endswith(COMPAT)
    if compat:  # taskdedup's store as taskdedup's rows have it (the task's bind keeps it)
        _install(app, tag, store, broker)
        subject.keys = (f"{tag}:*",)
        subject.quiet = QUIET
    if library.startswith("celery-once"):
        if compat:
            from taskdedup.compat.celery_once import AlreadyQueued, QueueOnce
        else:
            from celery_once import AlreadyQueued, QueueOnce

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": store, "default_timeout": 3600},
        }
        task = app.task(shared=False, base=QueueOnce, once={"graceful": False}, name=name)(body)
        subject.keys += (f"qo_{name}*",)

        def send(x: int) -> Any:
            try:
                return task.apply_async((x,))
            except AlreadyQueued:
                return None

        subject.send = send
        return subject
    if library.startswith("celery-singleton"):
        if compat:
            from taskdedup.compat.celery_singleton import Singleton
        else:
            from celery_singleton import Singleton

        app.conf.singleton_backend_url = store
        app.conf.singleton_key_prefix = f"SINGLETONLOCK_{tag}_"
        task = app.task(shared=False, base=Singleton, name=name)(body)
        subject.keys += (f"SINGLETONLOCK_{tag}_*",)
    else:
        raise ValueError(library)
    subject.send = lambda x: task.apply_async((x,))
    return subject


def _install(app: Celery, tag: str, store: str, broker: str) -> None:
    """taskdedup on ``app`` under ``tag``: the store made from the broker's URL when the broker
    is the store's Redis (fused), else on ``store`` (apart)."""
    app.conf.taskdedup_key_prefix = tag
    if broker == store:
        install(app)  # the store made from the broker's URL: fused
    else:
        install(app, store=RedisStore.from_url(store, key_prefix=tag))


#: a drop-in's name: its original's, then this
COMPAT = " (taskdedup.compat)"
LIBRARIES = (
    "plain Celery",
    "taskdedup, until_executed",
    "taskdedup, until_executing",
    "taskdedup, debounce",
    "celery-once",
    "celery-once" + COMPAT,
    "celery-singleton",
    "celery-singleton" + COMPAT,
)


def _layouts(url: str, store: str) -> dict[str, tuple[str, bool]]:
    """layout -> (broker URL, drained?). The store is on ``store``; "apart" puts the broker on
    another server when ``store`` is one of our own, so only the store's commands count there."""
    apart = url if store != url else other_db(url)
    return {
        "RabbitMQ broker, Redis store": (AMQP_URL, False),
        "Redis broker, store apart": (apart, True),
        "Redis broker, store fused": (store, True),
    }


def _purge(subject: Subject, store: redis.Redis) -> None:
    """Drop the queued messages and the library's keys."""
    with subject.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(subject.queue)
    for pattern in subject.keys:
        _unlink(store, pattern)


def _one(
    subject: Subject, admin: redis.Redis, n: int, base: int, drain: bool
) -> tuple[dict[str, Work], dict[str, Any] | None]:
    """One round of one library: ``n`` new keys; (``drain``) the worker's drain of them and
    what the finished jobs left; then a first duplicate of each of ``n // 4`` queued jobs, and
    ``n`` more duplicates of one of them."""
    quiet, send = subject.quiet, subject.send
    work: dict[str, Work] = {}
    before = Snapshot.take(admin)  # (the last batch ended settled)
    for i in range(n):
        send(base + i)
    after = settle(admin, quiet)
    work[NEW] = Work.between(before, after, n)
    left, held, m = None, base, max(1, n // 4)
    if drain:
        subject.ran, subject.target = 0, n
        subject.done.clear()
        before = after
        with start_worker(subject.app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            if not subject.done.wait(300):
                raise RuntimeError(f"{subject.library}: the worker ran {subject.ran} of {n} jobs")
            after = settle(admin, quiet)  # the last job's finish is written after its body
        if subject.ran != n:
            print(f"(store work: {subject.library}'s worker ran {subject.ran} jobs, not {n})")
        work[DRAINED] = Work.between(before, after, subject.ran)
        if subject.keys:
            left = leftovers(admin, subject.keys, n)
        held = base + n  # jobs to duplicate, queued and confirmed (not counted)
        for i in range(m):
            send(held + i)
        after = settle(admin, quiet)
    before = after
    for i in range(m):
        send(held + i)
    after = settle(admin, quiet)
    work[FIRST] = Work.between(before, after, m)
    before = after
    for _ in range(n):
        send(held)
    after = settle(admin, quiet)
    work[AGAIN] = Work.between(before, after, n)
    return work, left


def _celery(url: str, store: str, n: int, rounds: int) -> tuple[list[dict], list[dict]]:
    admin = redis.Redis.from_url(store)
    rows: list[dict] = []
    left_rows: list[dict] = []
    base = uuid.uuid4().int % 1_000_000_000
    for layout, (broker, drain) in _layouts(url, store).items():
        if broker.startswith("amqp") and not _answers(broker):
            print(f"(store work skipped: {layout}: no broker at {broker})")
            continue
        subjects = [_subject(name, store, broker) for name in LIBRARIES]
        if not drain:  # the strategies differ on the worker only
            subjects = [s for s in subjects if s.library != "taskdedup, until_executing"]
        if layout != "Redis broker, store apart":  # (debounce: one layout is enough)
            subjects = [s for s in subjects if s.library != "taskdedup, debounce"]
        found: dict[str, dict[str, list[Work]]] = {s.library: {} for s in subjects}
        left: dict[str, list[dict[str, Any]]] = {s.library: [] for s in subjects}
        try:
            for s in subjects:  # connections made, scripts loaded: not in the counts
                for i in range(20):
                    s.send(base - 1 - i % 10)
                settle(admin, s.quiet)
                _purge(s, admin)
            for _ in range(rounds):
                for s in subjects:
                    base += 2 * n + 10
                    work, gone = _one(s, admin, n, base, drain)
                    for op, w in work.items():
                        found[s.library].setdefault(op, []).append(w)
                    if gone is not None:
                        left[s.library].append(gone)
                    _purge(s, admin)
        finally:
            for s in subjects:
                with contextlib.suppress(Exception):
                    _purge(s, admin)
                _clean_broker(s, broker)
        group = f"Celery ({layout})"
        rows += _medians(group, found)
        for library, ops in found.items():
            if library != "plain Celery" and not any(sum(w.calls.values()) for w in ops[NEW]):
                print(f"(store work: {library} wrote nothing to the store on {layout}?)")
        for library, values in left.items():
            if values:
                left_rows.append({"group": group, "library": library, **_median_dict(values)})
    admin.close()
    return rows, left_rows


def _clean_broker(subject: Subject, broker: str) -> None:
    if broker.startswith("amqp"):
        with subject.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(subject.queue)
        return
    client = redis.Redis.from_url(broker)
    _unlink(client, subject.app.conf.broker_transport_options["global_keyprefix"] + "*")
    client.close()


def _median_dict(values: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in values[0]:
        if isinstance(values[0][key], dict):
            names = {k for v in values for k in v[key]}
            out[key] = {k: statistics.median(v[key].get(k, 0) for v in values) for k in names}
            out[key] = dict(sorted(out[key].items()))
        else:
            out[key] = statistics.median(v[key] for v in values)
    return out


def _script_commands(library: str) -> frozenset[str]:
    """The commands ``library``'s Lua scripts run (lower case, as commandstats names them)."""
    sources: list[str] = []
    if library.startswith("taskdedup") or library.endswith(COMPAT):
        from taskdedup.stores.redis_calls import SOURCES

        sources = list(SOURCES.values())
    if library.endswith(COMPAT):  # and the peer's key's: adopt, renew, hold, release
        from taskdedup.compat import mirror

        sources += [v for k, v in vars(mirror).items() if k.startswith("_") and k.isupper()]
    elif library == "taskiq-deduplication":
        from taskiq_deduplication import middleware

        sources = [v for k, v in vars(middleware).items() if k.endswith("_LUA_SCRIPT")]
    return frozenset(c.lower() for src in sources for c in _CALL.findall(src))


_CALL = re.compile(r"redis\.p?call\(\s*'(\w+)'")


def _cpu(
    row: dict[str, Any], plain: dict[str, Any] | None, peer: dict[str, Any] | None = None
) -> float:
    """Redis µs per op with each command counted once: a script's EVALSHA time includes the
    commands it runs, so those are left out of the sum, except what the broker itself runs of
    the same commands (plain's figure for them on this layout: kombu's HSET, LPUSH, ...) and,
    for a drop-in, what its original runs of them outside a script (``peer``: the original's
    row, given for the producer's operations: the drop-in's ``SET NX`` of the peer's key)."""
    if not row["scripts_per_op"]:
        return float(row["usec_per_op"])
    nested = _script_commands(row["library"])
    base = dict((plain or {}).get("usec", {}))
    for k, v in (peer or {}).get("usec", {}).items():
        base[k] = base.get(k, 0.0) + v
    return sum(min(v, base.get(k, 0.0)) if k in nested else v for k, v in row["usec"].items())


def _medians(group: str, found: dict[str, dict[str, list[Work]]]) -> list[dict[str, Any]]:
    """A row per library and operation: the median of each figure over the rounds; the
    drained job also over plain Celery's (same layout)."""
    rows = []
    for library, ops in found.items():
        for op, works in ops.items():
            row = {"group": group, "library": library, "operation": op, "ops": works[0].ops}
            rows.append(row | _median_dict([w.figures() for w in works]))
    plain = {(r["operation"]): r for r in rows if r["library"].startswith("plain")}
    by_library = {(r["library"], r["operation"]): r for r in rows}
    for r in rows:
        peer = None  # a drop-in's producer runs its original's commands, then taskdedup's
        if r["library"].endswith(COMPAT) and r["operation"] != DRAINED:
            peer = by_library.get((r["library"][: -len(COMPAT)], r["operation"]))
        r["cpu_usec_per_op"] = _cpu(r, plain.get(r["operation"]), peer)
    for r in rows:
        base = plain.get(r["operation"])
        if r["operation"] == "drained job" and base is not None:
            r["over_plain"] = {
                "commands_per_op": r["commands_per_op"] - base["commands_per_op"],
                "cpu_usec_per_op": r["cpu_usec_per_op"] - base["cpu_usec_per_op"],
                "usec_per_op": r["usec_per_op"] - base["usec_per_op"],
                "server_cpu_usec_per_op": r["server_cpu_usec_per_op"]
                - base["server_cpu_usec_per_op"],
            }
    return rows


# --- taskiq -------------------------------------------------------------------------------


async def _taskiq(store: str, n: int, rounds: int, prefixes: dict[str, str]) -> list[dict]:
    """The producer side of :mod:`benchmarks.taskiq_kiq`'s libraries, as :func:`_one` without
    the drain (the broker is the store's Redis: plain's LPUSH counts)."""
    admin = redis.Redis.from_url(store)
    made = {name: make(store, prefixes[name]) for name, make in taskiq_kiq.LIBRARIES.items()}
    for broker, _ in made.values():
        await broker.startup()
    found: dict[str, dict[str, list[Work]]] = {name: {} for name in made}
    base = uuid.uuid4().int % 1_000_000_000
    m = max(1, n // 4)
    try:
        for _, kick in made.values():  # warm-up
            for i in range(20):
                await kick(base - 1 - i % 10)
        for _ in range(rounds):
            for name, (_, kick) in made.items():
                quiet = QUIET if name == "taskdedup" else QUIET_SYNC
                base += n + 10
                before = await asettle(admin, quiet)
                for i in range(n):
                    await kick(base + i)
                after = await asettle(admin, quiet)
                found[name].setdefault(NEW, []).append(Work.between(before, after, n))
                for i in range(m):
                    await kick(base + i)
                first = await asettle(admin, quiet)
                found[name].setdefault(FIRST, []).append(Work.between(after, first, m))
                for _ in range(n):
                    await kick(base)
                again = await asettle(admin, quiet)
                found[name].setdefault(AGAIN, []).append(Work.between(first, again, n))
    finally:
        for broker, _ in made.values():
            await broker.shutdown()
        admin.close()
    return _medians(f"{taskiq_kiq.GROUP[:-1]}, store on the broker's Redis)", found)


def _taskiq_rows(store: str, n: int, rounds: int) -> list[dict]:
    logging.getLogger("taskiq_deduplication").setLevel(logging.ERROR)  # a warning per duplicate
    prefixes = {name: "tdbench-" + uuid.uuid4().hex[:8] for name in taskiq_kiq.LIBRARIES}
    try:
        return asyncio.run(_taskiq(store, n, rounds, prefixes))
    finally:
        client = redis.Redis.from_url(store)
        for prefix in prefixes.values():
            _unlink(client, prefix + "*")
        client.close()


# --- the section ----------------------------------------------------------------------------


# --- the store's primitives on their own ------------------------------------------------------


def _primitives(store: str, n: int, rounds: int) -> list[dict[str, Any]]:
    """A paced submission (issue 27: ``Pacer.delay``, one GCRA decision) and, beside it, a
    reservation (``ReservationGuard``: reserve, then give the slot back), ``n`` of each on
    their own scope, counted as the rows above (median of ``rounds``)."""
    try:
        from taskdedup import PacePolicy, Pacer, ReservationGuard
    except ImportError:  # an older taskdedup measured side by side (no pacing yet)
        return []

    admin = redis.Redis.from_url(store)
    target = RedisStore.from_url(store, key_prefix="bench-prim-" + uuid.uuid4().hex[:6])
    pacer, guard = Pacer(target), ReservationGuard(target)
    policy = PacePolicy("1000/s", burst=10)

    def paced(i: int) -> None:
        pacer.delay(f"scope-{i % 10}", policy)

    def reserved(i: int) -> None:
        scope = f"scope-{i % 10}"
        with guard.reserve(scope, max_concurrent=5, ttl=60):
            pass  # not consumed: the slot is given back as the block ends

    try:
        from taskdedup.reservations import stacked_scope
    except ImportError:  # (no stacked caps yet)
        stacked_scope = None  # type: ignore[assignment]

    def stacked(i: int) -> None:  # a global cap and a per-tenant one, taken together
        assert stacked_scope is not None
        scope = stacked_scope([("global", 10_000), (f"tenant-{i % 10}", 5)])
        with guard.reserve(scope, max_concurrent=5, ttl=60):
            pass

    steps = [("paced submission", paced), ("reservation, given back", reserved)]
    if stacked_scope is not None:
        steps.append(("stacked reservation (2 scopes), given back", stacked))
    found: dict[str, list[Work]] = {op: [] for op, _ in steps}
    for _ in range(rounds):
        for op, step in steps:
            before = settle(admin, QUIET_SYNC)
            for i in range(n):
                step(i)
            found[op].append(Work.between(before, settle(admin, QUIET_SYNC), n))
    target.close()
    admin.close()
    rows = []
    for op, works in found.items():
        row = {"group": "store primitives", "library": "taskdedup", "operation": op, "ops": n}
        row |= _median_dict([w.figures() for w in works])
        row["cpu_usec_per_op"] = _cpu(row, None)
        rows.append(row)
    return rows


def run(url: str, n: int = 700, rounds: int = 3) -> dict[str, Any]:
    """The "store_work" section of the results: rows per library and operation, leftovers."""
    started = time.monotonic()
    with private_redis(url) as own:
        store = own or url
        with peers_on(store):
            rows, left = _celery(url, store, n, rounds)
        rows += _taskiq_rows(store, n, rounds)
        primitives = _primitives(store, n, rounds)
    print(f"store work counted in {time.monotonic() - started:.0f} s")
    return {
        "store_server": PRIVATE if own else url,
        "ops_per_batch": n,
        "rounds": rounds,
        "quiet_s": {"taskdedup": QUIET, "others": QUIET_SYNC},
        "rows": rows,
        "leftovers": left,
        "primitives": primitives,
    }


COLUMNS = (NEW, FIRST, AGAIN, DRAINED, "over", "keys", "mb")


def table(section: dict[str, Any]) -> str:
    """The docs' "Store work per operation" table: one line per layout and library."""
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in section["rows"]:
        line = cells.setdefault((r["group"], r["library"]), {})
        line[r["operation"]] = f"{r['commands_per_op']:.1f} / {r['cpu_usec_per_op']:.0f}"
        if "over_plain" in r:
            over = r["over_plain"]
            line["over"] = f"{over['commands_per_op']:+.1f} / {over['cpu_usec_per_op']:+.0f}"
    for r in section["leftovers"]:
        line = cells[(r["group"], r["library"])]
        line["keys"] = f"{r['keys_per_job']:.2f}"
        mb = r["mb_per_million_jobs_a_day"]
        line["mb"] = f"{mb:.1f}" + (" + keys without ttl" if r["keys_without_ttl"] else "")
    lines = [
        "| layout | library | new key | first duplicate | later duplicate | drained job"
        " | drained job over plain | keys left per job | MB per million jobs a day |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (group, library), line in cells.items():
        figures = " | ".join(line.get(k, "") for k in COLUMNS)
        lines.append(f"| {group} | {library} | {figures} |")
    return "\n".join(lines)


NOTE = (
    "Each cell: Redis commands / Redis µs per operation, read from `INFO commandstats` of"
    " {where}. Commands: every cmdstat_* summed (a script counts as its EVALSHA and each"
    " command it runs). µs: each command's time once: an EVALSHA's time includes the commands"
    " its script runs, so those are not added again (where the broker runs the same commands"
    " itself, plain's time for them on that layout is, and for a drop-in's enqueue its original's"
    " own SET NX; the JSON keeps the plain sum too), median of"
    " {rounds} rounds of {n} enqueues of new keys (with taskdedup's batched confirmations),"
    " first duplicates of {m} queued jobs, {n} more duplicates of one of them, and the"
    " solo worker's drain of the {n} new jobs (claim, run, finish). Plain's row is its broker's"
    " own work where the broker is the store's Redis (fused; taskiq), and is in the others'"
    " too; {zero}. Keys left:"
    " under the library's prefix once the drained jobs (never duplicated) finished; MB: their"
    " MEMORY USAGE x remaining ttl, per million such jobs a day."
)


def text(section: dict[str, Any]) -> str:
    n = section["ops_per_batch"]
    own = section["store_server"] == PRIVATE
    note = NOTE.format(
        n=n,
        m=max(1, n // 4),
        rounds=section["rounds"],
        where="a private redis-server that holds the store alone" if own else "the store's Redis",
        zero="on RabbitMQ and store apart (here the broker is another server) it is 0"
        if own
        else "on RabbitMQ it is 0 (store apart: the broker is another database of that server)",
    )
    prims = section.get("primitives") or []
    lines = ["| primitive | commands / µs per operation |", "|---|---:|"]
    lines += [
        f"| {r['operation']} | {r['commands_per_op']:.1f} / {r['cpu_usec_per_op']:.0f} |"
        for r in prims
    ]
    extra = ("\n\nThe store's primitives on their own (same counting):\n\n" + "\n".join(lines)
             if prims else "")  # fmt: skip
    return "**Store work per operation**\n\n" + table(section) + "\n\n" + note + extra
