"""The producer side: every taskiq send passes ``pre_send`` and then ``broker.kick``.

``task.kiq()``, ``task.kicker().kiq()``, an ``AsyncKicker`` by name, the scheduler and the retry
middlewares all build a message, run the middlewares' ``pre_send`` and call ``broker.kick``.
A stock ``pre_send`` cannot cancel a send, so the middleware wraps the broker's ``kick`` too:
``pre_send`` decides (or plans) and notes the decision in a context variable, which the kick of
the same ``kiq()`` reads. A duplicate is not kicked, and its ``task_id`` becomes the holder's, so
the handle ``kiq()`` returns points at the job that will run.

What a send takes (its idempotency key, lock and slot: :func:`taskdedup.submission.submit`;
a retry keeps its own) is taken in ``pre_send``, confirmed in a batch after the broker's own
kick succeeded (G11) and given back if it failed (G5). On a taskiq-redis ``ListQueueBroker``
whose Redis is the store's, the lock and the message are written by one script in the kick
(one round trip, no confirmation needed).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from copy import copy
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from taskiq.decor import AsyncTaskiqDecoratedTask
from taskiq.kicker import AsyncKicker
from taskiq.labels import LabelType
from taskiq.message import BrokerMessage, TaskiqMessage
from taskiq.task import AsyncTaskiqTask
from taskiq_redis import ListQueueBroker

from .. import submission, transactions
from ..decide import Step, Ticket, envelope
from ..errors import StoreUnavailable
from ..recent import RecentKeys
from ..stores import pushes_with_lock
from ..submission import Call, Taken
from ..ticks import once_per_tick, sent_now
from .options import (
    ATTEMPT_LABEL,
    FENCE_LABEL,
    IDEMPOTENCY_KEY_LABEL,
    IDEMPOTENCY_TTL_LABEL,
    KEY_LABEL,
    LABEL,
    OPTION_PREFIX,
    PACE_LABEL,
    RESERVE_LABEL,
    RETRIES_LABEL,
    SCOPE_LABEL,
    START_LABEL,
    call_shape,
    declared,
    label,
    set_label,
    task_function,
    task_limits,
    task_pace,
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

P = ParamSpec("P")
R = TypeVar("R")
Kick = Callable[[BrokerMessage], Awaitable[None]]


class Producer:
    """``pre_send`` and the wrapped ``kick`` of one broker."""

    def __init__(self, middleware: DedupState, retried: Callable[[str, int], None]) -> None:
        self.mw = middleware
        self.retried = retried  # the worker's: a retry of this attempt was sent
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
                await self._give_back(decision.taken)

    # ------------------------------------------------------------------ pre_send

    async def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        call = None if PASS_THROUGH.get() else self._call(message)
        if call is None:
            return message
        for name in (LABEL, RESERVE_LABEL, PACE_LABEL):  # a declaration stringified into it
            if (message.labels_types or {}).get(name) == LabelType.ANY:
                del message.labels[name]
                del message.labels_types[name]  # type: ignore[union-attr]
        if call.retry:  # a retry middleware re-sends the job under its id (G6)
            self.retried(call.job_id, call.attempt)
            for name in (FENCE_LABEL, ATTEMPT_LABEL):
                message.labels.pop(name, None)
        elif self._fused(call, message):
            return message
        mw = self.mw
        flow = submission.submit(mw.dedup, mw.idempotency, mw.reservations, self.recent, call)
        taken = await mw.dedup.adrive(flow)
        if taken.key is not None:
            set_label(message, KEY_LABEL, taken.key, parsed=False)
        if taken.scope is not None:
            set_label(message, SCOPE_LABEL, taken.scope, parsed=False)
        if taken.start_in is not None:  # @pace: the worker holds it back until then
            set_label(message, START_LABEL, repr(time.time() + taken.start_in), parsed=False)
        if call.tick is not None and call.tick.slot_ms is not None:
            set_label(message, envelope.TICK, call.tick.slot_ms, parsed=False)
        message.task_id = taken.job_id  # a duplicate's (or a hit's) handle: the existing job
        remember(Decision(message, call.job_id, taken))  # for the kick
        return message

    def _call(self, message: TaskiqMessage) -> Call | None:
        """The call a message makes, read from its labels once; None for a task with no
        policy, cap or idempotency key. A retry (``_retries``) names its job's key and scope."""
        broker = self.mw.broker
        task = broker.find_task(message.task_name)
        if task is None:
            return None
        policy, limits = self.mw.policies.for_message(task, message), task_limits(task)
        idempotency_key, pace = label(message, IDEMPOTENCY_KEY_LABEL), task_pace(task)
        tick = sent_now(message.labels.get("schedule_id"))
        ticked = once_per_tick(self.mw.settings, tick, policy, message.task_name)
        if not (policy or limits or pace or idempotency_key is not None or ticked):
            return None
        retries = int(label(message, RETRIES_LABEL) or 0)
        ttl = label(message, IDEMPOTENCY_TTL_LABEL)
        call = Call(
            message.task_name,
            call_shape(task_function(task)) if limits or pace or idempotency_key else None,
            message.args,
            message.kwargs,
            message.task_id,
            policy,
            limits,
            idempotency_key=idempotency_key,
            idempotency_ttl=None if ttl is None else float(ttl),
            delay=float(label(message, "delay") or 0.0),
            queue=queue_of(broker, message),
            tick=tick,
            dump=lambda: dump_call(broker, message.args, message.kwargs),
            pace=pace,
        )
        if retries > 0:
            call.retry, call.attempt = True, retries - 1
            call.key = label(message, KEY_LABEL) or None
            call.scope = label(message, SCOPE_LABEL) or None
        return call

    def _fused(self, call: Call, message: TaskiqMessage) -> bool:
        """Plan the acquire of a plain call that :func:`~taskdedup.submission.may_fuse`
        (taskiq turns an error of the kick into SendTaskError), to run in the kick with the
        push, on a taskiq-redis ListQueueBroker on the store's own Redis; not a scheduler's
        tick (the usual path says its skips once per entry). False: the usual path."""
        policy, settings = call.policy, self.mw.settings
        plain = not (call.idempotency_key or call.limits or call.pace or call.tick)
        if policy is None or not plain:
            return False
        if not submission.may_fuse(policy, settings, errors_leave_publish=False):
            return False
        if self._fusable_broker is None:
            broker, store = self.mw.broker, self.mw.dedup.store
            self._fusable_broker = (
                type(broker).kick is ListQueueBroker.kick
                and pushes_with_lock(store)
                and store.shares_server(broker.connection_pool.connection_kwargs)  # type: ignore[attr-defined]
            )
        if not self._fusable_broker:
            return False
        plan = submission.plan_call(self.mw.dedup, policy, call)
        if isinstance(plan, Step):  # (a Ticket: not deduplicated, sent as it is)
            key = submission.planned_key(plan)
            set_label(message, KEY_LABEL, key, parsed=False)
            remember(Decision(message, call.job_id, Taken("publish", call.job_id, key), plan))
        return True

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

    # ------------------------------------------------------------------ kick

    async def kick(self, message: BrokerMessage) -> None:
        """The broker's kick, skipped for a duplicate and fused with the acquire if planned."""
        decision = decision_for(message.task_id)
        if decision is None or decision.kicked:
            await self._send(message)
            return
        decision.kicked = True
        if decision.step is not None:
            await self._acquire_and_push(decision, decision.step, message)
        elif not decision.deduplicated:
            joined = transactions.current(self.mw.dedup.store)
            if joined is not None:
                # the lock is the caller's transaction's: the kick waits for its commit
                joined.after_commit(functools.partial(self._publish, decision.taken, message))
                return
            await self._publish(decision.taken, message)

    async def _publish(self, taken: Taken, message: BrokerMessage) -> None:
        """Send the message, then confirm what was taken for it (or give it back: G5)."""
        try:
            await self._send(message)
        except BaseException:
            await self._give_back(taken)
            raise
        submission.published(self.mw.dedup, self.mw.idempotency, taken)

    async def _give_back(self, taken: Taken) -> None:
        """Nothing was sent: release the lock, free the idempotency key and the slot."""
        mw = self.mw
        await mw.dedup.adrive(
            submission.give_back(mw.dedup, mw.idempotency, mw.reservations, taken)
        )

    async def _acquire_and_push(
        self, decision: Decision, step: Step[Ticket], message: BrokerMessage
    ) -> None:
        dedup, store = self.mw.dedup, self.mw.dedup.store
        assert pushes_with_lock(store)
        queue = message.labels.get("queue_name") or self.mw.broker.queue_name  # type: ignore[attr-defined]
        try:
            reply = await submission.apush_with_lock(store, step, queue, message.message)
        except StoreUnavailable as exc:
            step.failed(exc)  # logs (on_store_error="raise" never takes this path)
            await self._send(message)  # publish without dedup (G5)
            return
        pushed = await dedup.adrive(submission.after_push(dedup, step, reply))
        self.recent.note(pushed.ticket)
        ticket = pushed.ticket
        if pushed.answer == "duplicate":
            decision.taken = Taken("duplicate", ticket.job_id, ticket.key)
            decision.message.task_id = ticket.job_id
            remember(decision)
        elif pushed.answer == "publish":  # the holder's publish failed (the lock is ours), or
            decision.taken.ticket = ticket  # the store went down: published all the same
            await self._publish(decision.taken, message)

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


def mark(handle: Any) -> Any:
    """Set ``.deduplicated`` (and the holder's id) on the handle ``kiq()`` just returned."""
    decision = decision_for(handle.task_id)
    answer = "publish"
    if decision is not None:
        forget(decision)
        if decision.kicked and decision.deduplicated:
            answer = decision.taken.answer
            handle.task_id = decision.taken.job_id
    handle.deduplicated = answer == "duplicate"
    handle.idempotent_hit = answer == "hit"
    return handle


class DedupKicker(AsyncKicker[P, R]):
    """An ``AsyncKicker`` whose handles say whether the send was deduplicated.

    Tasks of a broker with the middleware hand these out from ``.kicker()``; build one
    yourself to kick by name: ``DedupKicker("app:report", broker, {}).kiq(...)``.
    """

    async def kiq(self, *args: Any, **kwargs: Any) -> Any:
        producer: Producer | None = getattr(self.broker, "_taskdedup_producer", None)
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
