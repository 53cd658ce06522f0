"""How each store operation becomes one call of a Lua script on Redis: the script, its key
names and arguments, and how to read its reply. :class:`~taskdedup.stores.redis.RedisStore`
sends them (one EVALSHA each, or a pipeline of them for a batch).

Every record of one dedup key shares the hash tag ``{key}``, so each script touches one Cluster
slot. The scripts live in ``lua/`` beside this file, each with ``lib.lua`` prepended.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, cast

from .base import (
    Acquire,
    AcquireReply,
    Claim,
    ClaimReply,
    Confirm,
    Consume,
    Finish,
    FinishReply,
    ForceUnlock,
    Handoff,
    Heartbeat,
    Inspect,
    JobState,
    Lease,
    ListSlots,
    LockInfo,
    LockState,
    Op,
    Peek,
    Release,
    Remember,
    RememberReply,
    Reserve,
    ReserveReply,
    Retry,
    Slot,
    Unreserve,
    scope_key,
)

SCRIPTS = (
    "acquire",
    "claim",
    "heartbeat",
    "retry",
    "finish",
    "release",
    "confirm",
    "inspect",
    "job_state",
    "remember",
    "reserve",
    "consume",
    "unreserve",
    "renew_slot",
    "list_slots",
    "peek",
    "force_unlock",
)
_STATES: dict[str, LockState] = {"q": "queued", "r": "running", "t": "throttled"}


def _load_scripts() -> dict[str, str]:
    folder = resources.files(__package__).joinpath("lua")
    lib = folder.joinpath("lib.lua").read_text()
    return {name: lib + "\n" + folder.joinpath(f"{name}.lua").read_text() for name in SCRIPTS}


SOURCES = _load_scripts()
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SOURCES.items()}


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _opt(value: Any) -> str:
    return "" if value is None else str(value)


class ScriptCall:
    """One script invocation: which script, its keys and arguments, and how to read the reply."""

    __slots__ = ("args", "keys", "parse", "script")

    def __init__(
        self, script: str, keys: list[str], args: list[Any], parse: Callable[[Any], Any]
    ) -> None:
        self.script, self.keys, self.args, self.parse = script, keys, args, parse


class ScriptCalls:
    """The script call of each operation, for the keys under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        #: The operations that are one script call each.
        self.single: dict[type[Any], Callable[[Any], ScriptCall]] = {
            Acquire: self.acquire,
            Peek: self.peek,
            Claim: self.claim,
            Retry: self.retry,
            Finish: self.finish,
            Release: self.release,
            Inspect: self.inspect,
            JobState: self.job_state,
            Remember: self.remember,
            Reserve: self.reserve,
            Consume: self.consume,
            Unreserve: self.unreserve,
            ListSlots: self.list_slots,
            ForceUnlock: self.force_unlock,
        }

    def names(self, key: str, *parts: str) -> list[str]:
        base = f"{self.prefix}:{{{key}}}:"
        return [base + part for part in parts]

    def acquire(self, op: Acquire) -> ScriptCall:
        return ScriptCall(
            "acquire",
            self.names(op.key, "lock", "fence"),
            [op.job_id, op.ttl_ms, op.grace_ms, 1 if op.record_duplicate else 0, op.task]
            + ([] if op.payload is None else [op.payload]),
            parse_acquire,
        )

    def peek(self, op: Peek) -> ScriptCall:
        return ScriptCall(
            "peek", self.names(op.key, "lock"), [1 if op.record_duplicate else 0], parse_peek
        )

    def claim(self, op: Claim) -> ScriptCall:
        return ScriptCall(
            "claim",
            self.names(op.key, "lock", "run", "job:" + op.job_id, "fence"),
            [
                op.job_id,
                op.owner,
                op.lease_ms,
                op.ttl_ms,
                op.lock,
                1 if op.run_lock else 0,
                op.memory_ms,
                _opt(op.attempt),
                op.max_attempts or 0,
                op.handoff_job_id or "",
                op.grace_ms,
                op.nonce,
                ",".join(op.lost_claims),
                op.task,
            ],
            parse_claim,
        )

    def retry(self, op: Retry) -> ScriptCall:
        return ScriptCall(
            "retry",
            self.names(op.key, "lock", "run", "job:" + op.job_id),
            [op.job_id, op.ttl_ms, _opt(op.attempt), op.grace_ms, op.delay_ms],
            lambda r: bool(int(r)),
        )

    def finish(self, op: Finish) -> ScriptCall:
        return ScriptCall(
            "finish",
            self.names(op.key, "lock", "run", "job:" + op.job_id, "fence"),
            [
                op.job_id,
                1 if op.throttle else 0,
                op.memory_ms,
                op.handoff_job_id or "",
                _opt(op.attempt),
                op.grace_ms,
                op.ttl_ms,
            ],
            parse_finish,
        )

    def release(self, op: Release) -> ScriptCall:
        return ScriptCall(
            "release",
            self.names(op.key, "lock", "run", "fence"),
            [op.job_id, "1" if op.queued_only else "0", op.why],
            lambda r: int(r) > 0,
        )

    def inspect(self, op: Inspect) -> ScriptCall:
        return ScriptCall(
            "inspect",
            self.names(op.key, "lock", "run"),
            [],
            lambda r: parse_info(op.key, r),
        )

    def force_unlock(self, op: ForceUnlock) -> ScriptCall:
        return ScriptCall(
            "force_unlock", self.names(op.key, "lock", "run"), [], lambda r: bool(int(r))
        )

    def job_state(self, op: JobState) -> ScriptCall:
        return ScriptCall("job_state", self.names(op.key, "job:" + op.job_id), [], as_text)

    def remember(self, op: Remember) -> ScriptCall:
        return ScriptCall(
            "remember",
            self.names(op.key, "lock"),
            [op.job_id, op.fingerprint, op.ttl_ms, op.grace_ms, op.replaces or ""],
            parse_remember,
        )

    def scope_names(self, scope: str) -> list[str]:
        return self.names(scope_key(scope), "slots", "scope")

    def reserve(self, op: Reserve) -> ScriptCall:
        return ScriptCall(
            "reserve",
            self.scope_names(op.scope),
            [op.member, op.limit, op.ttl_ms, op.scope],
            lambda r: ReserveReply(bool(int(r[0])), int(r[1])),
        )

    def consume(self, op: Consume) -> ScriptCall:
        return ScriptCall(
            "consume",
            self.scope_names(op.scope),
            [op.member, op.job_id, op.ttl_ms, op.scope],
            lambda r: bool(int(r)),
        )

    def unreserve(self, op: Unreserve) -> ScriptCall:
        return ScriptCall(
            "unreserve",
            self.scope_names(op.scope),
            [op.member, op.scope],
            lambda r: bool(int(r)),
        )

    def list_slots(self, op: ListSlots) -> ScriptCall:
        return ScriptCall(
            "list_slots",
            self.scope_names(op.scope)[:1],
            [],
            lambda r: [Slot(as_text(r[i]), int(r[i + 1])) for i in range(0, len(r), 2)],
        )

    # -- batches

    def heartbeat_calls(self, op: Heartbeat) -> list[ScriptCall]:
        return [self.lease_call(lease) for lease in op.leases]

    def lease_call(self, lease: Lease) -> ScriptCall:
        if lease.slot:
            return ScriptCall(
                "renew_slot",
                self.scope_names(lease.key),
                [lease.job_id, lease.lease_ms, lease.key],
                lambda r: bool(int(r)),
            )
        return ScriptCall(
            "heartbeat",
            self.names(lease.key, "lock", "run", "job:" + lease.job_id),
            [lease.job_id, lease.lease_ms],
            lambda r: bool(int(r)),
        )

    def confirm_calls(self, op: Confirm) -> list[ScriptCall]:
        return [
            ScriptCall("confirm", self.names(key, "lock", "job:" + job_id), [job_id], int)
            for key, job_id in op.items
        ]

    def batch(self, op: Op[Any]) -> tuple[list[ScriptCall], Callable[[list[Any]], Any]]:
        if isinstance(op, Heartbeat):
            return self.heartbeat_calls(op), tuple
        if isinstance(op, Confirm):
            return self.confirm_calls(op), sum
        raise TypeError(f"no Redis script batch for {type(op).__name__}")


def parse_remember(r: Any) -> RememberReply:
    state, fingerprint, job = as_text(r).split(" ", 2)
    return RememberReply(state == "1", job, fingerprint, pending=state == "p")


def parse_peek(r: Any) -> AcquireReply | None:
    if r is None:
        return None
    state, fence, dups, holder = as_text(r).split(" ", 3)
    return AcquireReply(False, holder, int(fence), int(dups), pending=state == "p")


def parse_acquire(r: Any) -> AcquireReply:
    state, fence, dups, holder = as_text(r).split(" ", 3)
    return AcquireReply(state == "1", holder, int(fence), int(dups), pending=state == "p")


def parse_claim(r: Sequence[Any]) -> ClaimReply:
    handoff = None
    if len(r) > 4 and r[4]:
        handoff = Handoff(as_text(r[4]), None if len(r) < 6 or r[5] is None else as_text(r[5]))
    outcome = cast(Any, as_text(r[0]))
    return ClaimReply(outcome, int(r[1] or 0), int(r[2] or 0), as_text(r[3] or ""), handoff)


def parse_finish(r: Sequence[Any]) -> FinishReply:
    outcome = as_text(r[0])
    if outcome == "stale":
        return FinishReply(False, None, stale=True)
    handoff = None
    if r[1]:
        handoff = Handoff(as_text(r[1]), None if len(r) < 3 or r[2] is None else as_text(r[2]))
    return FinishReply(outcome == "released", handoff)


def parse_info(key: str, r: Sequence[Any]) -> LockInfo | None:
    job, state, fence, dups, confirmed, pttl, run_job, run_pttl, task, since, worker, tries = r
    run_holder = as_text(run_job) if run_job else None
    shown = (  # task, since_ms, worker, attempts: what the tools show
        as_text(task) if task else None,
        int(since) if since else None,
        as_text(worker) if worker else None,
        int(tries) if tries else 0,
    )
    if not job:
        if run_holder is None:
            return None
        return LockInfo(key, run_holder, "running", 0, 0, int(run_pttl), True, run_holder, *shown)
    return LockInfo(
        key,
        as_text(job),
        _STATES[as_text(state)],
        int(fence),
        int(dups),
        int(pttl),
        as_text(confirmed) == "1",
        run_holder,
        *shown,
    )
