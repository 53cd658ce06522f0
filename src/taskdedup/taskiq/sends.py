"""What the producer decided for each send (read by the kick and the kicker), and the helpers
both sides use to read and re-send a taskiq message."""

from __future__ import annotations

import base64
import contextvars
import dataclasses
from typing import TYPE_CHECKING, Any

from taskiq.message import TaskiqMessage

from ..decide import Step, Ticket
from ..submission import Taken

if TYPE_CHECKING:
    from taskiq.abc.broker import AsyncBroker


@dataclasses.dataclass(slots=True)
class Decision:
    """What ``pre_send`` decided for one ``kiq()``, for the kick (and the kicker) to act on."""

    message: TaskiqMessage
    sent_id: str  # the task id the message was built with
    taken: Taken  # to confirm after the kick (or give back), or the existing job the caller gets
    step: Step[Ticket] | None = None  # fused path: acquire and push in the kick
    kicked: bool = False

    @property
    def deduplicated(self) -> bool:
        """Nothing is sent: the caller gets an existing job (a duplicate, an idempotent hit)."""
        return self.taken.answer != "publish"


#: The decisions of this context's sends, by task id (the id sent and, once known, the id
#: the caller gets), so a kiq() nested in another middleware's pre_send keeps its own.
_DECISIONS: contextvars.ContextVar[dict[str, Decision] | None] = contextvars.ContextVar(
    "taskdedup_decisions", default=None
)
_KEEP = 256  # decisions kept for handles nobody marks (kicks by plain kickers)


def remember(decision: Decision) -> None:
    """File ``decision`` under its ids for the kick (and the kicker's handle) to find."""
    table = _DECISIONS.get()
    if table is None:
        table = {}
        _DECISIONS.set(table)
    if len(table) >= _KEEP:
        for stale in list(table)[: _KEEP // 2]:
            del table[stale]
    table[decision.sent_id] = table[decision.taken.job_id] = decision


def decision_for(task_id: str) -> Decision | None:
    table = _DECISIONS.get()
    return None if table is None else table.get(task_id)


def pending() -> list[Decision]:
    """This context's decisions (each once)."""
    table = _DECISIONS.get()
    return list({id(d): d for d in table.values()}.values()) if table else []


def forget(decision: Decision) -> None:
    table = _DECISIONS.get()
    if table is not None:
        table.pop(decision.sent_id, None)
        table.pop(decision.taken.job_id, None)


#: Set while taskdedup itself re-sends a message (a deferred copy, a hand-off): no dedup.
PASS_THROUGH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "taskdedup_pass_through", default=False
)


def dump_call(broker: AsyncBroker, args: Any, kwargs: Any) -> str:
    """A duplicate's arguments, kept for reschedule_once, in the broker's own serializer."""
    return base64.b64encode(broker.serializer.dumpb([args, kwargs])).decode()


def load_call(broker: AsyncBroker, payload: str) -> tuple[list[Any], dict[str, Any]]:
    args, kwargs = broker.serializer.loadb(base64.b64decode(payload))
    return list(args), dict(kwargs)


def queue_of(broker: AsyncBroker, message: TaskiqMessage) -> str | None:
    """The queue the message goes to (taskiq-redis honours a ``queue_name`` label)."""
    return message.labels.get("queue_name") or getattr(broker, "queue_name", None)
