"""One round trip for a fresh key on a Redis broker that is also the store; on other brokers,
the acquire's round trip overlapped with Celery's building of the message.

The usual enqueue asks the store for the lock, then the broker pushes the message: two round
trips. When the broker is kombu's Redis transport on the store's own server, the publisher
instead leaves the planned acquire in a context variable and lets Celery build and publish the
message as always; the hooked ``Channel._put`` then runs the acquire script with the message
attached, which takes the lock and LPUSHes the message in one atomic step. A duplicate found
there pushes nothing and raises :class:`NotPublished`, which the publisher turns into the
holder's handle.

Any other way to the queue (a fanout exchange, kombu's publish batches, queues with
``x-expires``, another server) takes the lock first and pushes after, still inside the hook,
so no message leaves without its lock decision.

On any other broker (RabbitMQ, a Redis apart from the store) the publisher writes the acquire
before Celery builds the message (stores/redis_sent) and the hooked ``send_task_message``
reads its reply once the message is built, just before it is published.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from typing import Any, cast

from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from ..decide import Step, Ticket
from ..errors import StoreUnavailable
from ..stores.base import AcquireReply, PushesWithLock, Sent, Store
from ..submission import lock_taken, push_with_lock


class NotPublished(Exception):
    """Raised out of the broker's publish when the key was already held: nothing was sent."""


class StoreDown(Exception):
    """Carries StoreUnavailable (on_store_error="raise") out of kombu's publish: as an OSError
    it would be retried by kombu and come out as OperationalError."""

    def __init__(self, error: StoreUnavailable) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass(slots=True)
class PendingEnqueue:
    """An enqueue whose lock is taken where its message is pushed."""

    job_id: str
    step: Step[Ticket]
    store: Store  # (one that PushesWithLock, when the push is fused)
    reply: AcquireReply | None = None
    ticket: Ticket | None = None  # set when the store was down (decided by on_store_error)
    fused: bool = False  # lock and message went out in one script
    batched: bool = False  # the message sits in a kombu publish batch that may be discarded
    sent: Sent[Any] | None = None  # the acquire, written before Celery built the message


PENDING: contextvars.ContextVar[PendingEnqueue | None] = contextvars.ContextVar(
    "taskdedup_pending_enqueue", default=None
)

_shares: weakref.WeakKeyDictionary[Any, dict[int, bool]] = weakref.WeakKeyDictionary()
_hooked = threading.Lock()


def _message_id(message: Any) -> Any:
    properties = message.get("properties") or {}
    return properties.get("correlation_id") or (message.get("headers") or {}).get("id")


def _pending_for(message: Any) -> PendingEnqueue | None:
    pending = PENDING.get()
    if pending is None or pending.reply is not None or pending.ticket is not None:
        return None
    return pending if _message_id(message) == pending.job_id else None


def _shares_server(channel: Any, store: PushesWithLock) -> bool:
    answers = _shares.setdefault(channel, {})
    shares = answers.get(id(store))
    if shares is None:
        shares = answers[id(store)] = store.shares_server(channel.pool.connection_kwargs)
    return shares


def store_unavailable(pending: PendingEnqueue, exc: StoreUnavailable) -> None:
    """Decide by on_store_error: publish without dedup, or raise (past kombu's retries)."""
    try:
        pending.ticket = pending.step.failed(exc)
    except StoreUnavailable as error:
        raise StoreDown(error) from exc


def decide_first(pending: PendingEnqueue) -> None:
    """Take the lock in its own round trip, or read the reply of the acquire sent early;
    raise NotPublished for a duplicate."""
    sent, pending.sent = pending.sent, None
    try:
        pending.reply = pending.store.run(pending.step.op) if sent is None else sent.reply()
    except StoreUnavailable as exc:
        store_unavailable(pending, exc)
        return
    if not lock_taken(pending.reply):
        raise NotPublished(pending.job_id)


def hear_sent(pending: PendingEnqueue) -> None:
    """Read the reply of an acquire sent early that no hook read (Celery failed before the
    publish, or the message left by a way that was not hooked): the reply is kept whatever it
    says, and the store being down decides by on_store_error without raising."""
    if pending.sent is not None:
        with contextlib.suppress(NotPublished, StoreDown):
            decide_first(pending)


def install_hooks() -> None:
    """Hook kombu's Redis ``Channel._put`` and ``_put_fanout`` (once per process)."""
    channel_cls: Any = kombu_redis.Channel
    with _hooked:
        if getattr(channel_cls, "_taskdedup_hooked", False):
            return
        put, put_fanout = channel_cls._put, channel_cls._put_fanout

        def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> Any:
            pending = _pending_for(message)
            if pending is None:
                return put(self, queue, message, **kwargs)
            expiring = self._expires and queue in self._expires
            store = cast(PushesWithLock, pending.store)
            if "_publish_batch" in kwargs or expiring or not _shares_server(self, store):
                pending.batched = kwargs.get("_publish_batch") is not None
                decide_first(pending)
                return put(self, queue, message, **kwargs)
            priority = self._get_message_priority(message, reverse=False)
            name = self.global_keyprefix + self._q_for_pri(queue, priority)
            try:
                message_text = dumps(message)  # type: ignore[no-untyped-call]
                reply = push_with_lock(store, pending.step, name, message_text)
            except StoreUnavailable as exc:
                store_unavailable(pending, exc)
                return put(self, queue, message, **kwargs)  # publish without dedup
            pending.reply, pending.fused = reply, True
            if not lock_taken(reply):
                raise NotPublished(pending.job_id)
            return None

        def _put_fanout(self: Any, exchange: str, message: Any, routing_key: str, **kw: Any) -> Any:
            pending = _pending_for(message)
            if pending is not None:
                pending.batched = kw.get("_publish_batch") is not None
                decide_first(pending)
            return put_fanout(self, exchange, message, routing_key, **kw)

        channel_cls._put, channel_cls._put_fanout = _put, _put_fanout
        channel_cls._taskdedup_hooked = True


def send_keeping_producer(app: Any, send: Any, *call: Any, **options: Any) -> Any:
    """``send(*call, **options)`` (Celery's ``send_task``) on a producer of the app's pool
    taken here, unless the call brings its own: NotPublished (a duplicate found in kombu's
    push) then gives the producer back whole. Raised through Celery's own acquire, it made
    kombu replace the pooled connection as broken: a reconnect, a channel and a queue declare
    at the next publish, 5-15 ms per duplicate. Any other error replaces it, as kombu does."""
    if options.get("producer") is not None or options.get("connection") is not None:
        return send(*call, **options)
    producer = app.producer_pool.acquire(block=True, timeout=app.conf.broker_pool_acquire_timeout)
    try:
        result = send(*call, **{**options, "producer": producer})
    except NotPublished:
        producer.release()
        raise
    except BaseException as exc:
        producer.__exit__(type(exc), exc, exc.__traceback__)
        raise
    producer.release()
    return result


def hook_send_task_message(amqp: Any) -> None:
    """Read an acquire sent early (see stores/redis_sent) in ``amqp.send_task_message``: after
    Celery built the message, before it is published (once per app)."""
    if getattr(amqp, "_taskdedup_hooked", False):
        return
    original = amqp.send_task_message

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        pending = PENDING.get()
        if (
            pending is not None
            and pending.sent is not None
            and message.headers.get("id") == pending.job_id
        ):
            decide_first(pending)
        return original(producer, name, message, **options)

    amqp.send_task_message = send_task_message
    amqp._taskdedup_hooked = True
