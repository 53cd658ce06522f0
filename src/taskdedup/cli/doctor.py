"""``taskdedup doctor``: the settings that bite users, checked against the live store and app.

Each check gives findings at one of three levels; the command's exit code is the worst level
found (0 nothing wrong, 1 warnings, 2 errors), so a deploy script can gate on it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any, Literal

from ..errors import StoreUnavailable
from ..policy import HOLD_WHILE_RUNNING, RUN_LOCKING
from ..stores.base import Inspect
from .doctor_sql import sql_findings
from .target import Target

Level = Literal["ok", "warning", "error"]
EXIT = {"ok": 0, "warning": 1, "error": 2}
#: How far the host's clock may be from the store's before it is worth a warning (leases and
#: expiries are timed by the store; ages the tools show are read against this host's clock).
CLOCK_SKEW = 2.0


@dataclasses.dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    message: str


def run_checks(target: Target) -> list[Finding]:
    """Every check that applies to ``target``; the store's first (the rest need it)."""
    found = list(_store(target))
    if any(f.check == "store" and f.level == "error" for f in found):
        return found
    found += _redis_server(target)
    found += [Finding(*f) for f in sql_findings(target.store)]  # type: ignore[arg-type]
    return found + policy_findings(target)


def policy_findings(target: Target) -> list[Finding]:
    """The checks of the policies alone, which need no store (``check_policies`` in tests)."""
    found = list(_policies(target))
    if target.app is not None:
        found += _celery(target)
    return found


def _store(target: Target) -> Iterator[Finding]:
    try:
        target.store.run(Inspect("taskdedup-doctor-probe"))
    except StoreUnavailable as exc:
        yield Finding("error", "store", f"the store does not answer: {exc}")
        return
    yield Finding("ok", "store", f"answers ({type(target.store).__name__}, {target.store.prefix})")


def _redis_server(target: Target) -> Iterator[Finding]:
    from ..stores.redis import RedisStore
    from ..stores.redis_calls import SOURCES

    store = target.store
    if not isinstance(store, RedisStore):
        return
    client = store.client
    try:
        for source in SOURCES.values():
            client.script_load(source)
        yield Finding("ok", "scripts", f"{len(SOURCES)} scripts load")
    except Exception as exc:
        yield Finding("error", "scripts", f"the store's scripts do not load: {exc}")
    try:
        seconds, micros = client.time()
        skew = time.time() - (int(seconds) + int(micros) / 1e6)
        level: Level = "warning" if abs(skew) > CLOCK_SKEW else "ok"
        yield Finding(level, "clock", f"this host is {skew:+.3f} s from the store's clock")
    except Exception as exc:  # a Cluster client answers per node: not worth failing on
        yield Finding("warning", "clock", f"could not read the store's clock: {exc}")
    yield from _eviction(client)


def _eviction(client: Any) -> Iterator[Finding]:
    try:
        config = client.config_get("maxmemory*")
    except Exception as exc:  # managed Redis often forbids CONFIG
        yield Finding("warning", "eviction", f"could not read maxmemory-policy ({exc}); "
                      "make sure it is noeviction: any other policy can evict locks")  # fmt: skip
        return
    policy = config.get("maxmemory-policy", "noeviction")
    limit = int(config.get("maxmemory", 0) or 0)
    if policy == "noeviction" or limit == 0:
        yield Finding("ok", "eviction", f"maxmemory-policy {policy}, maxmemory {limit}")
        return
    yield Finding(
        "error",
        "eviction",
        f"maxmemory-policy is {policy} with maxmemory {limit}: Redis may evict locks (every "
        "taskdedup key has a ttl, so volatile-* policies evict them too) and a duplicate then "
        "runs; set maxmemory-policy noeviction, or give taskdedup a Redis of its own",
    )


def _policies(target: Target) -> Iterator[Finding]:
    for name, tp in sorted(target.policies.items()):
        p = tp.policy
        if p.lease_seconds > p.ttl_seconds:
            yield Finding(
                "warning",
                "policy",
                f"{name}: lease {p.lease_seconds:g}s is longer than ttl {p.ttl_seconds:g}s; "
                "a crashed worker's key stays until the lease ends; use a lease under the ttl",
            )
    if target.policies:
        yield Finding("ok", "policy", f"{len(target.policies)} deduplicated task(s) read")


def _celery(target: Target) -> Iterator[Finding]:
    app = target.app
    conf = app.conf
    options = conf.broker_transport_options or {}
    url = str(conf.broker_url or "")
    visibility = options.get("visibility_timeout")
    if visibility is None and url.startswith(("redis", "rediss", "sqs", "sentinel")):
        visibility = 3600  # kombu's default for these transports
    for name, tp in sorted(target.policies.items()):
        task = app.tasks.get(name)
        if task is None:
            continue
        p = tp.policy
        limit = task.time_limit or conf.task_time_limit
        holds = p.strategy in HOLD_WHILE_RUNNING or p.strategy in RUN_LOCKING
        if limit and p.ttl_seconds < limit and not holds:
            yield Finding(
                "warning",
                "policy",
                f"{name}: ttl {p.ttl_seconds:g}s is shorter than its time limit {limit}s; "
                "a duplicate sent after the ttl runs beside it; raise the ttl",
            )
        if not (task.acks_late or conf.task_acks_late):
            yield Finding(
                "warning",
                "acks_late",
                f"{name}: acks_late is off: a worker killed mid-job loses the job (the broker "
                "does not deliver it again); its key frees after the lease. Set acks_late=True "
                "(with task_reject_on_worker_lost) to have it run again",
            )
        held = p.debounce_ms[0] / 1000  # debounce: a delivery held back until its run is due
        if visibility is not None and held + (limit or 0) + p.lease_seconds + 1 > visibility:
            also = f" and its debounce delay ({held:g}s)" if held else ""
            yield Finding(
                "error",
                "visibility",
                f"{name}: the broker's visibility_timeout ({visibility}s) is shorter than the "
                f"task's time limit plus its lease ({limit or 0}s + {p.lease_seconds:g}s){also}"
                ": the broker delivers a held or running job again, and each copy is sent back; "
                "raise broker_transport_options['visibility_timeout']",
            )
