"""Settings flags: from code (constructor arguments or Celery's ``app.conf.taskdedup_*``),
overridden by ``TASKDEDUP_*`` environment variables, so operators can flip them without a deploy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

from .errors import ConfigError
from .policy import DEFAULT_LEASE, DEFAULT_TTL, STRATEGIES, Policy, Strategy, seconds
from .suggest import did_you_mean

OnStoreError = Literal["enqueue", "raise"]
_SECONDS = ("default_ttl", "default_lease", "grace", "remember_finished", "idempotency_ttl")
OnMismatch = Literal["raise", "return"]
Eager = Literal["faithful", "bypass"]
OncePerTick = Literal["deduplicated", "all", "off"]
ENV_PREFIX = "TASKDEDUP_"
_FLAGS = ("enabled", "dry_run", "fused_publish", "metrics", "history")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How taskdedup behaves in this process (every field has a ``TASKDEDUP_<NAME>`` variable).

    url: the store, e.g. ``redis://127.0.0.1:6379/0``; None means the adapter's default.
    enabled: the kill switch; False publishes and runs everything without deduplication.
    dry_run: decide and log as usual, but drop, raise and skip nothing.
    disabled_tasks: task names that are never deduplicated.
    default_strategy, default_ttl, default_lease: what a task's policy leaves unsaid.
    on_store_error: "enqueue" publishes without dedup when the store is down (and logs it);
        "raise" raises StoreUnavailable to the caller.
    key_prefix: the prefix of every key the store writes.
    grace: seconds a fresh lock lives until its publish is confirmed (G11).
    remember_finished: seconds a finished job id is remembered, so a redelivered copy of it
        does not run again (G7).
    idempotency_ttl: seconds an idempotency key answers with its original job (default 24 h).
    idempotency_on_mismatch: a key reused with another task or other arguments: "raise"
        IdempotencyKeyMismatch, or "return" the original job.
    idempotency_wait: seconds a submission waits for another submission of its key that is
        still being published (it may fail and free the key) before IdempotencyKeyInProgress;
        0 never waits. The sync API blocks its thread while it waits.
    reschedule_payload_limit: bytes of arguments a reschedule_once call may store with the
        lock (the latest duplicate's, for the run owed after the current one); a larger call
        raises PayloadTooLarge before anything is written; 0: no limit.
    fused_publish: on a Redis broker whose server and database the store shares, take a fresh
        key's lock in the broker's own push, one round trip (Celery: by hooking kombu's Redis
        ``Channel._put``; taskiq-redis ListQueueBroker: in the kick). False: take the lock, then
        publish, as on every other layout.
    eager: Celery's eager mode (``task_always_eager``, ``task.apply()``): "faithful" takes the
        enqueue decision before the job runs in the caller, so a duplicate is not run, as in
        production; "bypass" runs every call, deduplicating nothing.
    history: keep each key's decision history for ``taskdedup explain`` (True, the default):
        what a person asks about (a duplicate, a wait, a dropped copy, a retry, a hand-off, a
        lock freed or unlocked), at most 20 entries a key, kept a day after the last. The
        ordinary life of a job is not written there: explain reads it from the lock and the
        job's record. False writes no history at all.
    once_per_tick: which scheduler sends (Celery beat, taskiq's scheduler) are sent once per
        tick of their schedule entry, however many schedulers run: "deduplicated" (the
        default) the entries of deduplicated tasks, "all" every entry, "off" none. A second
        send of a tick, or a late send of an earlier one, returns the tick's job.
    metrics: count every decision, store call and lease in Prometheus metrics on
        prometheus_client's default registry (the ``prometheus`` extra; see
        :mod:`taskdedup.metrics`).
    """

    url: str | None = None
    enabled: bool = True
    dry_run: bool = False
    disabled_tasks: frozenset[str] = frozenset()
    default_strategy: Strategy = "until_executing"
    default_ttl: float = DEFAULT_TTL
    default_lease: float = DEFAULT_LEASE
    on_store_error: OnStoreError = "enqueue"
    key_prefix: str = "taskdedup"
    grace: float = 60.0
    remember_finished: float = 3600.0
    idempotency_ttl: float = 86400.0
    idempotency_on_mismatch: OnMismatch = "raise"
    idempotency_wait: float = 5.0
    reschedule_payload_limit: int = 65536
    fused_publish: bool = True
    metrics: bool = False
    history: bool = True
    eager: Eager = "faithful"
    once_per_tick: OncePerTick = "deduplicated"

    def __post_init__(self) -> None:
        if isinstance(self.disabled_tasks, str):
            object.__setattr__(self, "disabled_tasks", frozenset(_split(self.disabled_tasks)))
        else:
            object.__setattr__(self, "disabled_tasks", frozenset(self.disabled_tasks))
        if self.default_strategy not in STRATEGIES:
            raise ConfigError(
                f"default_strategy {self.default_strategy!r} is unknown; "
                f"choose one of {', '.join(STRATEGIES)}"
            )
        if self.on_store_error not in get_args(OnStoreError):
            raise ConfigError(
                f"on_store_error must be 'enqueue' or 'raise', not {self.on_store_error!r}"
            )
        if self.eager not in get_args(Eager):
            raise ConfigError(f"eager must be 'faithful' or 'bypass', not {self.eager!r}")
        if self.once_per_tick not in get_args(OncePerTick):
            raise ConfigError(
                f"once_per_tick must be 'deduplicated', 'all' or 'off', not {self.once_per_tick!r}"
            )
        if self.idempotency_on_mismatch not in get_args(OnMismatch):
            raise ConfigError(
                "idempotency_on_mismatch must be 'raise' or 'return', "
                f"not {self.idempotency_on_mismatch!r}"
            )
        for name in _FLAGS:
            object.__setattr__(self, name, _flag(name, getattr(self, name)))
        for name in _SECONDS:
            object.__setattr__(self, name, seconds(getattr(self, name), name=name))
        limit = self.reschedule_payload_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(
                f"reschedule_payload_limit must be a number of bytes >= 0 (0: no limit), "
                f"not {limit!r}"
            )
        wait = seconds(self.idempotency_wait, name="idempotency_wait", allow_zero=True)
        object.__setattr__(self, "idempotency_wait", wait)  # 0: a repeat never waits
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ConfigError(f"key_prefix must be non-empty, without braces: {self.key_prefix!r}")

    def store_options(self) -> dict[str, Any]:
        """What a store made from these settings is told (any store takes these)."""
        return {"key_prefix": self.key_prefix, "history": self.history}

    @classmethod
    def load(
        cls, values: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from ``values`` (code), each overridden by its ``TASKDEDUP_*`` variable."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        merged: dict[str, Any] = {}
        for name, value in (values or {}).items():
            if name not in fields:
                raise ConfigError(f"unknown taskdedup setting {name!r}{did_you_mean(name, fields)}")
            if value is not None:
                merged[name] = value
        env = os.environ if environ is None else environ
        for name in fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                merged[name] = _parse(name, raw)
        return cls(**merged)

    def policy(self, options: Policy | Mapping[str, Any] | str | None = None) -> Policy:
        """A task's Policy with this process's defaults filling what the task leaves unsaid."""
        if isinstance(options, Policy):
            return options
        base: dict[str, Any] = {
            "strategy": self.default_strategy,
            "ttl": self.default_ttl,
            "lease": self.default_lease,
        }
        if isinstance(options, str):
            base["strategy"] = options
        elif options is not None:
            base.update(options)
        return Policy.from_options(base)


def _split(raw: str) -> Iterable[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _flag(name: str, value: Any) -> bool:
    """A yes/no setting: a bool, or the strings an environment or a settings file gives
    ("true"/"false", "1"/"0", "yes"/"no", "on"/"off"); anything else is an error, not True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    raise ConfigError(f"{name} must be True or False (or 'true'/'false'), not {value!r}")


def _parse(name: str, raw: str) -> Any:
    if name in _FLAGS:
        try:
            return _flag(name, raw)
        except ConfigError:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: use true or false") from None
    if name == "disabled_tasks":
        return frozenset(_split(raw))
    if name == "reschedule_payload_limit":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"{ENV_PREFIX}{name.upper()}={raw!r}: use a number of bytes"
            ) from None
    if name in (*_SECONDS, "idempotency_wait"):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: use seconds") from None
    return raw.strip()
