"""Revoke and expiry: a job that will not run, or was terminated, frees its key and slot (G13).

Celery reports these ends in three places, and taskdedup listens at each, on the worker:

- ``task_revoked``: sent when a worker discards a revoked or expired message (as it arrives, or
  when its ETA comes) and when it terminates a running job (``revoke(terminate=True)``). Its
  sender is the Task; its ``request`` is a ``Context`` built from the message headers (Celery
  5.x), so it carries taskdedup's key and scope headers but not the arguments.
- the ``revoke`` control command: Celery only flags the id, and discards an ETA job the worker
  already holds when its ETA comes, which may be hours away. The command is wrapped so the
  worker frees such a job's key and slot at once. A job that runs is left alone (a plain revoke
  does not stop it), and so is one already handed to the pool (it will run).
- ``task_received``: a job whose ``expires`` comes before its ETA will be dropped at its ETA;
  its key and slot are freed as soon as the worker holds it.

Every release is owner-checked by job id: freeing a job twice (at the revoke, then when Celery
discards it) is harmless; a terminated body's heartbeat renews only a lock its job holds. A
discarded or expired job frees only a lock still QUEUED, and its slot only while the store does
not record the job as running: a plain revoke does not stop a run, and every worker discards
the copies of a revoked job it receives (a redelivery, a copy sent again), so freeing more
would let a new job run beside the one still going. ``terminate=True`` frees everything.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable
from typing import Any

from kombu.utils.functional import maybe_list

from .. import delivery
from .messages import KEY_HEADER, SCOPE_HEADER, header
from .state import CeleryDedup, integration_for
from .tasks import task_policy

log = logging.getLogger("taskdedup")


def on_revoked(integ: CeleryDedup, sender: Any, request: Any, why: str) -> None:
    """Celery's ``task_revoked``: the job was discarded (revoked, expired) or terminated."""
    task = task_of(integ, sender, request)
    if task is not None:
        free_job(integ, task, request, why)


def on_received(integ: CeleryDedup, sender: Any, request: Any) -> None:
    """Celery's ``task_received``: a job that expires before its ETA will never run."""
    if getattr(sender, "app", integ.app) is not integ.app:
        return
    eta, expires = getattr(request, "eta", None), getattr(request, "expires", None)
    if not isinstance(eta, dt.datetime) or not isinstance(expires, dt.datetime):
        return
    try:
        doomed = expires < eta
    except TypeError:  # one aware, one naive: let Celery decide at the ETA
        return
    task = task_of(integ, None, request)
    if doomed and task is not None:
        free_job(integ, task, request, "expires before its ETA")


def task_of(integ: CeleryDedup, sender: Any, request: Any) -> Any | None:
    """The job's Task, if it belongs to ``integ``'s app (the signals reach every app's
    integration in the process)."""
    if sender is not None and hasattr(sender, "name"):
        return sender if getattr(sender, "app", None) is integ.app else None
    task = getattr(request, "task", None)  # a worker Request: the Task; a Context: its name
    if task is not None and not isinstance(task, str):
        return task if getattr(task, "app", None) is integ.app else None
    name = task or getattr(request, "name", None)
    return integ.app.tasks.get(name) if isinstance(name, str) else None


def free_job(integ: CeleryDedup, task: Any, request: Any, why: str) -> None:
    """Free the slot and the lock (enqueue and run lock) that ``request``'s job holds (one not
    terminated never ran here: it may run elsewhere). ``request``: a worker Request or a
    Context. Errors are logged, never raised (Celery's signal and control handlers call it)."""
    if not integ.settings.enabled:
        return  # G16: no store command
    job_id = getattr(request, "id", None)
    if not job_id:
        return
    try:
        scope = header(request, SCOPE_HEADER)
        policy = task_policy(task, integ.settings)
        active = policy is not None and integ.dedup.active(task.name)
        key = header(request, KEY_HEADER) or (
            key_from_arguments(policy, request) if active else None
        )
        flow = delivery.discard(
            integ.dedup, integ.reservations, task.name, job_id, key, scope,
            killed=why == "terminated", release=active, why=why,
        )  # fmt: skip
        integ.dedup.drive(flow)
        if hasattr(task, "taskdedup_freed"):  # a Task's own keys too (taskdedup.compat)
            task.taskdedup_freed(request, why)
    except Exception:
        log.exception("taskdedup: could not free the key of %s %s[%s]", why, task.name, job_id)


def key_from_arguments(policy: Any, request: Any) -> str | None:
    """The key computed again from the job's arguments, when the request has them (a worker
    Request does; Celery 5's Context does not)."""
    args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
    if args is None and kwargs is None:
        return None
    queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return str(policy.key_for(args or (), kwargs or {}, queue))


# ---------------------------------------------------------------- the revoke control command


def install_revoke_command() -> None:
    """Wrap the worker's ``revoke`` control command (once per process): after Celery flags the
    ids, the ETA jobs this worker holds among them free their keys and slots now."""
    from celery.worker.control import Panel

    original = Panel.data.get("revoke")
    if original is None or getattr(original, "_taskdedup_original", None) is not None:
        return
    Panel.data["revoke"] = _wrap_revoke(original)


def _wrap_revoke(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        try:
            free_scheduled(state, task_id)
        except Exception:  # never spoil Celery's own reply
            log.exception("taskdedup: could not free the revoked jobs %s", task_id)
        return reply

    revoke._taskdedup_original = original  # type: ignore[attr-defined]
    return revoke


def free_scheduled(state: Any, task_ids: Any) -> None:
    """Free the jobs among ``task_ids`` that this worker holds for an ETA. Celery flagged them
    revoked first, so each will be discarded when its ETA comes, never run."""
    from celery.worker import state as worker_state

    app = getattr(state, "app", None)
    integ = integration_for(app) if app is not None else None
    if integ is None:
        return
    for job_id in maybe_list(task_ids) or ():  # type: ignore[no-untyped-call]
        request = worker_state.requests.get(job_id)
        if request is None or request not in worker_state.scheduled_requests:
            continue  # not here, or already handed on to run (a plain revoke does not stop it)
        task = task_of(integ, None, request)
        if task is not None:
            free_job(integ, task, request, "revoked")
