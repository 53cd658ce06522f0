"""Which taskiq tasks are deduplicated, and how: task labels, ``@deduplicate`` and per-call labels.

A task declares its policy with ``@broker.task(deduplicate={...})`` or ``@deduplicate(...)``.
taskiq stringifies label values it cannot type when it builds a message, so the declaration is
always read from the registered task object (like the retry middlewares read
``types_of_exceptions``); a call adjusts it with flat, typed labels
(``.kicker().with_labels(deduplicate_ttl=60)``), which do travel in the message, so the worker
sees the same per-call policy as the producer.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.labels import LabelType, parse_label
from taskiq.message import TaskiqMessage
from taskiq_dependencies.dependency import Dependency

from ..decide import envelope
from ..declare import bind_limits, bind_pace, bind_policy, decorator_options, kept, own, stack_caps
from ..errors import ConfigError
from ..pacing import PacePolicy
from ..policy import STRATEGIES, Policy, PolicyOptions, Seconds, Strategy, TaskPolicy
from ..reservations import DEFAULT_TTL as DEFAULT_RESERVE_TTL
from ..reservations import ReservePolicy
from ..settings import Settings
from ..suggest import did_you_mean

if TYPE_CHECKING:
    from typing_extensions import Unpack  # (typing's from Python 3.11)

T = TypeVar("T")

#: The task option (``@broker.task(deduplicate=...)``); per call: False, True or a strategy.
LABEL = "deduplicate"
#: Per-call options: ``deduplicate_<Policy field>`` (``deduplicate_keys`` is comma-separated).
OPTION_PREFIX = "deduplicate_"
#: Set by taskdedup on the messages it sends and runs: the dedup key and the fencing token.
KEY_LABEL = envelope.KEY
FENCE_LABEL = envelope.FENCE
#: Per call: ``.kicker().with_labels(idempotency_key="ci-build-1", idempotency_ttl=3600)``.
IDEMPOTENCY_KEY_LABEL = "idempotency_key"
IDEMPOTENCY_TTL_LABEL = "idempotency_ttl"
#: The worker's label for the attempt a delivery claimed (the retry middlewares bump theirs).
ATTEMPT_LABEL = "taskdedup_attempt"
#: The keyword argument that tells the guard not to run this delivery.
SKIP_KWARG = "__taskdedup_skip__"
#: The keyword argument that names a sync delivery, so the worker can tell when its thread
#: ends (a ``timeout`` label stops waiting for the thread, not the thread itself).
RUN_KWARG = "__taskdedup_run__"
#: The reservation cap (``@broker.task(reserve={...})`` or ``@reserve(...)``), and the scope
#: whose slot a sent job holds (set by taskdedup).
RESERVE_LABEL = "reserve"
SCOPE_LABEL = envelope.SCOPE
#: The pace (``@broker.task(pace={...})`` or ``@pace(...)``), and when a paced job may start
#: (epoch seconds, set by taskdedup: the worker holds an earlier delivery back until then).
PACE_LABEL = "pace"
START_LABEL = "taskdedup_start_at"
#: taskiq's retry middlewares count attempts in this label.
RETRIES_LABEL = "_retries"
#: Where ``@deduplicate`` keeps the declaration of a function not yet made a task.
FUNCTION_ATTR = "__taskdedup__"
RESERVE_ATTR = "__taskdedup_reserve__"
PACE_ATTR = "__taskdedup_pace__"
_BOOLEAN_OPTIONS = ("including_scheduled", "per_queue")
_DEFAULTS: dict[str, Any] = {}


def label(message: TaskiqMessage, name: str) -> Any:
    """A label's value with its type, before or after the receiver parsed the labels."""
    value = message.labels.get(name)
    if value is None:
        return None
    kind = (message.labels_types or {}).get(name)
    if kind is None or (kind == LabelType.BYTES and isinstance(value, bytes)):
        return value
    return parse_label(value, kind)


def set_label(message: TaskiqMessage, name: str, value: str | int, *, parsed: bool) -> None:
    """Set a label so that it keeps its type through serialization: as a string with its type
    before sending (``parsed=False``), as the value itself on a message the receiver parsed."""
    message.labels[name] = value if parsed else str(value)
    kind = LabelType.INT if isinstance(value, int) else LabelType.STR
    if message.labels_types is None:
        message.labels_types = {}
    message.labels_types[name] = kind.value


def deduplicate(
    strategy: Strategy | None = None, **options: Unpack[PolicyOptions]
) -> Callable[[T], T]:
    """Deduplicate a taskiq task: stack it on ``@broker.task`` (either side).

    Options left out take the middleware's defaults (``default_strategy`` and friends). A bad
    option, or a ``keys=`` name the function does not take, raises ConfigError here.
    """
    checked = decorator_options({"strategy": strategy, **options})

    def apply(target: T) -> T:
        if isinstance(target, AsyncTaskiqDecoratedTask):
            target.labels[LABEL] = checked
            Policies(Settings()).check(target)
        else:
            setattr(target, FUNCTION_ATTR, checked)
            name = getattr(target, "__name__", "?")
            Settings().policy(checked).bind(name, call_shape(cast(Any, target)))
        return target

    return apply


def reserve(
    max_concurrent: int,
    scope: str | Callable[..., Any] | None = None,
    ttl: Seconds = DEFAULT_RESERVE_TTL,
) -> Callable[[T], T]:
    """Cap a taskiq task at ``max_concurrent`` jobs in flight per scope; stack it on
    ``@broker.task`` (either side), and on another ``@reserve`` (each cap holds at once). Over
    a cap ``kiq()`` raises QuotaExceeded and sends nothing. ``scope``: an argument name, a
    callable of the arguments by name, or None (the task as a whole); ``ttl``: seconds a slot
    lives from reservation until the job starts."""
    options = {"max_concurrent": max_concurrent, "scope": scope, "ttl": ttl}
    ReservePolicy.from_options(options)  # validate now
    return _keeping(RESERVE_LABEL, RESERVE_ATTR, options, task_limits)


def pace(
    rate: str, burst: int = 1, scope: str | Callable[..., Any] | None = None
) -> Callable[[T], T]:
    """Pace a taskiq task: a kick over ``rate`` (``"10/m"``) per scope is sent at once but
    held by the worker until the next free start, never dropped; stack it on ``@broker.task``
    (either side). ``scope``: as ``@reserve``'s, or None (the task itself)."""
    options = {"rate": rate, "burst": burst, "scope": scope}
    PacePolicy.from_options(options)  # validate now
    return _keeping(PACE_LABEL, PACE_ATTR, options, task_pace)


def _keeping(name: str, attr: str, options: Any, bound: Callable[[Any], Any]) -> Callable[[T], T]:
    """A decorator keeping ``options`` in the task's label ``name`` (bound now: an error names
    the task), or on a function not yet made a task."""

    def apply(target: T) -> T:
        if isinstance(target, AsyncTaskiqDecoratedTask):
            target.labels[name] = stack(target.labels.get(name))
            bound(target)
        else:
            setattr(target, attr, stack(own(target, attr)))
        return target

    def stack(before: Any) -> Any:  # a second @reserve adds its cap
        return stack_caps(options, before) if name == RESERVE_LABEL else options

    return apply


def task_limits(task: AsyncTaskiqDecoratedTask[Any, Any]) -> ReservePolicy | None:
    """The task's reservation cap, or None (a bad one is a ConfigError naming the task)."""
    return _declared(task, RESERVE_LABEL, RESERVE_ATTR, bind_limits)  # type: ignore[no-any-return]


def task_pace(task: AsyncTaskiqDecoratedTask[Any, Any]) -> PacePolicy | None:
    """The task's pace, or None (a bad one is a ConfigError naming the task)."""
    return _declared(task, PACE_LABEL, PACE_ATTR, bind_pace)  # type: ignore[no-any-return]


def _declared(task: Any, name: str, attr: str, bind: Callable[[Any, str, Any], Any]) -> Any:
    """A declaration in the task's label ``name`` (else on its function), bound and kept."""
    options = task.labels.get(name) or getattr(task_function(task), attr, None)

    def build(options: Any) -> Any:  # (the function's shape read only when not kept yet)
        return bind(options, task.task_name, call_shape(task_function(task)))

    return kept(task, options, "_taskdedup_" + name, build)


def task_function(task: AsyncTaskiqDecoratedTask[Any, Any]) -> Callable[..., Any]:
    """The function the task's arguments bind to (without taskdedup's guard around it)."""
    fn = task.original_func
    while getattr(fn, "__taskdedup_guard__", False):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


def call_shape(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as callers see it: without the parameters taskiq injects (``TaskiqDepends()``
    defaults), which are not part of a call and so not part of its key."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if not isinstance(p.default, Dependency)]
    if len(params) == len(sig.parameters):
        return fn

    @functools.wraps(fn)
    def shape(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a signature only")

    shape.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return shape


def declared(task: AsyncTaskiqDecoratedTask[Any, Any]) -> Any:
    """The task's own declaration (a dict, a Policy, a strategy name, True/False) or None."""
    options = task.labels.get(LABEL)
    if options is None:
        options = getattr(task_function(task), FUNCTION_ATTR, None)
    return options


class Policies:
    """Turns a task and a message's labels into a bound TaskPolicy, cached per combination."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._cache: dict[tuple[str, int, tuple[tuple[str, Any], ...]], tuple[Any, TaskPolicy]] = {}

    def check(self, task: AsyncTaskiqDecoratedTask[Any, Any]) -> None:
        """Bind the task's declaration now, so a bad policy or a misspelled label of
        taskdedup's fails when the task is defined."""
        check_labels(task.task_name, task.labels)
        self.resolve(task, declared(task), ())

    def for_message(
        self, task: AsyncTaskiqDecoratedTask[Any, Any], message: TaskiqMessage
    ) -> TaskPolicy | None:
        """The policy of one call: the task's declaration adjusted by the message's labels."""
        base = declared(task)
        check_labels(task.task_name, message.labels)
        overrides: list[tuple[str, Any]] = []
        for name in message.labels:
            if name.startswith(OPTION_PREFIX):
                overrides.append((name[len(OPTION_PREFIX) :], label(message, name)))
        switch = label(message, LABEL)
        if switch is False:
            return None  # switched off for this call
        if isinstance(switch, str) and switch in STRATEGIES:
            overrides.append(("strategy", switch))
        elif isinstance(switch, str) and (message.labels_types or {}).get(LABEL) != LabelType.ANY:
            raise ConfigError(  # (ANY: the task's own declaration, stringified by taskiq)
                f"task {task.task_name!r}: label {LABEL}={switch!r} is no strategy"
                f"{did_you_mean(switch, STRATEGIES)} (or use True or False)"
            )
        if base is None or base is False:
            if switch is not True and not overrides:
                return None
            base = _DEFAULTS  # switched on for this call: the middleware's defaults
        return self.resolve(task, base, tuple(sorted(overrides)))

    def resolve(
        self,
        task: AsyncTaskiqDecoratedTask[Any, Any],
        base: Any,
        overrides: tuple[tuple[str, Any], ...],
    ) -> TaskPolicy | None:
        if base is None or base is False:
            return None
        cache_key = (task.task_name, id(base), overrides)
        cached = self._cache.get(cache_key)
        if cached is not None and cached[0] is base:
            return cached[1]
        try:
            merged = _merge(base, overrides)
        except ConfigError as exc:
            raise ConfigError(f"task {task.task_name!r}: {exc}") from None
        fn = call_shape(task_function(task))
        bound = bind_policy(self.settings, merged, task.task_name, fn)
        self._cache[cache_key] = (base, bound)
        return bound


#: The labels a caller sets; every other name that starts like them is a misspelling.
_OWN_LABELS = frozenset(
    [LABEL, RESERVE_LABEL, PACE_LABEL, IDEMPOTENCY_KEY_LABEL, IDEMPOTENCY_TTL_LABEL]
    + [OPTION_PREFIX + name for name in Policy.__dataclass_fields__]
)
_OWN_STARTS = ("dedup", "idempot")


def check_labels(task: str, labels: Any) -> None:
    """A label that starts like taskdedup's (``dedup...``, ``idempot...``) but is none of
    them is a ConfigError naming the nearest one: misspelled, it would silently do nothing."""
    for name in labels:
        problem = _misspelled(name)
        if problem is not None:
            raise ConfigError(f"task {task!r}: {problem}")


@functools.lru_cache(maxsize=256)
def _misspelled(name: str) -> str | None:
    if name in _OWN_LABELS or not name.lower().startswith(_OWN_STARTS):
        return None
    return f"unknown taskdedup label {name!r}{did_you_mean(name, _OWN_LABELS)}"


def _merge(base: Any, overrides: tuple[tuple[str, Any], ...]) -> Any:
    """The declaration with per-call options on top (a Policy is taken apart first)."""
    if base is True:
        base = {}
    if not overrides:
        return base
    if isinstance(base, Policy):
        base = {name: getattr(base, name) for name in Policy.__dataclass_fields__}
    elif isinstance(base, str):
        base = {"strategy": base}
    merged = dict(base)
    for name, value in overrides:
        if name == "keys" and isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        elif name in _BOOLEAN_OPTIONS and isinstance(value, str):
            value = value.strip().lower() in ("1", "true", "yes", "on")
        merged[name] = value
    return merged
