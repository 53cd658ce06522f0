"""What taskdedup reads from and adds to a Celery message: its facts, read once into a
:class:`~taskdedup.submission.Call` (delay, queue, expiry, the key and scope headers, a retry,
a canvas membership), and the arguments kept for reschedule_once."""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any, cast

from kombu import serialization
from kombu.utils.uuid import uuid

from ..decide import envelope
from ..policy import TaskPolicy
from ..reservations import ReservePolicy
from ..submission import Call
from .tasks import task_function

KEY_HEADER = envelope.KEY
SCOPE_HEADER = envelope.SCOPE
#: A publish option (never sent) of the worker's own publishes: a delivery sent again later
#: (busy, its holder running, its scope full) or the run owed by reschedule_once. It goes out
#: as it is: its lock and slot were settled by the worker, so no dedup and no cap apply.
RESEND_OPTION = "taskdedup_resend"
#: Options of a message that someone waits on or that carries its continuation.
CANVAS_OPTIONS = ("chain", "link", "link_error", "group_id", "chord", "parent_id")


def dump_call(args: Any, kwargs: Any, serializer: str) -> str:
    """The arguments of a duplicate, kept for reschedule_once in the task's own serializer."""
    content_type, encoding, data = serialization.dumps(  # type: ignore[no-untyped-call]
        (args, kwargs), serializer=serializer
    )
    raw = data if isinstance(data, bytes) else data.encode(encoding or "utf-8")
    return json.dumps([content_type, encoding, base64.b64encode(raw).decode()])


def load_call(payload: str) -> tuple[Any, Any]:
    content_type, encoding, data = json.loads(payload)
    body = serialization.loads(  # type: ignore[no-untyped-call]
        base64.b64decode(data), content_type, encoding, accept=[content_type]
    )
    return body[0], body[1]


def delay_of(options: dict[str, Any]) -> float:
    """Seconds until a scheduled job is due (0 for a job sent now)."""
    countdown = options.get("countdown")
    if countdown:
        return max(float(countdown), 0.0)
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            return 0.0  # Celery itself will say what is wrong with it
    return _seconds_until(eta) if isinstance(eta, dt.datetime) else 0.0


def expires_in_of(options: dict[str, Any]) -> float | None:
    """Seconds until a job's ``expires`` (Celery's option or the task's default), if it has one:
    after that no worker starts it."""
    expires = options.get("expires")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        return max(float(expires), 0.0)
    if isinstance(expires, str):
        try:
            expires = dt.datetime.fromisoformat(expires)
        except ValueError:
            return None  # Celery itself will say what is wrong with it
    return _seconds_until(expires) if isinstance(expires, dt.datetime) else None


def _seconds_until(when: dt.datetime) -> float:
    now = dt.datetime.now(when.tzinfo or dt.timezone.utc)
    if when.tzinfo is None:
        now = now.replace(tzinfo=None)
    return max((when - now).total_seconds(), 0.0)


def queue_of(task: Any, options: dict[str, Any]) -> str | None:
    """The queue name a call is sent to, when it says (for ``per_queue`` keys)."""
    queue = options.get("queue") or getattr(task, "queue", None)
    if queue is not None and not isinstance(queue, str):  # a kombu Queue
        queue = getattr(queue, "name", str(queue))
    return cast("str | None", queue)


def add_key(key: str, options: dict[str, Any]) -> None:
    """The dedup key travels in a header, so the worker need not compute it again."""
    headers = dict(options.get("headers") or {})
    headers[KEY_HEADER] = key
    options["headers"] = headers


def call_of(
    task: Any,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    idempotency: tuple[str | None, float | None] = (None, None),
    key: str | None = None,
) -> Call:
    """One publish's facts, read once (its job id is set in ``options``): ``Task.retry``
    publishes under the job's id with ``retries``; a canvas member is never capped. ``key``:
    the call's key, when ``apply_async`` already computed it."""
    retries = options.get("retries") or 0
    retry = bool(retries and options.get("task_id"))
    job_id = options.get("task_id") or uuid()
    options["task_id"] = job_id
    headers = options.get("headers") or {}
    member = continues(options)
    args, kwargs = args or (), kwargs or {}
    serializer = options.get("serializer") or getattr(task, "serializer", None) or "json"
    return Call(
        name,
        task_function(task) if task is not None else None,
        args,
        kwargs,
        job_id,
        policy,
        None if member else limits,
        idempotency_key=idempotency[0],
        idempotency_ttl=idempotency[1],
        delay=delay_of(options),
        queue=queue_of(task, options),
        expires_in=expires_in_of(options),
        key=key or (headers.get(KEY_HEADER) if retry else None),
        scope=headers.get(SCOPE_HEADER) if retry else None,
        retry=retry,
        attempt=max(retries - 1, 0),
        member=member,
        dump=lambda: dump_call(args, kwargs, serializer),
    )


def continues(options: dict[str, Any]) -> bool:
    """Whether a publish carries a continuation (``chain``, ``link``, ``link_error``), a
    canvas membership (``group_id``, ``chord``), or is a canvas step (``parent_id``)."""
    return any(options.get(name) for name in CANVAS_OPTIONS)


def header(request: Any, name: str) -> Any:
    """A taskdedup header of a job: a worker Request's message headers, or a Context's
    attributes and custom headers (Celery puts custom headers on the request)."""
    value = getattr(request, name, None)
    if value:
        return value
    for headers in (getattr(request, "headers", None), getattr(request, "request_dict", None)):
        if isinstance(headers, dict) and headers.get(name):
            return headers[name]
    return None
