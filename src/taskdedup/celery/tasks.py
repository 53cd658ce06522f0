"""Per-task declarations: ``@deduplicate(...)`` and ``@reserve(...)`` (or the ``deduplicate=``
and ``reserve=`` task options), ``@idempotent``.

A declaration is stored on the task (``task.deduplicate``, ``task.reserve``), so a policy set on
a base class is inherited by its subclasses, and read when the task is published or run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from ..errors import ConfigError
from ..policy import OnConflict, Seconds, Strategy, TaskPolicy, given_options
from ..reservations import DEFAULT_TTL, ReservePolicy
from ..settings import Settings

T = TypeVar("T")
_BOUND = "_taskdedup_bound"
_LIMITS = "_taskdedup_limits"


def deduplicate(
    strategy: Strategy | None = None,
    *,
    ttl: Seconds | None = None,
    lease: Seconds | None = None,
    keys: Sequence[str] | None = None,
    key: Callable[..., Any] | str | None = None,
    on_conflict: OnConflict | None = None,
    including_scheduled: bool | None = None,
    per_queue: bool | None = None,
    max_attempts: int | None = None,
) -> Callable[[T], T]:
    """Deduplicate a Celery task; stack it on ``@app.task`` or put it on a Task class.

    Options left out take the app's defaults (``taskdedup_default_strategy`` and friends).
    A bad option raises ConfigError here, when the task is defined.
    """
    options = given_options(locals())

    def apply(task: T) -> T:
        task.deduplicate = options  # type: ignore[attr-defined]
        _check(task)
        return task

    return apply


def reserve(
    max_concurrent: int, scope: str | Callable[..., Any], ttl: Seconds = DEFAULT_TTL
) -> Callable[[T], T]:
    """Cap a Celery task at ``max_concurrent`` jobs in flight per scope; stack it on
    ``@app.task`` or put it on a Task class. Over the cap, ``apply_async`` raises
    QuotaExceeded and publishes nothing. ``scope``: an argument name or a callable of the
    task's arguments; ``ttl``: seconds a slot lives from reservation until the job starts."""
    options = {"max_concurrent": max_concurrent, "scope": scope, "ttl": ttl}
    ReservePolicy.from_options(options)  # validate now

    def apply(task: T) -> T:
        task.reserve = options  # type: ignore[attr-defined]
        _check(task)
        return task

    return apply


def idempotent(task: T) -> T:
    """Declare a task safe to run twice (read by the tools and the testing helper)."""
    task.idempotent = True  # type: ignore[attr-defined]
    return task


def task_function(task: Any) -> Callable[..., Any]:
    """The function whose signature the task's arguments bind to (``run``, without ``self``)."""
    run = getattr(task, "_taskdedup_run", None) or task.run
    return cast(Callable[..., Any], getattr(run, "__wrapped__", run))


def _check(task: Any) -> None:
    """Bind the declaration now when the task is concrete, so bad ``keys=`` fail at definition."""
    name = getattr(task, "name", None)
    if isinstance(task, type) or not name:
        return
    options = getattr(task, "deduplicate", None)
    if options is not None:
        Settings().policy(options).bind(name, task_function(task))
    task_limits(task)


def task_policy(task: Any, defaults: Settings) -> TaskPolicy | None:
    """The task's bound policy (cached on the task), or None when it declares none."""

    def bind(options: Any) -> TaskPolicy:
        try:
            return defaults.policy(options).bind(task.name, task_function(task))
        except ConfigError as exc:
            raise ConfigError(f"task {task.name!r}: {exc}") from None

    return cast("TaskPolicy | None", _declared(task, "deduplicate", _BOUND, bind))


def task_limits(task: Any) -> ReservePolicy | None:
    """The task's reservation cap (cached on the task), or None when it declares none."""

    def build(options: Any) -> ReservePolicy:
        try:
            limits = ReservePolicy.from_options(options)
            limits.check(task.name, task_function(task))
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"task {task.name!r}: reserve: {exc}") from None
        return limits

    return cast("ReservePolicy | None", _declared(task, "reserve", _LIMITS, build))


def _declared(task: Any, name: str, cache: str, build: Callable[[Any], T]) -> T | None:
    """``build(task.<name>)``, kept on the task under ``cache`` until the declaration changes
    (a subclass may declare its own); None when the task declares nothing."""
    options = getattr(task, name, None)
    if options is None or options is False:
        return None
    cached = getattr(task, cache, None)
    if cached is not None and cached[0] is options:
        return cast(T, cached[1])
    built = build(options)
    setattr(task, cache, (options, built))
    return built
