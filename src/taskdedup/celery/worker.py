"""The worker side: claim before the body runs, heartbeat while it runs, then finish.

Each deduplicated task's ``run`` is wrapped (Celery's tracer calls ``task.run``), so the claim
happens inside the worker's request context, with ``self.request`` set. A delivery that must not
run raises ``Ignore``, so no result is written over the real job's: a copy of a finished job is
dropped (G7); a copy whose holder still runs, or a while_executing job whose key is busy, is
sent again with a delay under the same id, so nothing is lost and the caller's handle stays
true (if the holder died meanwhile, the copy takes over once the lease has lapsed).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from ..core import Admission
from ..policy import TaskPolicy
from .messages import KEY_HEADER, load_call
from .tasks import task_policy

if TYPE_CHECKING:
    from .integration import CeleryDedup

log = logging.getLogger("taskdedup")
BUSY_DELAY = 1.0  # seconds before a busy while_executing job is tried again


def wrap_task(integ: CeleryDedup, task: Any) -> None:
    """Wrap ``task.run`` once; tasks without a policy are left untouched."""
    if getattr(task, "_taskdedup_run", None) is not None:
        return
    if task_policy(task, integ.settings) is None:
        return
    original = task.run

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        return integ.worker.run(task, original, args, kwargs)

    task._taskdedup_run = original
    task.run = run


class Worker:
    """Runs one delivery of a deduplicated task through claim, heartbeat and finish."""

    def __init__(self, integ: CeleryDedup) -> None:
        self.integ = integ

    def run(self, task: Any, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = task.request
        policy = task_policy(task, self.integ.settings)
        if policy is None or request.id is None or request.called_directly:
            return original(*args, **kwargs)
        dedup = self.integ.dedup
        key = getattr(request, KEY_HEADER, None) or (request.headers or {}).get(KEY_HEADER)
        queue = (request.delivery_info or {}).get("routing_key")
        admission = dedup.claim(
            policy,
            request.id,
            key=key,
            args=args,
            kwargs=kwargs,
            queue=queue,
            attempt=request.retries or 0,
        )
        if admission.handoff is not None:
            self._publish_handoff(task, admission.key, admission.handoff)
        if not admission.should_run:
            self._skip(task, policy, admission, args, kwargs)
        request.taskdedup_key = admission.key
        request.taskdedup_fence = admission.fence
        lease = admission.lease
        heartbeat = self.integ.heartbeat()
        if lease is not None:
            heartbeat.add(lease)
        try:
            result = original(*args, **kwargs)
        except (Retry, Ignore):
            raise  # a retry moved the lock to QUEUED when it was published
        except Reject as exc:
            if not exc.requeue:
                self._finish(task, policy, admission)
            raise
        except BaseException:  # a final failure: autoretry_for turns retryable ones into Retry
            self._finish(task, policy, admission)
            raise
        finally:
            if lease is not None:
                heartbeat.discard(lease)
        self._finish(task, policy, admission)
        return result

    def _finish(self, task: Any, policy: Any, admission: Admission) -> None:
        if admission.key is None:
            return
        done = self.integ.dedup.finish(
            policy, admission.key, admission.job_id, attempt=task.request.retries or 0
        )
        if done.handoff is not None:
            self._publish_handoff(task, admission.key, done.handoff)

    def _publish_handoff(self, task: Any, key: str | None, handoff: Any) -> None:
        """Publish the one rescheduled run (reschedule_once) under the id the lock holds."""
        if handoff.payload is not None:
            args, kwargs = load_call(handoff.payload)
        else:
            args, kwargs = task.request.args, task.request.kwargs
        task.apply_async(args, kwargs, task_id=handoff.job_id, headers={KEY_HEADER: key})

    def _skip(
        self, task: Any, policy: TaskPolicy, admission: Admission, args: Any, kwargs: Any
    ) -> None:
        """Do not run this delivery. A copy whose key is busy, or whose holder still runs,
        comes back later under the same id (if the holder died, the copy then takes over after
        the lease); a copy of a finished job is dropped."""
        if admission.outcome in ("busy", "running"):
            delay = BUSY_DELAY if admission.outcome == "busy" else policy.policy.lease_seconds + 1
            # the same message again (id, queue, callbacks, chain, headers), only later
            task.signature_from_request(task.request, args, kwargs, countdown=delay).apply_async()
            action = f"deferred {delay:g}s"
        else:
            action = "dropped"
        log.info(
            "taskdedup: not running %s[%s]: %s (holder %s), %s",
            task.name,
            admission.job_id,
            admission.outcome,
            admission.holder,
            action,
        )
        raise Ignore()


def on_revoked(integ: CeleryDedup, request: Any, terminated: bool, expired: bool) -> None:
    """A revoked or expired job will not run: release its lock (owner-checked)."""
    task = getattr(request, "task", None)
    if task is None:
        return
    policy = task_policy(task, integ.settings)
    if policy is None:
        return
    body = getattr(request, "request_dict", None) or {}
    key = body.get(KEY_HEADER) or (body.get("headers") or {}).get(KEY_HEADER)
    if key is None:
        key = policy.key_for(request.args or (), request.kwargs or {}, None)
    integ.dedup.release(key, request.id, task=task.name)
