"""The reservation guard: at most N jobs in flight per scope (a user, a tenant).

A slot is reserved atomically before dispatch, so concurrent requests can never overshoot the
cap: the store counts live reservations and the slots of jobs in flight, and refuses the one
over the limit with ``QuotaExceeded``. A slot lives ``ttl`` without news: a client that dies
after reserving loses it after the ttl; a job's slot is renewed to one lease when it starts
and by every heartbeat, and freed when it ends, so a worker that dies frees it after the lease.

Standalone::

    guard = ReservationGuard(store)
    with guard.reserve("user-42", max_concurrent=5, ttl=300) as reservation:
        job_id = dispatch(...)
        reservation.consume(job_id)      # the job now holds the slot
    # leaving the block with an exception (or without consuming) frees the slot

The Celery and taskiq adapters reserve under the job's own id, so no consume step is needed.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

from . import keys as _keys
from .errors import ConfigError, KeyEncodingError, QuotaExceeded, StoreUnavailable
from .flow import Flow, adrive, drive
from .policy import Seconds, seconds
from .settings import Settings
from .stores.base import (
    Consume,
    Heartbeat,
    Lease,
    ListScopes,
    ListSlots,
    Reserve,
    ReserveAll,
    ReserveReply,
    Slot,
    Store,
    Unreserve,
    ms,
)

DEFAULT_TTL = 300.0
log = logging.getLogger("taskdedup")


def _ms(value: Seconds, name: str) -> int:
    return ms(cast(float, seconds(value, name=name)))


@dataclasses.dataclass(frozen=True)
class ReservePolicy:
    """A task's cap: ``max_concurrent`` jobs in flight per scope.

    scope: the name of the task argument whose value names the scope (the scope is then
        ``"<name>=<value>"``, shared by every task that caps the same argument), a callable
        that gets the task's arguments by name (defaults applied) and returns the scope, or
        None (the default): the task as a whole (the scope is the task's name).
    ttl: seconds a slot lives without news: from reservation until the job starts.
    """

    max_concurrent: int
    scope: str | Callable[..., Any] | None = None
    ttl: Seconds = DEFAULT_TTL

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_concurrent, bool)
            or not isinstance(self.max_concurrent, int)
            or self.max_concurrent < 1
        ):
            raise ConfigError(f"max_concurrent must be an int >= 1, not {self.max_concurrent!r}")
        if not (
            self.scope is None
            or callable(self.scope)
            or (isinstance(self.scope, str) and self.scope)
        ):
            raise ConfigError(f"scope must be an argument name or a callable, not {self.scope!r}")
        object.__setattr__(self, "ttl", seconds(self.ttl, name="ttl"))

    @property
    def ttl_seconds(self) -> float:
        return cast(float, self.ttl)

    @classmethod
    def from_options(
        cls, options: ReservePolicy | Mapping[str, Any] | list[Any] | tuple[Any, ...]
    ) -> ReservePolicy:
        """One cap from its options; several (a list: stacked caps) as one :class:`CapStack`."""
        if isinstance(options, ReservePolicy):
            return options
        if isinstance(options, list | tuple):
            return CapStack.of([cls.from_options(one) for one in options])
        if not isinstance(options, Mapping):
            raise ConfigError(f"reserve takes a dict of options or a list of them, not {options!r}")
        unknown = set(options) - {"max_concurrent", "scope", "ttl"}
        if unknown:
            raise ConfigError(
                f"unknown reserve option(s) {', '.join(sorted(unknown))}; "
                "use max_concurrent, scope, ttl"
            )
        return cls(**options)

    def check(self, task: str, fn: Callable[..., Any] | None) -> None:
        """An argument name the task does not take is a ConfigError now, not at enqueue."""
        check_scope(self.scope, fn, "", "name one, or pass a callable")

    def scope_for(
        self,
        task: str,
        fn: Callable[..., Any] | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> str:
        """The scope of one call."""
        if self.scope is None:
            return task
        return scope_of(task, "reserve", self.scope, fn, args, kwargs)


#: A stacked scope: each cap's ``<limit>\x1f<scope>``, joined by ``\x1e`` (what a job's
#: message carries, so that whoever frees or renews its slots knows them all).
_LIMIT, _JOIN = "\x1f", "\x1e"


def stacked_scope(parts: Sequence[tuple[str, int]]) -> str:
    """One scope string for a job that holds a slot of each ``(scope, limit)``."""
    return _JOIN.join(f"{limit}{_LIMIT}{scope}" for scope, limit in parts)


def parts_of(scope: str) -> list[tuple[str, int]] | None:
    """The ``(scope, limit)`` parts of a stacked scope; None for a scope of one cap."""
    if _LIMIT not in scope:
        return None
    return [(name, int(limit)) for limit, name in (p.split(_LIMIT, 1) for p in scope.split(_JOIN))]


@dataclasses.dataclass(frozen=True)
class CapStack(ReservePolicy):
    """Several caps of one task (a global cap and a per-tenant one, say): a job takes a slot
    of every scope in one atomic step or none, and a refusal names the scope that was full.
    ``max_concurrent``, ``scope`` and ``ttl`` are the first cap's, ``caps`` all of them."""

    caps: tuple[ReservePolicy, ...] = ()

    @classmethod
    def of(cls, caps: Sequence[ReservePolicy]) -> ReservePolicy:
        if not caps:
            raise ConfigError("reserve: an empty list of caps; give one or more")
        if len(caps) == 1:
            return caps[0]
        first = caps[0]
        ttl = max(cap.ttl_seconds for cap in caps)
        return cls(first.max_concurrent, first.scope, ttl, tuple(caps))

    def check(self, task: str, fn: Callable[..., Any] | None) -> None:
        seen: list[object] = []
        for cap in self.caps:
            cap.check(task, fn)
            if cap.scope in seen:
                raise ConfigError(
                    f"two caps of scope {cap.scope!r}: each cap must name its own scope "
                    "(merge them into one, with the lower max_concurrent)"
                )
            seen.append(cap.scope)

    def scope_for(
        self,
        task: str,
        fn: Callable[..., Any] | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> str:
        parts = [(cap.scope_for(task, fn, args, kwargs), cap.max_concurrent) for cap in self.caps]
        return stacked_scope(parts)


def check_scope(scope: object, fn: Callable[..., Any] | None, says: str, hint: str) -> None:
    """A scope named by an argument the task's function does not take is a ConfigError
    (``says`` starts its message, ``hint`` ends it): found at definition, not at enqueue."""
    if isinstance(scope, str) and fn is not None:
        params = _keys.signature_parameters(fn)
        if scope not in params:
            raise ConfigError(
                f"{says}scope={scope!r} is not one of its parameters "
                f"({', '.join(params) or 'none'}); {hint}"
            )


def scope_of(
    task: str,
    option: str,
    scope: str | Callable[..., Any],
    fn: Callable[..., Any] | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """The scope one call names (``@reserve``'s and ``@pace``'s ``scope``): ``"<argument>=
    <value>"`` for an argument's name (shared by every task that names the same argument), or
    what a callable of the arguments (by name, defaults applied) returns."""
    bound = dict(kwargs) if fn is None else _keys.bind_arguments(task, fn, args, kwargs)
    if callable(scope):
        try:
            named = scope(**bound) if fn is not None else scope(*args, **kwargs)
        except Exception as exc:
            raise KeyEncodingError(task, "scope", f"callable failed: {exc!r}") from exc
        return str(named)
    if scope not in bound:
        raise ConfigError(f"task {task!r}: pass {scope!r} by name ({option} scope)")
    return f"{scope}={bound[scope]}"


def _new_member() -> str:
    return "r-" + uuid.uuid4().hex


def slot_leases(lease: Lease) -> tuple[Lease, ...]:
    """What renewing ``lease`` renews: a stacked scope's slot in each of its scopes."""
    parts = parts_of(lease.key) if lease.slot else None
    if parts is None:
        return (lease,)
    return tuple(dataclasses.replace(lease, key=name) for name, _ in parts)


Fold = Callable[[tuple[int, ...] | None], tuple[int, ...] | None]


def renew_each(batch: tuple[Lease, ...]) -> tuple[tuple[Lease, ...], Fold]:
    """A heartbeat batch with each stacked slot lease spread over its scopes, and what folds
    the store's answers back into one per lease of ``batch`` (held only if every slot is)."""
    spread = [slot_leases(lease) for lease in batch]
    if all(len(leases) == 1 for leases in spread):
        return batch, lambda reply: reply

    def fold(reply: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if reply is None:
            return None
        answers, at = [], 0
        for leases in spread:
            answers.append(min(reply[at : at + len(leases)]))
            at += len(leases)
        return tuple(answers)

    return tuple(lease for leases in spread for lease in leases), fold


def _without_slot(held: Lease) -> Lease:
    log.warning(
        "taskdedup: job %s starts without a slot of scope %s (its reservation lapsed while it "
        "was queued): the scope may run over its cap; raise the reservation ttl",
        held.job_id,
        held.key,
    )
    return held


class Reservation:
    """One reserved slot; a context manager (``with`` and ``async with``)."""

    def __init__(
        self, guard: ReservationGuard, scope: str, member: str, ttl_ms: int, held: bool = True
    ) -> None:
        self.guard = guard
        self.scope = scope
        self.member = member
        self.ttl_ms = ttl_ms
        #: False when no slot was taken: the guard is off (``enabled=False``), or ``dry_run``
        #: let a call over the cap through; consuming and releasing it then touch no store
        self.held = held
        self.job_id: str | None = None  # the job holding the slot, once consumed
        self.released = False

    def consume(self, job_id: str) -> None:
        """The job was dispatched: it holds the slot now (until it ends, or its ttl)."""
        if self.held:
            self.guard.store.run(Consume(self.scope, self.member, job_id, self.ttl_ms))
        self.job_id = job_id

    async def aconsume(self, job_id: str) -> None:
        if self.held:
            await self.guard.store.arun(Consume(self.scope, self.member, job_id, self.ttl_ms))
        self.job_id = job_id

    def release(self) -> None:
        """Give the slot back (nothing was dispatched, or the job ended)."""
        if self.held:
            self.guard.release(self.scope, self.job_id or self.member)
        self.released = True

    async def arelease(self) -> None:
        if self.held:
            await self.guard.arelease(self.scope, self.job_id or self.member)
        self.released = True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.job_id is None and not self.released:
            self.release()

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.job_id is None and not self.released:
            await self.arelease()


class ReservationGuard:
    """Reserves, releases and lists slots of scopes in one store.

    ``enabled=False`` (the kill switch, G16): every call is let through and no store command is
    sent. ``dry_run=True``: slots are counted as usual, but a call over the cap is logged
    (``reserve would_refuse`` / ``would_wait``) and let through without a slot instead of
    refused. The adapters pass their settings' values.
    """

    def __init__(self, store: Store, *, enabled: bool = True, dry_run: bool = False) -> None:
        self.store = store
        self.enabled = enabled
        self.dry_run = dry_run

    @classmethod
    def under(cls, store: Store, settings: Settings) -> ReservationGuard:
        """The guard an adapter uses: ``settings``' kill switch and dry run."""
        return cls(store, enabled=settings.enabled, dry_run=settings.dry_run)

    def _over_cap(self, op: Reserve, what: str) -> Reservation:
        """A call over the cap: QuotaExceeded, or (dry run) logged and let through slotless."""
        if not self.dry_run:
            raise QuotaExceeded(op.scope, op.limit)
        log.info(
            "taskdedup: reserve %s: scope %s is full (%d in flight); dry run, so it goes on "
            "without a slot",
            what,
            op.scope,
            op.limit,
        )
        return Reservation(self, op.scope, op.member, op.ttl_ms, held=False)

    def _reserve_op(
        self, scope: str, max_concurrent: int, ttl: Seconds, member: str | None
    ) -> Reserve:
        if (
            isinstance(max_concurrent, bool)
            or not isinstance(max_concurrent, int)
            or max_concurrent < 1
        ):
            raise ConfigError(f"max_concurrent must be an int >= 1, not {max_concurrent!r}")
        return Reserve(scope, member or _new_member(), max_concurrent, _ms(ttl, "ttl"))

    def reserve(
        self,
        scope: str,
        max_concurrent: int,
        ttl: Seconds = DEFAULT_TTL,
        *,
        member: str | None = None,
    ) -> Reservation:
        """A slot of ``scope``, or QuotaExceeded when ``max_concurrent`` are in flight.
        ``member``: hold the slot under this id (a job id) instead of a fresh reservation id."""
        return drive(self.reserve_flow(scope, max_concurrent, ttl, member), self.store)

    async def areserve(
        self,
        scope: str,
        max_concurrent: int,
        ttl: Seconds = DEFAULT_TTL,
        *,
        member: str | None = None,
    ) -> Reservation:
        return await adrive(self.reserve_flow(scope, max_concurrent, ttl, member), self.store)

    def reserve_flow(
        self, scope: str, max_concurrent: int, ttl: Seconds, member: str | None = None
    ) -> Flow[Reservation]:
        """:meth:`reserve` as a flow. A stacked scope (:class:`CapStack`) takes a slot of each
        of its scopes, all or none (its parts name their limits; ``max_concurrent`` is not
        read)."""
        parts = parts_of(scope)
        if parts is not None:
            return self._reserve_all(scope, parts, _ms(ttl, "ttl"), member or _new_member())
        return self._reserve(self._reserve_op(scope, max_concurrent, ttl, member))

    def _reserve_all(
        self, scope: str, parts: list[tuple[str, int]], ttl_ms: int, member: str
    ) -> Flow[Reservation]:
        if not self.enabled:
            return Reservation(self, scope, member, ttl_ms, held=False)
        if getattr(self.store, "scopes_together", True):
            full: int = yield ReserveAll(tuple(parts), member, ttl_ms)
        else:
            full = yield from self._one_by_one(parts, member, ttl_ms)
        if full >= 0:
            name, limit = parts[full]
            self._over_cap(Reserve(name, member, limit, ttl_ms), "would_refuse")
            return Reservation(self, scope, member, ttl_ms, held=False)  # (a dry run)
        return Reservation(self, scope, member, ttl_ms)

    def _one_by_one(self, parts: list[tuple[str, int]], member: str, ttl_ms: int) -> Flow[int]:
        """Stacked caps where one script cannot reach every scope: each slot in turn, and
        those taken given back when one is full (never over a cap; a call refused meanwhile
        may have seen a slot that was about to be given back)."""
        for index, (name, limit) in enumerate(parts):
            reply: ReserveReply = yield Reserve(name, member, limit, ttl_ms)
            if not reply.granted:
                for taken, _ in parts[:index]:
                    yield Unreserve(taken, member)
                return index
        return -1

    def _reserve(self, op: Reserve) -> Flow[Reservation]:
        if not self.enabled:
            return Reservation(self, op.scope, op.member, op.ttl_ms, held=False)
        reply: ReserveReply = yield op
        if not reply.granted:
            return self._over_cap(op, "would_refuse")
        return Reservation(self, op.scope, op.member, op.ttl_ms)

    def release(self, scope: str, member: str) -> bool:
        """Free ``member``'s slot (a reservation id or a job id); False if it held none."""
        return drive(self.release_flow(scope, member), self.store)

    async def arelease(self, scope: str, member: str) -> bool:
        return await adrive(self.release_flow(scope, member), self.store)

    def release_flow(self, scope: str, member: str) -> Flow[bool]:
        if not self.enabled:
            return False
        released = False
        for name, _ in parts_of(scope) or [(scope, 0)]:
            released = bool((yield Unreserve(name, member))) or released
        return released

    def give_back(self, scope: str, job_id: str) -> None:
        """Free a job's slot as it ends; a store that cannot answer lets it lapse after its
        lease (logged), so an ending job never fails for it."""
        drive(self.give_back_flow(scope, job_id), self.store)

    async def agive_back(self, scope: str, job_id: str) -> None:
        await adrive(self.give_back_flow(scope, job_id), self.store)

    def give_back_flow(self, scope: str, job_id: str) -> Flow[None]:
        try:
            yield from self.release_flow(scope, job_id)
        except StoreUnavailable as exc:
            log.warning("taskdedup: could not free the slot of %s: %s", job_id, exc)

    def start(
        self, scope: str, job_id: str, lease: Seconds, max_concurrent: int | None = None
    ) -> Lease | None:
        """The job starts: its slot now lives one lease (renew the returned Lease by heartbeat).

        A job without a live slot (its reservation lapsed in the queue, or it is a run owed by
        reschedule_once that was sent while the scope was full) takes one now if fewer than
        ``max_concurrent`` are in flight, else QuotaExceeded: the worker sends it again later
        rather than run it over the cap. Without ``max_concurrent`` it starts anyway. None: no
        slot to renew (the guard is off, or a dry run let the job start over the cap).
        """
        return drive(self.start_flow(scope, job_id, lease, max_concurrent), self.store)

    async def astart(
        self, scope: str, job_id: str, lease: Seconds, max_concurrent: int | None = None
    ) -> Lease | None:
        return await adrive(self.start_flow(scope, job_id, lease, max_concurrent), self.store)

    def start_flow(
        self, scope: str, job_id: str, lease: Seconds, max_concurrent: int | None
    ) -> Flow[Lease | None]:
        if not self.enabled:
            return None
        held = Lease(scope, job_id, _ms(lease, "lease"), slot=True)
        renewed: tuple[int, ...] = yield Heartbeat(slot_leases(held))
        if all(renewed):
            return held
        if max_concurrent is None:
            return _without_slot(held)
        taken = yield from self.reserve_flow(scope, max_concurrent, lease, job_id)  # or Quota...
        return held if taken.held else None

    def active(self, scope: str) -> list[Slot]:
        """The live reservations and job slots of a scope, soonest to expire first."""
        return self.store.run(ListSlots(scope))

    async def aactive(self, scope: str) -> list[Slot]:
        return await self.store.arun(ListSlots(scope))

    def scopes(self, limit: int = 1000) -> list[str]:
        """The scopes that have live slots."""
        return self.store.run(ListScopes(limit))
