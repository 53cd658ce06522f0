"""Assertions for users' own tests: that a task is safe to run twice, that submissions were
(or were not) deduplicated, what a redelivery or a crash of a running job does, and that every
task's policy is sound.

They work on real tasks and real handles (Celery's ``AsyncResult`` and taskiq's handle, both
with ``.deduplicated``), with no mocks; the pytest plugin (``taskdedup.testing.plugin``) gives
the store and the clock they run against.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from ..cli.doctor import Finding, policy_findings
from ..cli.target import Target, for_app, for_broker
from ..decide import Admission
from ..errors import ConfigError
from ..policy import TaskPolicy
from .clock import FakeClock


def assert_idempotent(task: Any, *args: Any, snapshot: Callable[[], Any], **kwargs: Any) -> Any:
    """Run the real body of ``task`` (a Celery task, a taskiq task or a function) twice with
    the same arguments and fail unless ``snapshot()`` (what the body changes: rows, files,
    calls made) reads the same after the second run as after the first. Returns the first
    run's result. For an ``async`` body, use :func:`aassert_idempotent`."""
    body = task_body(task)
    first = body(*args, **kwargs)
    if inspect.isawaitable(first):
        _close(first)
        raise TypeError(f"{task_name(task)} is async: use `await aassert_idempotent(...)`")
    after_first = snapshot()
    body(*args, **kwargs)
    _same(task, after_first, snapshot())
    return first


async def aassert_idempotent(
    task: Any, *args: Any, snapshot: Callable[[], Any], **kwargs: Any
) -> Any:
    """:func:`assert_idempotent` for an ``async`` body (``snapshot`` may be async too)."""
    body = task_body(task)
    first = await _maybe_await(body(*args, **kwargs))
    after_first = await _maybe_await(snapshot())
    await _maybe_await(body(*args, **kwargs))
    _same(task, after_first, await _maybe_await(snapshot()))
    return first


def assert_deduplicated(first: Any, *repeats: Any) -> None:
    """``first`` was published, and every one of ``repeats`` was answered with its job."""
    assert repeats, "assert_deduplicated needs the first handle and at least one repeat"
    assert not _deduplicated(first), f"the first submission {job_id(first)} was deduplicated"
    for repeat in repeats:
        assert _deduplicated(repeat), (
            f"submission {job_id(repeat)} was published: it was not deduplicated onto "
            f"{job_id(first)} (a different key? a strategy that had already let go?)"
        )
        assert job_id(repeat) == job_id(first), (
            f"submission was deduplicated onto {job_id(repeat)}, not onto {job_id(first)}"
        )


def assert_not_deduplicated(*handles: Any) -> None:
    """Every one of ``handles`` was published as a job of its own."""
    dropped = [job_id(h) for h in handles if _deduplicated(h)]
    assert not dropped, f"deduplicated, though they should not be: {dropped}"
    ids = [job_id(h) for h in handles]
    assert len(set(ids)) == len(ids), f"two submissions share a job id: {ids}"


def deliver(task: Any, handle: Any, *args: Any, **kwargs: Any) -> Admission:
    """What a worker decides when the broker hands it ``handle``'s job, a call of ``task``
    with these arguments, now: ``outcome`` is ``run`` (it claimed the job: a first delivery,
    or a copy taking over from a crashed run), ``running`` (the job runs elsewhere: this copy
    waits), ``done`` (it finished: the copy is dropped), ``busy`` or ``exhausted``. The claim
    is real, made in the store the task's app or broker uses; nothing is run."""
    tp, dedup = _policy_of(task)
    return dedup.claim(tp, job_id(handle), args=args, kwargs=kwargs, attempt=0)  # type: ignore[no-any-return]


def crash(task: Any, handle: Any, clock: FakeClock) -> None:
    """The worker running ``handle``'s job died (kill -9) and its lease ran out: this moves
    the store's ``clock`` past the task's lease, and drops the job's lease from this process's
    heartbeat if a worker here held it. The next :func:`deliver` of the job recovers it."""
    tp, _ = _policy_of(task)
    for keeper in _heartbeats(task):
        for lease in keeper.snapshot():
            if lease.job_id == job_id(handle):
                keeper.discard(lease)
    clock.advance(tp.policy.lease_seconds + 0.001)


#: doctor's checks of a deployment choice rather than of a policy: Celery's default
#: (``acks_late`` off: a killed worker's job is not delivered again) is a sound app, so
#: check_policies reports them only when ``strict``.
DEPLOYMENT_CHOICES = frozenset({"acks_late"})


def check_policies(
    app_or_broker: Any, *, ignore: Iterable[str] = (), strict: bool = False
) -> dict[str, TaskPolicy]:
    """Bind every task's policy of a Celery app or a taskiq broker and run ``taskdedup
    doctor``'s checks of them (no store needed): fail with every problem found, a bad
    declaration or a warning, except the checks named in ``ignore`` (``policy``,
    ``acks_late``, ``visibility``). ``acks_late`` off (Celery's default) fails only when
    ``strict``. Returns the bound policies by task name."""
    try:
        target = _target(app_or_broker)
    except ConfigError as exc:  # a declaration that does not bind
        raise AssertionError(f"task policies with problems:\n  {exc}") from exc
    skipped = set(ignore) | (set() if strict else DEPLOYMENT_CHOICES)
    problems: list[Finding] = [
        f for f in policy_findings(target) if f.level != "ok" and f.check not in skipped
    ]
    assert not problems, "task policies with problems:\n" + "\n".join(
        f"  {f.level} {f.check}: {f.message}" for f in problems
    )
    return target.policies


# ---------------------------------------------------------------- what the helpers share


def task_body(task: Any) -> Callable[..., Any]:
    """The function a worker would run: a Celery task's ``run`` (unwrapped), a taskiq task's
    ``original_func``, or the callable itself."""
    original = getattr(task, "_taskdedup_run", None)  # the Celery adapter's wrapped run
    if original is not None:
        return original  # type: ignore[no-any-return]
    for name in ("original_func", "run"):
        body = getattr(task, name, None)
        if callable(body):
            return body  # type: ignore[no-any-return]
    if callable(task):
        return task  # type: ignore[no-any-return]
    raise TypeError(f"{task!r} is no task or function")


def task_name(task: Any) -> str:
    found = getattr(task, "name", None) or getattr(task, "task_name", None)
    return str(found or getattr(task, "__qualname__", None) or task)


def job_id(handle: Any) -> str:
    """A handle's job id: Celery's ``.id``, taskiq's ``.task_id``."""
    found = getattr(handle, "task_id", None) or getattr(handle, "id", None)
    if found is None:
        raise TypeError(f"{handle!r} is no job handle (no .id or .task_id)")
    return str(found)


def _deduplicated(handle: Any) -> bool:
    return bool(getattr(handle, "deduplicated", False))


def _same(task: Any, first: Any, second: Any) -> None:
    assert first == second, (
        f"{task_name(task)} is not idempotent: running it again changed what it touches\n"
        f"  after one run:  {first!r}\n  after two runs: {second!r}"
    )


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _close(value: Any) -> None:
    if asyncio.iscoroutine(value):
        value.close()


def _target(app_or_broker: Any) -> Target:
    if hasattr(app_or_broker, "get_all_tasks"):
        return for_broker(app_or_broker)
    return for_app(app_or_broker)


def _policy_of(task: Any) -> tuple[TaskPolicy, Any]:
    """The bound policy of ``task`` and the Deduplicator of its app or broker."""
    app, broker = getattr(task, "app", None), getattr(task, "broker", None)
    owner = broker if broker is not None and hasattr(broker, "get_all_tasks") else app
    target = _target(owner)
    policy = target.policies.get(task_name(task))
    if policy is None:
        raise TypeError(f"{task_name(task)} declares no deduplication policy")
    return policy, target.dedup


def _heartbeats(task: Any) -> list[Any]:
    from ..celery.state import integration_for

    app = getattr(task, "app", None)
    integ = None if app is None else integration_for(app)
    return [] if integ is None else [integ.heartbeat()]
