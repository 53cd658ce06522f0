"""The decisions of the lock's life, with no I/O: each planner takes what a framework saw
(a call submitted, a delivery received, a run ended) and returns the answer, or the store
operation to run and how to read its reply. ``taskdedup.core`` runs them."""

from .answers import (
    BUSY_DELAY,
    FULL_DELAY,
    STORE_RETRY_MAX,
    Admission,
    Completion,
    Ticket,
    parse_lost_claims,
    store_retry_delay,
    with_lost_claim,
)
from .claim import plan_claim
from .enqueue import plan_enqueue, plan_held
from .finish import plan_finish, plan_heartbeat, plan_release, plan_retry
from .step import Notes, Step, active

__all__ = [
    "BUSY_DELAY",
    "FULL_DELAY",
    "STORE_RETRY_MAX",
    "Admission",
    "Completion",
    "Notes",
    "Step",
    "Ticket",
    "active",
    "parse_lost_claims",
    "plan_claim",
    "plan_enqueue",
    "plan_finish",
    "plan_heartbeat",
    "plan_held",
    "plan_release",
    "plan_retry",
    "store_retry_delay",
    "with_lost_claim",
]
