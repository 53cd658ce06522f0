"""Policy: how one task is deduplicated, checked when the task is defined.

A :class:`Policy` is framework-free and reusable; :meth:`Policy.bind` ties it to one task
(name and function), validating ``keys=`` against the signature, and gives a :class:`TaskPolicy`
that turns a call's arguments into the dedup key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, TypedDict, get_args

from . import keys as _keys
from .errors import ConfigError, KeyEncodingError

Strategy = Literal[
    "until_executing",
    "until_executed",
    "until_expired",
    "while_executing",
    "until_and_while_executing",
    "debounce",
]
OnConflict = Literal["drop", "raise", "reschedule_once", "supersede"]
#: supersede, once the job runs: wait for it to end ("wait"), or ask it to stop ("cancel")
Running = Literal["wait", "cancel"]
#: a scheduler's tick that finds the last run still holding its key: "skip" it, "buffer_one"
#: (one run after the running one, with the latest such tick's arguments), or "allow" it to
#: run beside (the tick takes a key of its own)
Overlap = Literal["skip", "buffer_one", "allow"]
OVERLAPS: tuple[str, ...] = get_args(Overlap)

STRATEGIES: tuple[str, ...] = get_args(Strategy)
ON_CONFLICT: tuple[str, ...] = get_args(OnConflict)

DEFAULT_TTL = 6 * 3600.0
DEFAULT_LEASE = 30.0

#: Strategies that take a lock when the job is enqueued.
ENQUEUE_LOCKING = frozenset(
    {"until_executing", "until_executed", "until_expired", "until_and_while_executing", "debounce"}
)
#: Strategies whose enqueue lock is kept while the job runs (renewed by a lease).
HOLD_WHILE_RUNNING = frozenset({"until_executed", "until_expired"})
#: Strategies that take a run lock so two jobs of one key never run at once.
RUN_LOCKING = frozenset({"while_executing", "until_and_while_executing", "debounce"})

Seconds = float | int | timedelta


#: The longest duration taken (ten years): a longer one is a mistake (a value in ms, say).
MAX_SECONDS = 10 * 365 * 24 * 3600.0


def seconds(
    value: Seconds | None, *, name: str, allow_none: bool = False, allow_zero: bool = False
) -> float | None:
    """Read a duration given as seconds or a timedelta; reject negatives, and zero unless
    ``allow_zero``."""
    if value is None:
        if allow_none:
            return None
        raise ConfigError(f"{name} is required")
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be seconds (a number) or a timedelta, not {value!r}")
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise ConfigError(
            f"{name} must be a finite number of seconds, at most {MAX_SECONDS:g} (ten years), "
            f"got {value!r}"
        )
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound} seconds, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Policy:
    """How to deduplicate one task.

    strategy: when the lock is taken and released (the table of docs/strategies/index.md).
    ttl: seconds the enqueue lock lives at most (plus the delay of a scheduled job).
    lease: seconds a running job's lock lives without a heartbeat; a crash frees it after this.
    keys: names of the arguments that form the key (default: all of them).
    key: a callable of the task's arguments, or a constant string, that gives the key instead.
    on_conflict: what a duplicate enqueue does: "drop" (return the holder's job),
        "raise" (DuplicateJob), "reschedule_once" (one more run after the holder ends) or
        "supersede" (the queued job runs with the latest arguments; once it started, as
        reschedule_once).
    including_scheduled: also deduplicate jobs sent with an ETA or countdown.
    per_queue: jobs of one task on different queues do not deduplicate each other.
    max_attempts: how many times a job whose worker died may be taken over (None: no limit).
    delay: (debounce) seconds of quiet after the last submission of a key before its one run.
    max_wait: (debounce) seconds at most from a burst's first submission to its run, however
        busy the key stays (None: the ttl bounds it).
    running: (supersede) "cancel": a submission while the job runs asks it to stop
        (``taskdedup.superseded()`` turns True through its lease renewals); "wait" (default)
        lets it run on. Either way the submission's run comes after it ends.
    overlap: a scheduler's tick (Celery beat, taskiq's scheduler) while the last run still
        holds the key: "skip" (default) sends nothing; "buffer_one" owes one run after the
        running one with the latest tick's arguments (needs until_executed; a duplicate
        that is not a tick then owes that run too, as with reschedule_once); "allow" sends
        the tick under a key of its own, so it runs beside the last run.
    """

    strategy: Strategy = "until_executing"
    ttl: Seconds = DEFAULT_TTL
    lease: Seconds = DEFAULT_LEASE
    keys: Sequence[str] | None = None
    key: Callable[..., Any] | str | None = None
    on_conflict: OnConflict = "drop"
    including_scheduled: bool = False
    per_queue: bool = False
    max_attempts: int | None = None
    delay: Seconds | None = None
    max_wait: Seconds | None = None
    running: Running = "wait"
    overlap: Overlap = "skip"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if self.on_conflict not in ON_CONFLICT:
            raise ConfigError(
                f"unknown on_conflict {self.on_conflict!r}; choose one of {', '.join(ON_CONFLICT)}"
            )
        object.__setattr__(self, "ttl", seconds(self.ttl, name="ttl"))
        object.__setattr__(self, "lease", seconds(self.lease, name="lease"))
        if self.keys is not None and self.key is not None:
            raise ConfigError("give keys=[...] or key=..., not both")
        if self.keys is not None:
            if isinstance(self.keys, str) or not all(isinstance(k, str) for k in self.keys):
                raise ConfigError(f"keys must be a list of argument names, not {self.keys!r}")
            object.__setattr__(self, "keys", tuple(self.keys))
        if self.key is not None and not (callable(self.key) or isinstance(self.key, str)):
            raise ConfigError(f"key must be a callable or a string, not {self.key!r}")
        if self.on_conflict == "reschedule_once" and self.strategy == "until_expired":
            raise ConfigError(
                "on_conflict='reschedule_once' cannot be used with until_expired: the lock "
                "outlives the job, so there is no end to reschedule after"
            )
        if self.on_conflict == "supersede" and self.strategy != "until_executed":
            raise ConfigError(
                f"on_conflict='supersede' needs strategy='until_executed' (not "
                f"{self.strategy!r}): the lock must stay held while the job runs, so that a "
                "submission then owes one more run with its arguments"
            )
        if self.running not in ("wait", "cancel"):
            raise ConfigError(f"running must be 'wait' or 'cancel', not {self.running!r}")
        if self.running == "cancel" and self.on_conflict != "supersede":
            raise ConfigError(
                "running='cancel' asks a running job to stop for a newer submission, which "
                "only on_conflict='supersede' makes; add on_conflict='supersede' (with "
                "strategy='until_executed')"
            )
        if self.strategy == "while_executing" and self.on_conflict != "drop":
            raise ConfigError(
                "while_executing never drops a duplicate (it waits its turn), so on_conflict "
                "does not apply; leave it at 'drop' or use until_and_while_executing"
            )
        self._check_overlap()
        self._check_debounce()
        if self.max_attempts is not None and (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ConfigError(
                f"max_attempts must be None or an int >= 1, not {self.max_attempts!r}"
            )

    def _check_overlap(self) -> None:
        check_overlap(self.overlap, "overlap")
        if self.overlap == "buffer_one" and self.strategy != "until_executed":
            raise ConfigError(
                f"overlap='buffer_one' needs strategy='until_executed' (not {self.strategy!r}): "
                "the lock must stay held while the job runs, so that a tick then owes the "
                "one run after it"
            )

    @property
    def owes_runs(self) -> bool:
        """Whether a duplicate while the job runs owes one more run after it ends."""
        return self.on_conflict in ("reschedule_once", "supersede") or self.overlap == "buffer_one"

    def _check_debounce(self) -> None:
        """debounce needs a ``delay``; ``delay`` and ``max_wait`` mean nothing elsewhere. The
        run must come before the lock's ttl ends: ``delay <= max_wait < ttl``."""
        if self.strategy != "debounce":
            for name in ("delay", "max_wait"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{name} applies to the debounce strategy only (this policy is "
                        f"{self.strategy}); remove it or use strategy='debounce'"
                    )
            return
        if self.delay is None:
            raise ConfigError(
                "debounce needs delay=<seconds>: how long a key must stay quiet before its run"
            )
        delay = seconds(self.delay, name="delay")
        object.__setattr__(self, "delay", delay)
        wait = seconds(self.max_wait, name="max_wait", allow_none=True)
        object.__setattr__(self, "max_wait", wait)
        assert delay is not None
        if wait is not None and wait < delay:
            raise ConfigError(
                f"max_wait ({wait:g}s) must be >= delay ({delay:g}s): the run comes at most "
                "max_wait after a burst's first submission, and at least delay after its last"
            )
        limit = self.ttl_seconds
        if (wait if wait is not None else delay) >= limit:
            raise ConfigError(
                f"debounce: {'max_wait' if wait is not None else 'delay'} "
                f"({wait if wait is not None else delay:g}s) must be shorter than ttl "
                f"({limit:g}s), which the key's lock lives at most; raise ttl"
            )
        if self.on_conflict != "drop":
            raise ConfigError(
                f"debounce answers every submission of a burst with the one run it makes, so "
                f"on_conflict={self.on_conflict!r} does not apply; leave it at 'drop'"
            )

    @property
    def debounce_ms(self) -> tuple[int, int]:
        """(delay, max_wait) in ms for debounce, max_wait defaulting to ttl - delay; (0, 0)
        for the other strategies."""
        if self.strategy != "debounce" or self.delay is None:
            return 0, 0
        delay = float(self.delay)  # type: ignore[arg-type]
        wait = self.max_wait if self.max_wait is not None else self.ttl_seconds - delay
        return round(delay * 1000), round(float(wait) * 1000)  # type: ignore[arg-type]

    @property
    def ttl_seconds(self) -> float:
        return float(self.ttl)  # type: ignore[arg-type]

    @property
    def lease_seconds(self) -> float:
        return float(self.lease)  # type: ignore[arg-type]

    @classmethod
    def from_options(cls, options: Policy | Mapping[str, Any] | str) -> Policy:
        """A Policy from a Policy, a strategy name, or a mapping of Policy's arguments."""
        if isinstance(options, Policy):
            return options
        if isinstance(options, str):
            return cls(strategy=options)  # type: ignore[arg-type]
        if isinstance(options, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(options) - known)
            if unknown:
                raise ConfigError(
                    f"unknown deduplicate option(s) {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}"
                )
            return cls(**options)
        raise ConfigError(
            f"deduplicate= takes a Policy, a strategy name or a dict, not {options!r}"
        )

    def bind(self, task: str, fn: Callable[..., Any] | None) -> TaskPolicy:
        """Tie this policy to one task; unknown ``keys=`` names raise ConfigError now."""
        if self.keys is not None:
            if fn is None:
                raise ConfigError(f"task {task!r}: keys= needs the task function to check them")
            params = _keys.signature_parameters(fn)
            missing = [k for k in self.keys if k not in params]
            if missing:
                raise ConfigError(
                    f"task {task!r}: keys= names {', '.join(map(repr, missing))}, which the task "
                    f"does not take; its parameters are: {', '.join(params) or '(none)'}"
                )
        return TaskPolicy(task=task, fn=fn, policy=self)


class PolicyOptions(TypedDict, total=False):
    """The options of both adapters' ``@deduplicate(strategy, **options)``: Policy's fields
    other than the strategy, each None (or left out) for the default."""

    ttl: Seconds | None
    lease: Seconds | None
    keys: Sequence[str] | None
    key: Callable[..., Any] | str | None
    on_conflict: OnConflict | None
    including_scheduled: bool | None
    per_queue: bool | None
    max_attempts: int | None
    delay: Seconds | None
    max_wait: Seconds | None
    running: Running | None
    overlap: Overlap | None


def check_overlap(value: Any, option: str) -> None:
    """An overlap value that does not exist is a ConfigError naming ``option``."""
    if value not in OVERLAPS:
        raise ConfigError(f"unknown {option} {value!r}; choose one of {', '.join(OVERLAPS)}")


def given_options(parameters: dict[str, Any]) -> dict[str, Any]:
    """The policy options a decorator was given (``locals()`` at its top; None = left out),
    validated now, so a bad one fails where the task is defined."""
    options = {name: value for name, value in parameters.items() if value is not None}
    Policy.from_options(options)
    return options


@dataclasses.dataclass(frozen=True)
class TaskPolicy:
    """A Policy tied to one task: computes the dedup key of a call."""

    task: str
    fn: Callable[..., Any] | None
    policy: Policy

    @property
    def keeps_arguments(self) -> bool:
        """Whether a duplicate's arguments are kept: for the run it owes (reschedule_once,
        buffer_one), or as the burst's latest (debounce, whose run takes them); only then does
        a caller serialize them."""
        p = self.policy
        return p.owes_runs or p.strategy == "debounce"

    @property
    def runs_latest(self) -> bool:
        """Whether a queued job runs with the latest duplicate's arguments rather than its
        own message's: debounce, and supersede."""
        p = self.policy
        return p.strategy == "debounce" or p.on_conflict == "supersede"

    def key_for(
        self,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        queue: str | None = None,
    ) -> str:
        """The fixed-length dedup key of one call (G8: equal calls share a key)."""
        kwargs = kwargs or {}
        p = self.policy
        if isinstance(p.key, str):
            encoded = _keys.encode_arguments(self.task, {"key": p.key})
        elif p.key is not None:
            try:
                value = p.key(*args, **kwargs)
            except Exception as exc:
                raise KeyEncodingError(self.task, "key", f"callable failed: {exc!r}") from exc
            encoded = _keys.encode_arguments(self.task, {"key": value})
        elif self.fn is None:
            encoded = _keys.encode_arguments(self.task, {"args": list(args), "kwargs": kwargs})
        else:
            bound = _keys.bind_arguments(self.task, self.fn, args, kwargs)
            if p.keys is not None:
                bound = {name: bound[name] for name in p.keys if name in bound}
            encoded = _keys.encode_arguments(self.task, bound)
        return _keys.digest(self.task, encoded, queue if p.per_queue else None)
