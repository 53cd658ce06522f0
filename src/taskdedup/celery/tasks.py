"""Per-task declarations: ``@deduplicate(...)``, ``@reserve(...)`` and ``@pace(...)`` (or the
``deduplicate=``, ``reserve=`` and ``pace=`` task options).

A task option or a Task class keeps its declaration on the task (``task.deduplicate``,
``task.reserve``), so a policy set on a base class is inherited by its subclasses. The
decorators keep theirs on the task's function, so that they work on either side of
``@app.task`` and with ``@shared_task`` (whose proxy stands for another task object in every
app). Both are read when the task is published or run; the decorator's wins.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from celery.local import Proxy

from ..declare import bind_limits, bind_pace, bind_policy, decorator_options, kept, own, stack_caps
from ..errors import ConfigError
from ..pacing import PacePolicy
from ..policy import PolicyOptions, Seconds, Strategy, TaskPolicy
from ..reservations import DEFAULT_TTL, ReservePolicy
from ..settings import Settings

if TYPE_CHECKING:
    from typing_extensions import Unpack  # (typing's from Python 3.11)

T = TypeVar("T")
_BOUND = "_taskdedup_bound"
#: Where the decorators keep a declaration on a task's function.
FUNCTION_ATTR = "_taskdedup_deduplicate"
RESERVE_ATTR = "_taskdedup_reserve"
PACE_ATTR = "_taskdedup_pace"


def deduplicate(
    strategy: Strategy | None = None, **options: Unpack[PolicyOptions]
) -> Callable[[T], T]:
    """Deduplicate a Celery task: stack it on ``@app.task`` or ``@shared_task`` (either
    side), or put it on a Task class.

    Options left out take the app's defaults (``taskdedup_default_strategy`` and friends).
    A bad option raises ConfigError here, when the task is defined.
    """
    given = {"strategy": strategy, **options}
    return _decorator("deduplicate", FUNCTION_ATTR, lambda: decorator_options(given))


def reserve(
    max_concurrent: int, scope: str | Callable[..., Any] | None = None, ttl: Seconds = DEFAULT_TTL
) -> Callable[[T], T]:
    """Cap a Celery task at ``max_concurrent`` jobs in flight per scope; stack it on
    ``@app.task`` or ``@shared_task`` (either side), on a Task class, and on another
    ``@reserve`` (each cap holds at once). Over a cap, ``apply_async`` raises QuotaExceeded
    and publishes nothing. ``scope``: an argument name, a callable of the task's arguments,
    or None (the task as a whole); ``ttl``: seconds a slot lives until the job starts."""
    options = {"max_concurrent": max_concurrent, "scope": scope, "ttl": ttl}
    return _decorator("reserve", RESERVE_ATTR, lambda: _valid(ReservePolicy, options))


def pace(
    rate: str, burst: int = 1, scope: str | Callable[..., Any] | None = None
) -> Callable[[T], T]:
    """Pace a Celery task: a submission over ``rate`` (``"10/m"``) per scope is published with
    a countdown to the next free start, never dropped; stack it as ``@reserve``. ``scope``: as
    ``@reserve``'s, or None (the task itself); ``burst``: starts at once before the spacing."""
    options = {"rate": rate, "burst": burst, "scope": scope}
    return _decorator("pace", PACE_ATTR, lambda: _valid(PacePolicy, options))


def _valid(policy: Any, options: dict[str, Any]) -> dict[str, Any]:
    policy.from_options(options)  # a bad option raises now, as the task is defined
    return options


def _decorator(kind: str, attr: str, options: Callable[[], dict[str, Any]]) -> Callable[[T], T]:
    """The decorator that keeps a declaration on the task, its ``options`` checked now: a bad
    one raises as the task is defined, naming it."""
    try:
        checked = options()
    except ConfigError as exc:
        return _refuse(exc)

    def apply(task: T) -> T:
        _declare(task, kind, attr, checked)
        return task

    return apply


def _refuse(error: ConfigError) -> Callable[[T], T]:
    """A decorator whose options are wrong: it raises ``error`` with the task's name when it
    is applied to the task (the line of the definition, and the task the user can look for)."""

    def apply(task: T) -> T:
        fn = _function_of(task) if not isinstance(task, type) else None
        name = getattr(task, "name", None) or (
            f"{fn.__module__}.{fn.__name__}" if fn is not None else repr(task)
        )
        raise ConfigError(f"task {name!r}: {error}") from None

    return apply


def task_function(task: Any) -> Callable[..., Any]:
    """The function whose signature the task's arguments bind to (``run``, without ``self``)."""
    run = getattr(task, "_taskdedup_run", None) or task.run
    return cast("Callable[..., Any]", getattr(run, "__wrapped__", run))


def _declare(target: Any, attr: str, function_attr: str, options: Any) -> None:
    """Keep a decorator's declaration where every copy of the task finds it, and check it
    now: on a Task class; on the function (below ``@app.task``, or behind a lazy task's
    proxy, which is not evaluated); else on the task object. A second ``@reserve`` stacks."""
    if attr == "reserve":
        options = stack_caps(options, own(target, attr), own(_function_of(target), function_attr))
    if isinstance(target, type):
        setattr(target, attr, options)
        return
    fn = _function_of(target)
    if fn is not None:
        setattr(fn, function_attr, options)
        _check(f"{fn.__module__}.{fn.__name__}", fn, attr, options)
        return
    setattr(target, attr, options)
    name = getattr(target, "name", None)
    if name:
        _check(name, task_function(target), attr, options)
        _prepare_now(target)


#: Called with each task object a decorator declares a policy on (``install`` adds the one
#: that prepares it when its app has taskdedup): a worker that loads the task now
#: (``celery_worker.reload()`` in a test) must run its wrapped body.
DECLARED: list[Callable[[Any], None]] = []


def _prepare_now(task: Any) -> None:
    for prepare in DECLARED:
        prepare(task)


def _function_of(target: Any) -> Any:
    """The function behind ``target``: the function itself, the argument of the PromiseProxy
    that ``app.task`` returns before the app is finalized, or the function that
    ``shared_task``'s proxy looks its task up by. None for a task (or a proxy evaluated
    into one, which forwards the attribute to its task)."""
    if isinstance(target, Proxy):
        try:
            args = object.__getattribute__(target, "_Proxy__args")
            local = object.__getattribute__(target, "_Proxy__local")
        except AttributeError:  # an evaluated PromiseProxy: it stands for its task now
            return None
        closure = getattr(local, "__closure__", None) or ()
        for candidate in (*args, *(cell.cell_contents for cell in closure)):
            if inspect.isfunction(candidate):
                return candidate
        return None
    return target if inspect.isfunction(target) else None


def _check(name: str, fn: Callable[..., Any], attr: str, options: Any) -> None:
    """Bind a declaration to the function now, so bad ``keys=`` fail at definition."""
    if attr == "deduplicate":
        Settings().policy(options).bind(name, fn)
    else:
        (bind_pace if attr == "pace" else bind_limits)(options, name, fn)


def declared(task: Any, attr: str, function_attr: str) -> Any:
    """The task's declaration: its function's (from a decorator), else the task's own."""
    options = getattr(task_function(task), function_attr, None)
    return getattr(task, attr, None) if options is None else options


def task_policy(task: Any, defaults: Settings) -> TaskPolicy | None:
    """The task's bound policy (cached on the task), or None when it declares none."""

    def bind(options: Any) -> TaskPolicy:
        return bind_policy(defaults, options, task.name, task_function(task))

    return kept(task, declared(task, "deduplicate", FUNCTION_ATTR), _BOUND, bind)


def task_pace(task: Any) -> PacePolicy | None:
    """The task's pace (cached on the task), or None when it declares none."""
    return _bound(task, "pace", PACE_ATTR, bind_pace)  # type: ignore[no-any-return]


def task_limits(task: Any) -> ReservePolicy | None:
    """The task's reservation cap (cached on the task), or None when it declares none."""
    return _bound(task, "reserve", RESERVE_ATTR, bind_limits)  # type: ignore[no-any-return]


def _bound(task: Any, attr: str, function_attr: str, bind: Callable[..., Any]) -> Any:
    def build(options: Any) -> Any:
        return bind(options, task.name, task_function(task))

    return kept(task, declared(task, attr, function_attr), "_taskdedup_kept_" + attr, build)
