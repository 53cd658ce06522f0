"""What the decisions answer: a Ticket for an enqueue, an Admission for a claim, a Completion
for a finish; the delays a delivery waits before it is tried again; the claims a delivery
remembers as lost. Plain values, no I/O: adapters read them and act."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from ..stores.base import Handoff, Lease

TicketOutcome = Literal["acquired", "duplicate", "store_unavailable", "skipped"]
#: Seconds before a delivery whose key is another job's (busy) is tried again.
BUSY_DELAY = 1.0
#: Seconds before a job that holds no slot and found its scope full at start is tried again.
FULL_DELAY = 2.0
#: The longest wait between two tries of a delivery the store could not claim (G14).
STORE_RETRY_MAX = 30.0
AdmissionOutcome = Literal[
    "run", "running", "done", "busy", "exhausted", "store_unavailable", "skipped", "early"
]


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    """The answer to an enqueue: publish ``job_id``, or hand the caller ``holder``'s job."""

    outcome: TicketOutcome
    job_id: str  # the id to publish under (ours), or the holder's id for a duplicate
    key: str | None
    fence: int = 0
    duplicates: int = 0
    dry_run: bool = False
    confirm: bool = False  # the lock waits for a publish confirmation (G11)
    running: bool = False  # a duplicate: its holder was running (not still queued)

    @property
    def acquired(self) -> bool:
        return self.outcome == "acquired"

    @property
    def deduplicated(self) -> bool:
        """True when nothing must be published: the caller gets ``job_id``'s existing job."""
        return self.outcome == "duplicate" and not self.dry_run

    @property
    def should_publish(self) -> bool:
        return not self.deduplicated


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """The answer to a claim: may this delivery of the job run now?"""

    outcome: AdmissionOutcome
    job_id: str
    key: str | None
    fence: int = 0
    attempts: int = 0
    holder: str = ""
    handoff: Handoff | None = None  # publish this job now (reschedule owed at start)
    lease: Lease | None = None  # renew this while the job runs
    dry_run: bool = False
    retry_after: float | None = None  # not run now: send this delivery again in so many s
    #: the claim's own id: when the store could not answer (store_unavailable), the delivery
    #: sent again carries it among its lost claims, so a record that claim may have written is
    #: not taken for a run of the job elsewhere
    claim_nonce: str = ""
    #: debounce: the burst's latest arguments (a later submission's, serialized as the
    #: adapter serialized them): the run takes these rather than its message's
    arguments: str | None = None

    @property
    def should_run(self) -> bool:
        """Run the body now. Otherwise the delivery is sent again after ``retry_after``
        (busy, its holder running, the store down, a debounced run not due yet) or, when that
        is None, dropped."""
        return self.outcome in ("run", "skipped") or self.dry_run


#: How many lost claims a delivery remembers (the store answers again long before more pile up)
LOST_CLAIMS_KEPT = 8


def parse_lost_claims(value: Any) -> list[str]:
    """The lost claims a delivery carries (a header or label: a list, or comma-separated)."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item) for item in items if item][-LOST_CLAIMS_KEPT:]


def with_lost_claim(lost: Sequence[str], admission: Admission) -> list[str]:
    """``lost`` plus this claim's nonce when the store could not answer it (its reply may have
    been lost after the store wrote the job's record)."""
    if admission.outcome != "store_unavailable" or not admission.claim_nonce:
        return list(lost)
    return [*lost, admission.claim_nonce][-LOST_CLAIMS_KEPT:]


def store_retry_delay(waits: int) -> float:
    """How long a delivery waits before its next claim after ``waits`` claims the store could
    not answer: 1, 2, 4 ... seconds, at most STORE_RETRY_MAX."""
    return min(2.0 ** max(waits, 0), STORE_RETRY_MAX)


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """The answer to a finish: whether the lock was released, and a job to publish, if owed."""

    released: bool
    handoff: Handoff | None = None
