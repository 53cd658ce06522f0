"""How a task's declaration becomes its policy and its cap, the same for both adapters: the
options checked where they are written, bound to the task's function, every error naming the
task, and the result kept on the task until its declaration changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from .errors import ConfigError
from .pacing import PacePolicy
from .policy import TaskPolicy, given_options
from .reservations import ReservePolicy
from .settings import Settings
from .suggest import check_policy_names

T = TypeVar("T")
D = TypeVar("D", ReservePolicy, PacePolicy)


def decorator_options(given: dict[str, Any]) -> dict[str, Any]:
    """The options a ``@deduplicate(...)`` call gave, checked (ConfigError: a misspelled or
    bad option, naming the nearest valid one)."""
    check_policy_names({name: value for name, value in given.items() if value is not None})
    return given_options(given)


def bind_policy(settings: Settings, options: Any, task: str, fn: Callable[..., Any]) -> TaskPolicy:
    """``options`` (a dict, a Policy, a strategy name, True) over ``settings``' defaults,
    bound to ``fn``; a ConfigError names ``task``."""
    try:
        check_policy_names(options)
        policy = settings.policy(options)
    except ConfigError as exc:
        raise ConfigError(f"task {task!r}: {exc}") from None
    return policy.bind(task, fn)  # its errors name the task


def bind_limits(options: Any, task: str, fn: Callable[..., Any]) -> ReservePolicy:
    """A ``reserve`` declaration, checked against ``fn``; a ConfigError names ``task``."""
    return _bind(ReservePolicy, "reserve", options, task, fn)


def bind_pace(options: Any, task: str, fn: Callable[..., Any]) -> PacePolicy:
    """A ``pace`` declaration, checked against ``fn``; a ConfigError names ``task``."""
    return _bind(PacePolicy, "pace", options, task, fn)


def _bind(kind: type[D], option: str, options: Any, task: str, fn: Callable[..., Any]) -> D:
    try:
        declared = kind.from_options(options)
        declared.check(task, fn)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"task {task!r}: {option}: {exc}") from None
    return declared


def kept(owner: Any, options: Any, attr: str, build: Callable[[Any], T]) -> T | None:
    """``build(options)``, kept on ``owner`` under ``attr`` until the declaration changes (a
    subclass may declare its own); None when nothing is declared."""
    if options is None or options is False:
        return None
    cached = getattr(owner, attr, None)
    if cached is not None and cached[0] is options:
        return cast(T, cached[1])
    built = build(options)
    setattr(owner, attr, (options, built))
    return built


def own(owner: Any, attr: str) -> Any:
    """``owner``'s own ``attr`` (not one it inherits from a class), or None."""
    return vars(owner).get(attr) if owner is not None and hasattr(owner, "__dict__") else None


def stack_caps(options: Any, *previous: Any) -> Any:
    """A ``@reserve`` on a task that already declares one (the first of ``previous`` that is
    not None) adds its cap: stacked caps, a list of both, all taken together or none."""
    for before in previous:
        if before is not None and before is not options:
            return [*(before if isinstance(before, list) else [before]), options]
    return options
