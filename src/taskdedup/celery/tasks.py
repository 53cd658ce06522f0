"""Per-task declarations: ``@deduplicate(...)``, the ``deduplicate=`` task option, ``@idempotent``.

A declaration is stored on the task (``task.deduplicate``), so a policy set on a base class is
inherited by its subclasses, and read when the task is published or run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from ..errors import ConfigError
from ..policy import OnConflict, Policy, Seconds, Strategy, TaskPolicy
from ..settings import Settings

T = TypeVar("T")
_BOUND = "_taskdedup_bound"


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
    options = {
        name: value
        for name, value in {
            "strategy": strategy,
            "ttl": ttl,
            "lease": lease,
            "keys": keys,
            "key": key,
            "on_conflict": on_conflict,
            "including_scheduled": including_scheduled,
            "per_queue": per_queue,
            "max_attempts": max_attempts,
        }.items()
        if value is not None
    }
    Policy.from_options(options)  # validate now

    def apply(task: T) -> T:
        task.deduplicate = options  # type: ignore[attr-defined]
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


def task_policy(task: Any, defaults: Settings) -> TaskPolicy | None:
    """The task's bound policy (cached on the task), or None when it declares none."""
    options = getattr(task, "deduplicate", None)
    if options is None or options is False:
        return None
    cached = getattr(task, _BOUND, None)
    if cached is not None and cached[0] is options:
        return cast(TaskPolicy, cached[1])
    try:
        bound: TaskPolicy = defaults.policy(options).bind(task.name, task_function(task))
    except ConfigError as exc:
        raise ConfigError(f"task {task.name!r}: {exc}") from None
    setattr(task, _BOUND, (options, bound))
    return bound
