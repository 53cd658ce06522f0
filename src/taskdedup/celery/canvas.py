"""Canvas (G15): a deduplicated member of a chain, group or chord is attached to the winner.

A message that carries what runs after it (``chain``, ``link``, ``link_error``), belongs to a
group or chord (``group_id``, ``chord``), or was sent by a worker as the next step of a canvas
(an explicit ``parent_id``) cannot simply be dropped as a duplicate: someone waits for its own
id, or its continuation travels in it. When its key is held by another job (the *holder*), the
publisher answers the caller with the holder's id as usual and sends, under the duplicate's own
id and with all of its canvas options, a small internal task, ``taskdedup.follow``: the
*follower*. The follower polls the holder (its result in the result backend, its lock and job
record in the store), never blocking a worker slot: while the holder is queued or running it
sends itself again with a growing countdown (``Task.retry``, which keeps every canvas option).
Then:

- the holder succeeded: the follower returns the holder's result, so Celery itself stores it
  under the duplicate's id and runs the rest of the chain, the ``link`` callbacks, the group's
  result and the chord's counter exactly as if the duplicate had run;
- the holder failed: the follower raises the holder's exception (the duplicate's chain stops,
  its ``link_error`` callbacks run, its chord fails), as Celery does for a failing member;
- the holder is gone without a result (revoked, expired, lost with its worker, or its result
  ignored): the follower publishes the duplicate itself, under its own id and with its canvas
  options, through the usual dedup path: it attaches to a newer holder or runs. A step is never
  lost; at worst it runs twice.

When no result can be had at all (no result backend, or the task ignores its results) the
member is published and run as it is, without dedup: nothing is lost, nothing waits forever.
The follower writes no store keys: its state travels in its own message (G9).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore

from ..delivery import holder_may_end
from .messages import queue_of
from .state import CeleryDedup

log = logging.getLogger("taskdedup")

FOLLOW_TASK = "taskdedup.follow"
FIRST_POLL = 0.25  # seconds before the follower first looks at its holder again
LAST_POLL = 5.0  # the longest wait between two looks (the countdown doubles up to it)
MIN_PATIENCE = 2.0  # seconds a holder may look gone before the follower stops waiting

#: Options of the duplicate's publish the follower must not take over (its own are set here).
#: ``expires`` is the duplicate's own deadline to start; the follower waits for a holder that
#: did start, so it must not expire while it waits (it would leave the canvas unfinished).
_NOT_FOLLOWED = (
    "task_type",
    "result_cls",
    "router",
    "route_name",
    "shadow",
    "serializer",
    "expires",
)


def results_kept(integ: CeleryDedup, task: Any) -> bool:
    """Whether the holder's result can be had: a result backend, and the task's results are
    not ignored (a holder sent with ``ignore_result=True`` is caught by the follower's
    patience instead)."""
    app = integ.app
    if isinstance(app.backend, DisabledBackend):
        return False
    return not getattr(task, "ignore_result", False)  # set from task_ignore_result too


def register(integ: CeleryDedup) -> None:
    """Register ``taskdedup.follow`` on the app (once; lazily if the app is not finalized)."""
    app = integ.app
    if getattr(app, "_taskdedup_follow", False):
        return
    app._taskdedup_follow = True

    def follow(
        self: Any,
        holder: str,
        key: str,
        task: str,
        args: Any,
        kwargs: Any,
        patience: float,
        lost_since: float | None = None,
        polls: int = 0,
    ) -> Any:
        """Wait (without blocking) for ``holder``, then stand in for the duplicate."""
        return Follower(integ, self).poll(
            holder, key, task, args, kwargs, patience, lost_since, polls
        )

    # acks_late: a worker that dies during a look has the look redelivered, not lost
    app.task(
        name=FOLLOW_TASK,
        bind=True,
        shared=False,
        max_retries=None,
        typing=False,
        acks_late=True,
        reject_on_worker_lost=True,
    )(follow)


def publish_follower(
    integ: CeleryDedup,
    send: Callable[..., Any],
    task: Any,
    holder: str,
    key: str,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    patience: float,
) -> Any:
    """Send the follower under the duplicate's id (``options["task_id"]``), with the
    duplicate's canvas options and on the queue the duplicate would have gone to."""
    app = integ.app
    opts = {k: v for k, v in options.items() if k not in _NOT_FOLLOWED}
    route = app.amqp.router.route(dict(options), name, args, kwargs, task)
    for field in ("queue", "exchange", "routing_key"):
        if route.get(field) is not None:
            opts[field] = route[field]
    if opts.get("queue") is None:
        opts["queue"] = queue_of(task, options)
    opts["serializer"] = options.get("serializer") or task.serializer
    follow_kwargs = {
        "holder": holder,
        "key": key,
        "task": name,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "patience": patience,
    }
    log.info(
        "taskdedup: %s[%s] is a duplicate of %s with a continuation: it follows the holder",
        name,
        opts.get("task_id"),
        holder,
    )
    return send(FOLLOW_TASK, (), follow_kwargs, **opts)


class Follower:
    """One look at the holder, from inside a run of ``taskdedup.follow``."""

    def __init__(self, integ: CeleryDedup, task: Any) -> None:
        self.integ = integ
        self.task = task

    def poll(
        self,
        holder: str,
        key: str,
        name: str,
        args: Any,
        kwargs: Any,
        patience: float,
        lost_since: float | None,
        polls: int,
    ) -> Any:
        result = self.integ.app.AsyncResult(holder)
        try:
            state = result.state
            outcome = result.result if state in (states.SUCCESS, states.FAILURE) else None
        except Exception as exc:  # the result backend did not answer: look again later
            log.warning(
                "taskdedup: %s[%s] could not read the result of %s (%s): it looks again later",
                name,
                self.task.request.id,
                holder,
                exc,
            )
            state, outcome = states.PENDING, None
        if state == states.SUCCESS:
            return outcome
        if state == states.FAILURE:
            if isinstance(outcome, BaseException):
                raise outcome
            raise RuntimeError(f"the job {holder} this one followed failed: {outcome!r}")
        if self._alive(key, holder, revoked=state == states.REVOKED):
            lost_since = None
        else:
            now = time.time()
            lost_since = lost_since or now
            if state == states.REVOKED or now - lost_since >= patience:
                self._run_instead(holder, name, args, kwargs, state)
        countdown = min(FIRST_POLL * 2**polls, LAST_POLL)
        more = {"lost_since": lost_since, "polls": polls + 1}
        raise self.task.retry(
            kwargs={**self.task.request.kwargs, **more}, countdown=countdown, max_retries=None
        )

    def _alive(self, key: str, holder: str, revoked: bool = False) -> bool:
        """Whether the holder may still end with a result (the rule: delivery.holder_may_end)."""
        dedup = self.integ.dedup
        return dedup.drive(holder_may_end(key, holder, revoked=revoked))

    def _run_instead(self, holder: str, name: str, args: Any, kwargs: Any, state: str) -> None:
        """The holder is gone without a result: send the duplicate itself, with its own id and
        canvas options, through the usual dedup path (it attaches to a newer holder or runs).
        The follower then ends without a result of its own (Ignore)."""
        request = self.task.request
        options = request.as_execution_options()
        options.update(retries=0, task_id=request.id)
        for field in ("replaced_task_nesting", "origin", "expires"):
            options.pop(field, None)
        delivery = request.delivery_info or {}
        if delivery.get("routing_key"):
            options["queue"] = delivery["routing_key"]
        log.warning(
            "taskdedup: %s[%s] followed %s, which is gone without a result (%s): sent as itself",
            name,
            request.id,
            holder,
            state,
        )
        self.integ.app.send_task(name, args, kwargs, **options)
        raise Ignore()
