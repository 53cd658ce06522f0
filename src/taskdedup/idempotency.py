"""Idempotency keys: a client names its submission (a commit SHA, a build id), and a retry of
it within the ttl gets the original job back instead of a new one.

The first submission records key -> (job id, fingerprint of the task and its canonical
arguments). A repeat with the same fingerprint is a *hit*: nothing is published and the caller
gets the original job. The same key with another task or other arguments is a *mismatch*:
``IdempotencyKeyMismatch`` (or, with ``idempotency_on_mismatch="return"``, the original job).
The record is written with the short ``grace`` first and confirmed to its ttl once the job is
published (G11), so a producer that dies before publishing never pins a key to a job that was
never sent. A repeat that finds the record still unconfirmed waits (``idempotency_wait``) for it
to be confirmed or freed rather than answer with a job whose publish may yet fail; then
``IdempotencyKeyInProgress``. Keys are digested: the raw key never becomes a store key name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from .decide import Step
from .errors import (
    IdempotencyKeyInProgress,
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    StoreUnavailable,
)
from .flow import Flow, Pause, adrive, drive
from .policy import Policy, seconds
from .stores.base import IDEMPOTENCY_KEY, Op, Release, Remember, RememberReply, ms

if TYPE_CHECKING:
    from .core import Deduplicator

#: 1 to 256 printable ASCII characters, no spaces: CI keys like ``gh-org/repo-<sha>`` pass.
KEY_PATTERN = re.compile(r"[!-~]{1,256}")

RecallOutcome = Literal["new", "hit", "mismatch", "pending", "store_unavailable"]
#: How often a submission asks again about a record whose publish is not confirmed yet.
PENDING_POLL = 0.05


def check_key(key: object) -> str:
    """The key itself if it is valid, else InvalidIdempotencyKey saying what a key may be."""
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise InvalidIdempotencyKey(key)
    return key


def record_key(key: str) -> str:
    """The store key of an idempotency key (a digest, so any valid key is a safe name)."""
    return IDEMPOTENCY_KEY + hashlib.sha256(key.encode()).hexdigest()[:32]


def fingerprint(
    task: str, fn: Callable[..., Any] | None, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str:
    """The task and its canonical arguments (G8: f(1) and f(a=1) have one fingerprint)."""
    return Policy().bind(task, fn).key_for(args, kwargs)


@dataclasses.dataclass(frozen=True, slots=True)
class Recall:
    """The answer for an idempotency key: a new submission, or the original job."""

    outcome: RecallOutcome
    job_id: str  # ours for a new submission, else the original job's
    key: str  # the idempotency key as the client gave it
    confirm: bool = False  # the record waits for a publish confirmation (G11)
    ttl_ms: int = 0  # how long the record answers once confirmed

    @property
    def is_new(self) -> bool:
        return self.outcome == "new"

    @property
    def hit(self) -> bool:
        """True when nothing must be published: the caller gets the original ``job_id``."""
        return self.outcome in ("hit", "mismatch")


class IdempotencyKeys:
    """Records and answers idempotency keys through a Deduplicator's store and settings."""

    def __init__(self, dedup: Deduplicator) -> None:
        self.dedup = dedup

    def plan(
        self, key: str, task: str, fingerprint: str, job_id: str, ttl: float | None = None
    ) -> Step[Recall]:
        """The store step for one submission (raises InvalidIdempotencyKey for a bad key)."""
        check_key(key)
        settings = self.dedup.settings
        ttl_s = settings.idempotency_ttl if ttl is None else seconds(ttl, name="idempotency_ttl")
        ttl_ms = ms(cast(float, ttl_s))
        grace_ms = min(ms(settings.grace), ttl_ms)
        op = Remember(record_key(key), job_id, fingerprint, ttl_ms, grace_ms)

        def done(reply: RememberReply) -> Recall:
            if reply.new:
                self.dedup.note("idempotency", "new", logging.DEBUG, task, key=key, job=job_id)
                return Recall("new", job_id, key, confirm=grace_ms < ttl_ms, ttl_ms=ttl_ms)
            if settings.dry_run:  # decide and log, but answer nothing: the call publishes
                outcome = "would_hit" if reply.fingerprint == fingerprint else "would_mismatch"
                self.dedup.note(  # names the original job, as a real hit would
                    "idempotency",
                    outcome,
                    logging.INFO,
                    task,
                    key=key,
                    job=reply.job_id,
                    new=job_id,
                )
                return Recall("new", job_id, key)
            mismatch = reply.fingerprint != fingerprint
            if reply.pending and not (mismatch and settings.idempotency_on_mismatch == "raise"):
                return Recall("pending", reply.job_id, key)  # its publish may still fail
            if not mismatch:
                self.dedup.note("idempotency", "hit", logging.INFO, task, key=key, job=reply.job_id)
                return Recall("hit", reply.job_id, key)
            self.dedup.note(
                "idempotency", "mismatch", logging.WARNING, task, key=key, job=reply.job_id
            )
            if settings.idempotency_on_mismatch == "raise":
                raise IdempotencyKeyMismatch(key, reply.job_id)
            return Recall("mismatch", reply.job_id, key)

        def failed(exc: StoreUnavailable) -> Recall:
            self.dedup.store_unavailable("idempotency", task, exc, key=key, job=job_id)
            return Recall("store_unavailable", job_id, key)

        return Step(op, done, failed)

    def recall(
        self, key: str, task: str, fingerprint: str, job_id: str, ttl: float | None = None
    ) -> Recall:
        """Record a new submission under ``key``, or answer the original job once its
        publish is confirmed (IdempotencyKeyInProgress if that takes ``idempotency_wait``)."""
        return drive(self.recall_flow(key, task, fingerprint, job_id, ttl), self.dedup.store)

    async def arecall(
        self, key: str, task: str, fingerprint: str, job_id: str, ttl: float | None = None
    ) -> Recall:
        return await adrive(self.recall_flow(key, task, fingerprint, job_id, ttl), self.dedup.store)

    def recall_flow(
        self, key: str, task: str, fingerprint: str, job_id: str, ttl: float | None
    ) -> Flow[Recall]:
        step = self.plan(key, task, fingerprint, job_id, ttl)
        if not self.dedup.active(task):  # the kill switch: every call publishes
            return Recall("new", job_id, key)
        deadline = time.monotonic() + self.dedup.settings.idempotency_wait
        while True:
            try:
                answer = step.done((yield step.op))
            except StoreUnavailable as exc:
                answer = step.failed(exc)
            if answer.outcome != "pending":
                return answer
            self._still_pending(answer, task, deadline)
            yield Pause(PENDING_POLL)

    def _still_pending(self, answer: Recall, task: str, deadline: float) -> None:
        """Raise once the wait for another submission's publish is over."""
        if time.monotonic() < deadline:
            return
        self.dedup.note("idempotency", "in_progress", logging.WARNING, task, key=answer.key)
        raise IdempotencyKeyInProgress(
            answer.key, answer.job_id, self.dedup.settings.idempotency_wait
        )

    def published(self, recall: Recall) -> None:
        """The new submission's job is in the broker: keep its record for the whole ttl."""
        if recall.is_new and recall.confirm:
            self.dedup.confirmer.add(record_key(recall.key), recall.job_id)

    def _forget_op(self, recall: Recall) -> Release | None:
        return Release(record_key(recall.key), recall.job_id) if recall.is_new else None

    def publish_failed(self, recall: Recall) -> None:
        """Nothing was published: free the key before the error reaches the caller."""
        drive(self.publish_failed_flow(recall), self.dedup.store)

    async def apublish_failed(self, recall: Recall) -> None:
        await adrive(self.publish_failed_flow(recall), self.dedup.store)

    def publish_failed_flow(self, recall: Recall) -> Flow[None]:
        return self._quietly(self._forget_op(recall), "free")

    def _repoint_op(self, recall: Recall, holder: str, fingerprint: str) -> Remember | None:
        if not recall.is_new:
            return None
        ttl = recall.ttl_ms
        return Remember(record_key(recall.key), holder, fingerprint, ttl, ttl, recall.job_id)

    def repoint(self, recall: Recall, holder: str, fingerprint: str) -> None:
        """The submission was a duplicate of ``holder``'s job: the key now answers that job."""
        drive(self.repoint_flow(recall, holder, fingerprint), self.dedup.store)

    async def arepoint(self, recall: Recall, holder: str, fingerprint: str) -> None:
        await adrive(self.repoint_flow(recall, holder, fingerprint), self.dedup.store)

    def repoint_flow(self, recall: Recall, holder: str, fingerprint: str) -> Flow[None]:
        return self._quietly(self._repoint_op(recall, holder, fingerprint), "repoint")

    @staticmethod
    def _quietly(op: Op[Any] | None, what: str) -> Flow[None]:
        """Run ``op`` if any; a store that cannot answer is logged (the record lapses)."""
        if op is None:
            return
        try:
            yield op
        except StoreUnavailable as exc:
            logging.getLogger("taskdedup").warning("could not %s idempotency key: %s", what, exc)
