"""The store protocol: a few atomic primitives that cover every arrow of the lock diagram.

The core never talks to Redis or memory directly. It builds an *operation* (a small frozen
dataclass below), hands it to a store, and reads the typed reply. A store executes each
operation atomically in one round trip, synchronously (:meth:`Store.run`) or from asyncio
(:meth:`Store.arun`), so one copy of the decision logic serves both kinds of caller.

Every record a store writes expires (G9); time is the store's own clock (the Redis server's
time for :class:`~taskdedup.stores.redis.RedisStore`), never the caller's.

Records of one dedup key ``K`` (names are the store's business; these are Redis's):

- ``lock``  the enqueue lock: holder job id, state (queued / running / throttled), fencing
  token, duplicate count and the latest duplicate's payload (for reschedule_once, and for
  debounce, whose lock also holds when its run is due and the burst's cap on that).
- ``run``   the run lock of while_executing strategies: which job runs now.
- ``job:<id>`` one job's execution record, for the redelivery guard (G7): running under a
  lease, waiting for a retry, or done.

An idempotency key is kept as the ``lock`` of the key ``idem:<digest>``: its holder is the
original job, and it carries the fingerprint of the first submission. A reservation scope is
one record of slots (member -> expiry), under the key ``res:<digest>``.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

LockMode = Literal["release", "hold", "none"]
#: early: a debounced job whose run is not due yet (a later submission moved it)
ClaimOutcome = Literal["run", "running", "done", "busy", "exhausted", "early"]
LockState = Literal["queued", "running", "throttled"]
JobStatus = Literal["running", "queued", "finished", "none"]


class Op(Generic[R]):
    """An operation a store executes atomically; ``R`` is the type of its reply."""

    __slots__ = ()


# ---------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireReply:
    acquired: bool
    holder: str  # the job id that holds the lock (ours when acquired)
    fence: int
    duplicates: int
    pending: bool = False  # the holder's publish is not confirmed yet: it may still fail
    running: bool = False  # the holder runs (a supersede duplicate then owes a run, or stops it)
    #: With :attr:`Acquire.guard`: "held", the guard key is another's (nothing was written;
    #: ``guard_answer`` is its remaining ms or its value, as the guard asked); "free", the guard
    #: key was free but the lock is another job's (nothing was written); "" otherwise.
    guard: Literal["", "held", "free"] = ""
    guard_answer: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Handoff:
    """A lock handed to a new job id because a reschedule was owed (reschedule_once)."""

    job_id: str
    payload: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimReply:
    outcome: ClaimOutcome
    fence: int
    attempts: int
    holder: str  # run: our owner; running: the live copy's owner; busy: the job whose key it is
    handoff: Handoff | None = None
    arguments: str | None = None  # run (Claim.latest): the latest duplicate's, to run with
    wait_ms: int = 0  # early: how long until the run is due


@dataclasses.dataclass(frozen=True, slots=True)
class FinishReply:
    released: bool  # the enqueue lock was ours and is released, throttled or handed off
    handoff: Handoff | None = None
    stale: bool = False  # a newer attempt of the job owns the records; nothing was changed


@dataclasses.dataclass(frozen=True, slots=True)
class RememberReply:
    new: bool  # the record is ours (just written, or handed to us by ``replaces``)
    job_id: str  # the job the record points at
    fingerprint: str
    pending: bool = False  # another job's, not yet confirmed: its publish may still fail


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveReply:
    granted: bool
    in_flight: int  # live slots of the scope after the answer


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    member: str  # a reservation id, or the id of the job holding the slot
    expires_in_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class LockInfo:
    key: str
    job_id: str
    state: LockState
    fence: int
    duplicates: int
    ttl_ms: int
    confirmed: bool
    running_job: str | None  # holder of the run lock, if any
    task: str | None = None  # the task whose job took the key
    since_ms: int | None = None  # when it was taken (the store's clock, ms since the epoch)
    worker: str | None = None  # the holder's worker (host:pid), once it started
    attempts: int = 0  # runs of the holder started so far
    started_ms: int | None = None  # when the holder's latest run began (the store's clock)
    last_duplicate: str | None = None  # the latest duplicate's job id ('-': none was made)
    due_ms: int | None = None  # debounce: when the holder's run is due (the store's clock)
    stop_requested: bool = False  # running="cancel": a newer submission asked it to stop


# ---------------------------------------------------------------- operations


@dataclasses.dataclass(frozen=True, slots=True)
class Guard:
    """A plain key an :class:`Acquire` also takes, in the same atomic step, as ``SET key value
    NX [PX ttl_ms]`` (``ttl_ms`` None: no expiry): the lock key of another library that keeps
    deciding during a migration (:mod:`taskdedup.compat`). The guard is taken first: when it
    is another's, nothing else happens and the reply carries ``answer`` of it (``"ttl"``: its
    remaining ms, ``"value"``: what it holds); when it is free but the lock is another job's,
    it is given back. Only a store that shares the guard's server takes one
    (:meth:`Store.takes_guards_on`)."""

    key: str
    value: str
    ttl_ms: int | None
    answer: Literal["ttl", "value"]


@dataclasses.dataclass(frozen=True, slots=True)
class Acquire(Op[AcquireReply]):
    """(none) -> QUEUED(job); QUEUED -> QUEUED, dups+1 (and the payload kept).

    The holder's own job id acquiring again (a hand-off being published, a publish retried
    under the same id) is answered ``acquired`` and changes nothing.
    """

    key: str
    job_id: str
    ttl_ms: int
    grace_ms: int  # expiry until confirmed (G11); equal to ttl_ms to skip confirmation
    record_duplicate: bool = True
    payload: str | None = None
    task: str = ""  # kept in the lock for the tools (``taskdedup locks``)
    #: debounce: the run is due this long after the latest submission, and at most
    #: ``wait_ms`` after the first (0: not debounced)
    debounce_ms: int = 0
    wait_ms: int = 0
    #: supersede with running="cancel": a duplicate of a running holder asks it to stop
    cancel: bool = False
    guard: Guard | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Peek(Op["AcquireReply | None"]):
    """Who holds the enqueue lock, counting the caller as a duplicate; None when it is free
    (nothing is taken then: the caller acquires as usual). A holder whose publish is not
    confirmed yet is answered ``pending`` and nothing is counted."""

    key: str
    record_duplicate: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Claim(Op[ClaimReply]):
    """A worker starts the job: answers run / running elsewhere / done / busy / exhausted."""

    key: str
    job_id: str
    owner: str
    lease_ms: int
    ttl_ms: int
    lock: LockMode  # release at start, hold while running, or leave alone
    run_lock: bool
    memory_ms: int  # how long a finished job is remembered (redelivery guard)
    attempt: int | None = None  # the framework's retry number; higher overtakes a live record
    max_attempts: int | None = None
    handoff_job_id: str | None = None  # new job id if a reschedule is owed at start
    grace_ms: int = 60_000
    #: this claim's own random id, kept in the job record: if its reply is lost, the job's
    #: next delivery names it in ``lost_claims`` and is not taken for a copy of a running job
    nonce: str = ""
    lost_claims: tuple[str, ...] = ()  # claims of this job whose replies never arrived
    task: str = ""  # kept in a lock the claim takes, for the tools
    #: run with the latest duplicate's arguments kept on the lock (debounce, supersede); they
    #: are consumed: a later duplicate (while it runs) owes a run of its own
    latest: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """What a running job renews: its lock records (``key``), or with ``slot`` its slot in the
    reservation scope ``key``."""

    key: str
    job_id: str
    lease_ms: int
    slot: bool = False
    task: str = dataclasses.field(default="", compare=False)  # for what is logged


#: What a lease's renewal answers: the job no longer held anything; it did; it did, and a
#: newer submission asked it to stop (supersede with running="cancel"). Truthy: still held.
LOST, RENEWED, SUPERSEDED = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat(Op[tuple[int, ...]]):
    """Renew many leases at once; each answer is LOST, RENEWED or SUPERSEDED."""

    leases: tuple[Lease, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Retry(Op[bool]):
    """RUNNING(job) -> QUEUED(job): the retry keeps the lock; answers whether it was held.

    Sent before the retry is published, so the lock and the job's record wait for the
    publish's confirmation (:class:`Confirm`) for ``grace_ms``, as a fresh lock does (G11).
    A copy of an earlier attempt waits for that retry: while it may still be sent (the grace),
    and once it was, until it is due (``delay_ms``) plus the grace. A retry that never went
    out, or never came (the broker lost it), is replaced by the copy: it runs as that retry,
    so the retry, should it come after all, finds its attempt running or done.
    """

    key: str
    job_id: str
    ttl_ms: int
    attempt: int | None = None
    grace_ms: int = 60_000
    delay_ms: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Finish(Op[FinishReply]):
    """The job ended: release, throttle until the ttl, or hand off to ``handoff_job_id``."""

    key: str
    job_id: str
    throttle: bool
    memory_ms: int
    handoff_job_id: str | None = None
    attempt: int | None = None
    grace_ms: int = 60_000
    ttl_ms: int = 0  # ttl of a handed-off lock


@dataclasses.dataclass(frozen=True, slots=True)
class Release(Op[bool]):
    """Owner-checked release of the enqueue and run locks (failed publish, revoke).
    ``queued_only``: free the enqueue lock only while it is QUEUED, and no run lock: a job
    discarded or expired somewhere never frees the key of its own run still going elsewhere."""

    key: str
    job_id: str
    queued_only: bool = False
    why: str = ""  # what freed it, for the key's history: publish_failed, revoked, ...


@dataclasses.dataclass(frozen=True, slots=True)
class Confirm(Op[int]):
    """Extend freshly published locks from their grace to their ttl (G11), in one batch; a
    retried job's record learns that its retry went out."""

    items: tuple[tuple[str, str], ...]  # (key, job_id)
    #: per item, the duplicates answered with its job in the producer's process while this
    #: confirmation waited there (counted on the lock if the job still holds it); () for none
    duplicates: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Remember(Op[RememberReply]):
    """An idempotency key's first submission: record ``job_id`` and ``fingerprint`` under
    ``key`` (for ``grace_ms`` until confirmed, then ``ttl_ms``), or answer the recorded ones.
    With ``replaces``, a record still held by that job id is handed to ``job_id`` (confirmed)."""

    key: str
    job_id: str
    fingerprint: str
    ttl_ms: int
    grace_ms: int
    replaces: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Reserve(Op[ReserveReply]):
    """Take a slot of ``scope`` for ``member`` for ``ttl_ms`` if fewer than ``limit`` live
    slots exist (a member that already holds one keeps it, renewed)."""

    scope: str
    member: str
    limit: int
    ttl_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveAll(Op[int]):
    """Take a slot of every scope of ``parts`` (``(scope, limit)`` each) for ``member`` for
    ``ttl_ms``, all in one step or none: the index of the first full scope, or -1 when all
    were taken (a member that already holds a slot of a scope keeps it, renewed)."""

    parts: tuple[tuple[str, int], ...]
    member: str
    ttl_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Consume(Op[bool]):
    """Hand a reservation's slot to the published job: the job holds it for ``ttl_ms``.
    Answers whether the reservation was still held (the slot is the job's either way)."""

    scope: str
    member: str
    job_id: str
    ttl_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unreserve(Op[bool]):
    """Free ``member``'s slot of ``scope``; answers whether it held one."""

    scope: str
    member: str


@dataclasses.dataclass(frozen=True, slots=True)
class ListSlots(Op[list[Slot]]):
    """The live slots of a scope, soonest to expire first."""

    scope: str


@dataclasses.dataclass(frozen=True, slots=True)
class Pace(Op[int]):
    """The next free start of ``scope``'s pace, as milliseconds from now (0: at once), taken
    for one submission: at most ``burst`` start at once, then one every ``interval_ms``
    (GCRA, delaying instead of refusing). The scope keeps one record: when the next
    submission would start if no burst were allowed (its theoretical arrival time)."""

    scope: str
    interval_ms: int
    burst: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class MarkTick(Op["str | None"]):
    """Take scheduled tick ``slot_ms`` of schedule entry ``entry`` for ``job_id``: None when
    the tick is new (later than any the entry sent), else the job id of the entry's latest
    tick (this tick, or a later one, was sent already). The entry keeps one record, its
    latest tick and that tick's job, for ``ttl_ms``."""

    entry: str
    slot_ms: int
    job_id: str
    ttl_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class UnmarkTick(Op[bool]):
    """The publish of ``job_id``'s tick failed: forget the entry's latest tick if it is still
    that job's, so another scheduler's send of the tick goes out. Answers whether it was."""

    entry: str
    job_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ListScopes(Op[list[str]]):
    """The scopes with live slots (for the tools), at most ``limit``."""

    limit: int = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Inspect(Op["LockInfo | None"]):
    key: str


@dataclasses.dataclass(frozen=True, slots=True)
class JobState(Op[JobStatus]):
    """What the record of ``job_id`` under ``key`` says: running under a live lease, queued
    for its retry, finished, or none (no record, or a run whose lease lapsed)."""

    key: str
    job_id: str


#: What starts the key of an idempotency key's record, which lives beside the locks (in a
#: lock-shaped record: Remember) but is no lock: Scan leaves it out.
IDEMPOTENCY_KEY = "idem:"


@dataclasses.dataclass(frozen=True, slots=True)
class Scan(Op[list[LockInfo]]):
    """Every live lock (for the tools), at most ``limit``; idempotency records are left out."""

    limit: int = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One decision in a key's history (``taskdedup explain``): when (the store's clock, ms),
    what (accepted, deduplicated, started, waited, copy_dropped, exhausted, retrying,
    finished, freed, unlocked), the job it concerns, and what else it names."""

    at_ms: int
    what: str
    job_id: str
    detail: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entry: str) -> Event:
        """An entry as the stores write it: ``"<ms> <what> <job> [<detail> ...]"``."""
        at, what, job, *detail = [*entry.split(" "), "", ""]
        return cls(int(at), what, job, tuple(d for d in detail if d))

    def entry(self) -> str:
        return " ".join([str(self.at_ms), self.what, self.job_id, *self.detail])


#: How many decisions a key's history keeps, and for how long after the last one.
HISTORY_SIZE = 20
HISTORY_MS = 86_400_000


@dataclasses.dataclass(frozen=True, slots=True)
class History(Op[list[Event]]):
    """A key's recent decisions, newest first (at most HISTORY_SIZE, kept HISTORY_MS)."""

    key: str


@dataclasses.dataclass(frozen=True, slots=True)
class ForceUnlock(Op[bool]):
    """Remove a key's enqueue and run locks whoever holds them (an operator's tool)."""

    key: str


# ---------------------------------------------------------------- the protocol


class Sent(Protocol[R_co]):
    """An operation written to the store whose reply is read later (:meth:`Store.send`)."""

    @property
    def written(self) -> bool:
        """Whether the operation is on its way (else it runs when the reply is asked for)."""

    def reply(self) -> R_co:
        """The operation's reply (read once); raises StoreUnavailable as ``run`` does."""


class Store(abc.ABC):
    """Executes operations atomically. Subclasses implement both entry points."""

    prefix: str

    @abc.abstractmethod
    def run(self, op: Op[R]) -> R:
        """Execute ``op`` and return its reply; raise StoreUnavailable when unreachable."""

    @abc.abstractmethod
    async def arun(self, op: Op[R]) -> R:
        """The asyncio twin of :meth:`run`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has none."""

    async def aclose(self) -> None:
        self.close()


# ---------------------------------------------------------------- optional capabilities
# An adapter asks a store for these by protocol (``isinstance(store, SendsEarly)``), never by
# its class: a new store offers a faster path by having the methods, with no adapter edited.


@runtime_checkable
class SendsEarly(Protocol):
    """A store that can write an operation now and read its reply later, so its caller
    overlaps the round trip with other work (Celery builds the message meanwhile)."""

    def send(self, op: Op[R]) -> Sent[R] | None:
        """Write ``op`` now; None where it cannot be written this way (then run it)."""


@runtime_checkable
class PushesWithLock(Protocol):
    """A store that can take an enqueue lock and push the job's message onto a broker's list
    in one atomic step, when the broker keeps its queues on the store's own server: lock and
    message then exist together or not at all (no confirmation needed, G11)."""

    url: str | None

    def shares_server(self, connection_kwargs: dict[str, Any]) -> bool:
        """Whether a broker client with these connection settings writes to this server."""

    def acquire_and_push(self, op: Acquire, queue: str, message: str | bytes) -> AcquireReply:
        """Run ``op``; when the lock is ours, push ``message`` onto ``queue`` in the same step."""

    async def aacquire_and_push(
        self, op: Acquire, queue: str, message: str | bytes
    ) -> AcquireReply:
        """The asyncio twin of :meth:`acquire_and_push`."""


@runtime_checkable
class TakesGuards(Protocol):
    """A store whose :class:`Acquire` can also take a :class:`Guard` key, on the server that a
    client with these connection settings writes to (its own standalone server and database)."""

    def takes_guards_on(self, connection_kwargs: dict[str, Any]) -> bool:
        """Whether a guard key of a client with these connection settings can be taken."""


def scope_key(scope: str, kind: str = "res") -> str:
    """The store key of a reservation (``res``), pacing (``pace``) or schedule entry's
    (``tick``) scope (any string; never used raw in a record name)."""
    return f"{kind}:" + hashlib.sha256(scope.encode()).hexdigest()[:32]


def ms(seconds: float) -> int:
    """Seconds to whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))
