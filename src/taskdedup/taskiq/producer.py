"""The producer side: every taskiq send passes ``pre_send`` and then ``broker.kick``.

``task.kiq()``, ``task.kicker().kiq()``, an ``AsyncKicker`` by name, the scheduler and the retry
middlewares all build a message, run the middlewares' ``pre_send`` and call ``broker.kick``.
A stock ``pre_send`` cannot cancel a send, so the middleware wraps the broker's ``kick`` too:
``pre_send`` decides (or plans) and notes the decision in a context variable, which the kick of
the same ``kiq()`` reads. A duplicate is not kicked, and its ``task_id`` becomes the holder's, so
the handle ``kiq()`` returns points at the job that will run.

On a taskiq-redis ``ListQueueBroker`` whose Redis is the store's, the lock and the message are
written by one script in the kick (one round trip, no confirmation needed); elsewhere the lock is
taken in ``pre_send`` and confirmed in a batch after the broker's own kick succeeded (G11).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from copy import copy
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.kicker import AsyncKicker
from taskiq.labels import LabelType
from taskiq.message import BrokerMessage, TaskiqMessage
from taskiq.task import AsyncTaskiqTask
from taskiq_redis import ListQueueBroker

from .. import submission
from ..decide import Step, Ticket
from ..errors import StoreUnavailable
from ..policy import TaskPolicy
from ..recent import RecentKeys
from ..reservations import ReservePolicy
from ..stores.base import Acquire
from ..stores.redis import RedisStore
from .guarded import give_back, guarded_pre_send
from .options import (
    FENCE_LABEL,
    IDEMPOTENCY_KEY_LABEL,
    KEY_LABEL,
    LABEL,
    OPTION_PREFIX,
    RESERVE_LABEL,
    RETRIES_LABEL,
    SCOPE_LABEL,
    declared,
    label,
    set_label,
    task_limits,
)
from .sends import (
    PASS_THROUGH,
    Decision,
    decision_for,
    dump_call,
    forget,
    pending,
    queue_of,
    remember,
)
from .state import DedupState

if TYPE_CHECKING:
    from taskiq.abc.broker import AsyncBroker

log = logging.getLogger("taskdedup")
P = ParamSpec("P")
R = TypeVar("R")
Kick = Callable[[BrokerMessage], Awaitable[None]]


async def keep_for_retry(
    mw: DedupState,
    policy: TaskPolicy | None,
    limits: ReservePolicy | None,
    message: TaskiqMessage,
    retries: int,
) -> None:
    """A retry middleware re-sends the job under its id: it keeps its lock and slot (G6)."""
    mw.retried(message.task_id, retries - 1)
    # if the retry's send fails, its kick gives back the lock and slot kept for it
    decision = Decision(message, message.task_id, message.task_id)
    remember(decision)
    call = submission.Call(
        message.task_name,
        None,
        message.args,
        message.kwargs,
        message.task_id,
        policy,
        limits,
        delay=float(label(message, "delay") or 0.0),
        queue=queue_of(mw.broker, message),
    )
    key, scope = label(message, KEY_LABEL) or None, label(message, SCOPE_LABEL) or None
    flow = submission.keep_for_retry(mw.dedup, mw.reservations, call, key, scope, retries - 1)
    taken = await mw.dedup.adrive(flow)
    if taken.key is not None:
        set_label(message, KEY_LABEL, taken.key, parsed=False)
    decision.ticket, decision.scope = taken.ticket, taken.scope
    for name in (FENCE_LABEL, "taskdedup_attempt"):
        message.labels.pop(name, None)


class Producer:
    """``pre_send`` and the wrapped ``kick`` of one broker."""

    def __init__(self, middleware: DedupState) -> None:
        self.mw = middleware
        self.original_kick: Kick | None = None
        self._fusable_broker: bool | None = None
        self.recent = RecentKeys()  # keys asked about before a message is built

    def install(self, broker: AsyncBroker) -> None:
        """Wrap the broker's kick (once) and make its tasks hand out marked handles."""
        if self.original_kick is None:
            self.original_kick = broker.kick
            broker.kick = self.kick  # type: ignore[method-assign]
            broker._taskdedup_producer = self  # type: ignore[attr-defined]
        if broker.decorator_class is AsyncTaskiqDecoratedTask:
            broker.decorator_class = DedupTask

    async def give_back_unsent(self) -> None:
        """A ``kiq()`` failed before its kick (the formatter could not serialize the message,
        say): give back the lock, idempotency key and slot its ``pre_send`` took (G5), so
        nothing is left behind."""
        for decision in pending():
            if not decision.kicked and not decision.deduplicated:
                decision.kicked = True
                forget(decision)
                await give_back(self, decision)

    # ------------------------------------------------------------------ pre_send

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        if PASS_THROUGH.get():
            return message
        broker = self.mw.broker
        task = broker.find_task(message.task_name)
        if task is None:
            return message
        policy = self.mw.policies.for_message(task, message)
        limits = task_limits(task)
        idempotency_key = label(message, IDEMPOTENCY_KEY_LABEL)
        if policy is None and limits is None and idempotency_key is None:
            return message
        for name in (LABEL, RESERVE_LABEL):  # a declaration stringified into the message
            if (message.labels_types or {}).get(name) == LabelType.ANY:
                del message.labels[name]
                del message.labels_types[name]  # type: ignore[union-attr]
        retries = int(label(message, RETRIES_LABEL) or 0)
        if retries > 0:
            await keep_for_retry(self.mw, policy, limits, message, retries)
            return message
        if idempotency_key is None and limits is None and policy and self._fusable(policy):
            self._plan_fused(policy, message)
            return message
        await guarded_pre_send(self, task, policy, limits, message)
        return message

    def _plan_fused(self, policy: TaskPolicy, message: TaskiqMessage) -> None:
        """Plan the acquire, to run in the kick with the push (one round trip)."""
        broker = self.mw.broker
        payload = None
        if policy.policy.on_conflict == "reschedule_once":
            payload = dump_call(broker, message.args, message.kwargs)
        plan = self.mw.dedup.plan_enqueue(
            policy,
            message.args,
            message.kwargs,
            message.task_id,
            queue=queue_of(broker, message),
            delay=float(label(message, "delay") or 0.0),
            payload=payload,
        )
        if isinstance(plan, Ticket):  # not deduplicated (disabled, scheduled, ...)
            return
        assert isinstance(plan.op, Acquire)
        set_label(message, KEY_LABEL, plan.op.key, parsed=False)
        decision = Decision(message, message.task_id, message.task_id)
        decision.step = plan
        remember(decision)

    async def ask_first(self, kicker: AsyncKicker[Any, Any], args: Any, kwargs: Any) -> Any:
        """For a plain kick of a key seen held lately, the store's answer before taskiq builds
        a message: the holder's handle when it is still held, else None (the kick goes on)."""
        labels = kicker.labels
        if (
            PASS_THROUGH.get()
            or kicker.custom_task_id
            or any(name.startswith(OPTION_PREFIX) or name in _ASK_FIRST_SKIPS for name in labels)
        ):
            return None
        task = self.mw.broker.find_task(kicker.task_name)
        if task is None:
            return None
        policy = self.mw.policies.resolve(task, declared(task), ())
        if policy is None or (LABEL in labels and labels[LABEL] is not declared(task)):
            return None  # per-call switches take the full path
        key = submission.lately_key(policy, task_limits(task) is not None, args, kwargs)
        step = submission.held_lately(self.mw.dedup, self.recent, policy, key)
        ticket = None if step is None else await self.mw.dedup.arun(step)
        if ticket is None:
            return None
        handle = AsyncTaskiqTask(
            task_id=ticket.job_id,
            result_backend=self.mw.broker.result_backend,
            return_type=kicker.return_type,
        )
        handle.deduplicated = True  # type: ignore[attr-defined]
        handle.idempotent_hit = False  # type: ignore[attr-defined]
        return handle

    def _fusable(self, policy: TaskPolicy) -> bool:
        """Whether the kick may take the lock in the push: a taskiq-redis ListQueueBroker on
        the store's own Redis."""
        settings = self.mw.settings
        if policy.policy.on_conflict == "raise" or settings.on_store_error == "raise":
            return False  # DuplicateJob and StoreUnavailable must leave pre_send as themselves:
            # taskiq turns an error of the kick into SendTaskError
        if not settings.fused_publish:
            return False
        if self._fusable_broker is None:
            broker, store = self.mw.broker, self.mw.dedup.store
            self._fusable_broker = (
                type(broker).kick is ListQueueBroker.kick
                and isinstance(store, RedisStore)
                and store.shares_server(broker.connection_pool.connection_kwargs)  # type: ignore[attr-defined]
            )
        return self._fusable_broker

    # ------------------------------------------------------------------ kick

    async def kick(self, message: BrokerMessage) -> None:
        """The broker's kick, skipped for a duplicate and fused with the acquire if planned."""
        assert self.original_kick is not None
        decision = decision_for(message.task_id)
        if decision is None or decision.kicked:
            await self._send(message)
            return
        decision.kicked = True
        if decision.deduplicated:
            return
        if decision.step is not None:
            await self._acquire_and_push(decision, decision.step, message)
            return
        ticket = decision.ticket
        try:
            await self._send(message)
        except BaseException:
            await give_back(self, decision)  # G5: before the error reaches the caller
            raise
        if ticket is not None:
            self.mw.dedup.published(ticket)
        if decision.recall is not None:
            self.mw.idempotency.published(decision.recall)

    async def _acquire_and_push(
        self, decision: Decision, step: Step[Ticket], message: BrokerMessage
    ) -> None:
        store = self.mw.dedup.store
        assert isinstance(store, RedisStore) and isinstance(step.op, Acquire)
        queue = message.labels.get("queue_name") or self.mw.broker.queue_name  # type: ignore[attr-defined]
        try:
            reply = await store.aacquire_and_push(step.op, queue, message.message)
        except StoreUnavailable as exc:
            step.failed(exc)  # logs (on_store_error="raise" never takes this path)
            await self._send(message)  # publish without dedup (G5)
            return
        reply = self.mw.dedup.published_here(reply)
        if step.waits is not None and reply.pending:  # the holder is being published:
            ticket = await self.mw.dedup.aresume(step)  # ask until it is confirmed or gone
        else:
            ticket = step.done(reply)
        self.recent.note(ticket)
        if ticket.deduplicated:
            decision.deduplicated = True
            decision.job_id = decision.message.task_id = ticket.job_id
            remember(decision)
        elif ticket.acquired and not reply.acquired:  # the holder's publish failed: ours now
            decision.ticket = ticket
            try:
                await self._send(message)
            except BaseException:
                await give_back(self, decision)  # G5
                raise
            self.mw.dedup.published(ticket)
        elif not reply.acquired:  # dry run, or the store went down: published all the same
            await self._send(message)

    async def _send(self, message: BrokerMessage) -> None:
        """The broker's own kick, outside any pass-through of ours (InMemoryBroker runs the
        task in a copy of this context)."""
        assert self.original_kick is not None
        token = PASS_THROUGH.set(False)
        try:
            await self.original_kick(message)
        finally:
            PASS_THROUGH.reset(token)


#: Labels whose kicks always take the full path (a retry, a schedule, a delay, a queue).
_ASK_FIRST_SKIPS = frozenset(
    {RETRIES_LABEL, "schedule_id", "delay", "queue_name", KEY_LABEL, IDEMPOTENCY_KEY_LABEL}
)


def _producer_of(broker: AsyncBroker) -> Producer | None:
    return getattr(broker, "_taskdedup_producer", None)


def mark(handle: Any) -> Any:
    """Set ``.deduplicated`` (and the holder's id) on the handle ``kiq()`` just returned."""
    decision = decision_for(handle.task_id)
    if decision is not None:
        forget(decision)
    answered = bool(decision is not None and decision.kicked and decision.deduplicated)
    hit = answered and decision is not None and decision.hit
    if answered:
        assert decision is not None
        handle.task_id = decision.job_id
    handle.deduplicated = answered and not hit
    handle.idempotent_hit = hit
    return handle


class DedupKicker(AsyncKicker[P, R]):
    """An ``AsyncKicker`` whose handles say whether the send was deduplicated.

    Tasks of a broker with the middleware hand these out from ``.kicker()``; build one
    yourself to kick by name: ``DedupKicker("app:report", broker, {}).kiq(...)``.
    """

    async def kiq(self, *args: Any, **kwargs: Any) -> Any:
        producer = _producer_of(self.broker)
        if producer is not None:
            early = await producer.ask_first(self, args, kwargs)
            if early is not None:
                return early
        try:
            handle = await super().kiq(*args, **kwargs)
        except BaseException:  # e.g. the formatter could not serialize the arguments
            if producer is not None:
                await producer.give_back_unsent()
            raise
        return mark(handle)


class DedupTask(AsyncTaskiqDecoratedTask[P, R]):
    """The broker's task class while the middleware is installed: a bad ``deduplicate=``
    label fails when the task is defined, and ``.kicker()`` is a :class:`DedupKicker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for middleware in self.broker.middlewares:
            if isinstance(middleware, DedupState):
                middleware.policies.check(self)

    def kicker(self) -> DedupKicker[P, R]:
        return DedupKicker(
            task_name=self.task_name,
            broker=self.broker,
            labels=copy(self.labels),
            return_type=self.return_type,
        )
