"""What taskdedup carries with a job's message: the same names in Celery headers and taskiq
labels, and how a delivery sent back because the store could not answer counts its waits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from typing import Any

from .answers import Admission, parse_lost_claims, with_lost_claim

KEY = "taskdedup_key"  # the dedup key, so the worker need not compute it again
SCOPE = "taskdedup_scope"  # the reservation scope whose slot the job holds
FENCE = "taskdedup_fence"  # the fencing token of the running job (taskiq labels)
TICK = "taskdedup_tick"  # a scheduler's send: the slot of its tick (epoch ms)
#: How many times a delivery was sent back because the store could not answer its claim.
STORE_WAITS = "taskdedup_store_waits"
#: The nonces of this job's claims whose replies never arrived (see Admission.claim_nonce).
LOST_CLAIMS = "taskdedup_lost_claims"


@dataclasses.dataclass(frozen=True, slots=True)
class Waits:
    """A delivery's history with a store that could not answer its claims."""

    store_waits: int = 0
    lost_claims: tuple[str, ...] = ()

    @classmethod
    def read(cls, get: Callable[[str], Any]) -> Waits:
        """From a message's headers or labels (``get`` returns a value or None)."""
        return cls(int(get(STORE_WAITS) or 0), tuple(parse_lost_claims(get(LOST_CLAIMS))))

    def after(self, admission: Admission) -> Waits:
        """The waits of the copy sent back after ``admission`` (one more when the store could
        not answer, its claim's nonce remembered as lost)."""
        if admission.outcome != "store_unavailable":
            return self
        lost = with_lost_claim(self.lost_claims, admission)
        return Waits(self.store_waits + 1, tuple(lost))

    def write(self, values: MutableMapping[str, Any]) -> None:
        """Into the headers or labels of the copy (none written when there is nothing)."""
        values.pop(STORE_WAITS, None)
        values.pop(LOST_CLAIMS, None)
        if self.store_waits:
            values[STORE_WAITS] = self.store_waits
        if self.lost_claims:
            values[LOST_CLAIMS] = ",".join(self.lost_claims)
