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
    MarkTick,
    Op,
    Pace,
    Peek,
    Release,
    Remember,
    RememberReply,
    Reserve,
    ReserveAll,
    ReserveReply,
    Retry,
    Slot,
    UnmarkTick,
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
    "pace",
    "tick",
    "untick",
    "reserve_all",
)
_STATES: dict[str, LockState] = {"q": "queued", "r": "running", "t": "throttled"}


#: How many confirmations one script call carries (a longer call would hold the server).
CONFIRM_CHUNK = 100
#: A script of the history-off variant is named with this suffix (the ``history`` setting).
QUIET = ":quiet"
#: The acquire that also takes a guard key (:class:`~taskdedup.stores.base.Guard`).
GUARDED = "acquire:guard"


def _load_scripts() -> dict[str, str]:
    """Each script with lib.lua prepended, twice: with the key's history written, and (named
    ``<script>:quiet``) without, so turning history off costs a script nothing at run time.
    The acquire also comes with guard.lua before it (``acquire:guard``), and without a guard
    (``GUARD`` is nil)."""
    folder = resources.files(__package__).joinpath("lua")
    lib = folder.joinpath("lib.lua").read_text()
    bodies = {name: folder.joinpath(f"{name}.lua").read_text() for name in SCRIPTS}
    bodies[GUARDED] = folder.joinpath("guard.lua").read_text() + bodies["acquire"]
    bodies["acquire"] = "local GUARD\n" + bodies["acquire"]
    sources = {}
    for name, body in bodies.items():
        sources[name] = "local HISTORY = true\n" + lib + "\n" + body
        sources[name + QUIET] = "local HISTORY = false\n" + lib + "\n" + body
    return sources


SOURCES = _load_scripts()
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SOURCES.items()}


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _opt(value: Any) -> str:
    return "" if value is None else str(value)


class ScriptCall:
    """One script invocation: which script, its keys and arguments, and how to read the reply.
    ``script`` names the operation (metrics, logs); ``variant`` the script source that runs
    (``<script>:quiet`` when the key's history is off)."""

    __slots__ = ("args", "keys", "parse", "script", "variant")

    def __init__(
        self,
        script: str,
        keys: list[str],
        args: list[Any],
        parse: Callable[[Any], Any],
        history: bool = True,
        source: str = "",
    ) -> None:
        self.script, self.keys, self.args, self.parse = script, keys, args, parse
        source = source or script
        self.variant = source if history else source + QUIET


class ScriptCalls:
    """The script call of each operation, for the keys under one prefix."""

    def __init__(self, prefix: str, history: bool = True) -> None:
        self.prefix = prefix
        self.history = history
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
            ReserveAll: self.reserve_all,
            Consume: self.consume,
            Unreserve: self.unreserve,
            ListSlots: self.list_slots,
            ForceUnlock: self.force_unlock,
            Pace: self.pace,
            MarkTick: self.mark_tick,
            UnmarkTick: self.unmark_tick,
        }

    def _call(
        self, script: str, keys: list[str], args: list[Any], parse: Callable[[Any], Any]
    ) -> ScriptCall:
        return ScriptCall(script, keys, args, parse, self.history)

    def names(self, key: str, *parts: str) -> list[str]:
        base = f"{self.prefix}:{{{key}}}:"
        return [base + part for part in parts]

    def acquire(
        self, op: Acquire, queue: str | None = None, message: str | bytes | None = None
    ) -> ScriptCall:
        """The acquire's call; with ``queue``, it also pushes ``message`` there when the lock
        is ours (:meth:`~taskdedup.stores.redis.RedisStore.acquire_and_push`)."""
        keys = self.names(op.key, "lock")
        args: list[Any] = [op.job_id, op.ttl_ms, op.grace_ms, 1 if op.record_duplicate else 0]
        args += [op.task, op.debounce_ms, op.wait_ms, 1 if op.cancel else 0]
        if op.payload is not None:
            args.append(op.payload)
        if queue is not None:
            keys.append(queue)
            args.append(message)
        guard = op.guard
        if guard is None:
            return ScriptCall("acquire", keys, args, parse_acquire, self.history)
        keys.append(guard.key)
        args += [guard.value, "" if guard.ttl_ms is None else guard.ttl_ms, guard.answer]
        return ScriptCall("acquire", keys, args, parse_acquire, self.history, GUARDED)

    def peek(self, op: Peek) -> ScriptCall:
        return self._call(
            "peek", self.names(op.key, "lock"), [1 if op.record_duplicate else 0], parse_peek
        )

    def claim(self, op: Claim) -> ScriptCall:
        return self._call(
            "claim",
            self.names(op.key, "lock", "run", "job:" + op.job_id),
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
                1 if op.latest else 0,
            ],
            parse_claim,
        )

    def retry(self, op: Retry) -> ScriptCall:
        return self._call(
            "retry",
            self.names(op.key, "lock", "run", "job:" + op.job_id),
            [op.job_id, op.ttl_ms, _opt(op.attempt), op.grace_ms, op.delay_ms],
            lambda r: bool(int(r)),
        )

    def finish(self, op: Finish) -> ScriptCall:
        return self._call(
            "finish",
            self.names(op.key, "lock", "run", "job:" + op.job_id),
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
        return self._call(
            "release",
            self.names(op.key, "lock", "run"),
            [op.job_id, "1" if op.queued_only else "0", op.why],
            lambda r: int(r) > 0,
        )

    def inspect(self, op: Inspect) -> ScriptCall:
        return self._call(
            "inspect",
            self.names(op.key, "lock", "run"),
            [],
            lambda r: parse_info(op.key, r),
        )

    def force_unlock(self, op: ForceUnlock) -> ScriptCall:
        return self._call(
            "force_unlock", self.names(op.key, "lock", "run"), [], lambda r: bool(int(r))
        )

    def job_state(self, op: JobState) -> ScriptCall:
        return self._call("job_state", self.names(op.key, "job:" + op.job_id), [], as_text)

    def remember(self, op: Remember) -> ScriptCall:
        return self._call(
            "remember",
            self.names(op.key, "lock"),
            [op.job_id, op.fingerprint, op.ttl_ms, op.grace_ms, op.replaces or ""],
            parse_remember,
        )

    def scope_names(self, scope: str) -> list[str]:
        return self.names(scope_key(scope), "slots", "scope")

    def pace(self, op: Pace) -> ScriptCall:
        return self._call(
            "pace",
            self.names(scope_key(op.scope, "pace"), "pace"),
            [op.interval_ms, op.burst],
            int,
        )

    def mark_tick(self, op: MarkTick) -> ScriptCall:
        return self._call(
            "tick",
            self.names(scope_key(op.entry, "tick"), "tick"),
            [op.slot_ms, op.job_id, op.ttl_ms],
            lambda r: None if r is None else as_text(r),
        )

    def unmark_tick(self, op: UnmarkTick) -> ScriptCall:
        keys = self.names(scope_key(op.entry, "tick"), "tick")
        return self._call("untick", keys, [op.job_id], lambda r: bool(int(r)))

    def reserve(self, op: Reserve) -> ScriptCall:
        return self._call(
            "reserve",
            self.scope_names(op.scope),
            [op.member, op.limit, op.ttl_ms, op.scope],
            lambda r: ReserveReply(bool(int(r[0])), int(r[1])),
        )

    def reserve_all(self, op: ReserveAll) -> ScriptCall:
        keys = [name for scope, _ in op.parts for name in self.scope_names(scope)]
        args = [op.member, op.ttl_ms, *(v for scope, limit in op.parts for v in (limit, scope))]
        return self._call("reserve_all", keys, args, int)

    def consume(self, op: Consume) -> ScriptCall:
        return self._call(
            "consume",
            self.scope_names(op.scope),
            [op.member, op.job_id, op.ttl_ms, op.scope],
            lambda r: bool(int(r)),
        )

    def unreserve(self, op: Unreserve) -> ScriptCall:
        return self._call(
            "unreserve",
            self.scope_names(op.scope),
            [op.member, op.scope],
            lambda r: bool(int(r)),
        )

    def list_slots(self, op: ListSlots) -> ScriptCall:
        return self._call(
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
            return self._call(
                "renew_slot",
                self.scope_names(lease.key),
                [lease.job_id, lease.lease_ms, lease.key],
                lambda r: int(bool(int(r))),
            )
        return self._call(
            "heartbeat",
            self.names(lease.key, "lock", "run", "job:" + lease.job_id),
            [lease.job_id, lease.lease_ms],
            int,
        )

    def confirm_calls(self, op: Confirm, together: bool) -> list[ScriptCall]:
        """One call per CONFIRM_CHUNK jobs (``together``: one server owns every key), else one
        per job (a Cluster: a script's keys must share a slot)."""
        size = CONFIRM_CHUNK if together else 1
        calls = []
        for start in range(0, len(op.items), size):
            chunk = op.items[start : start + size]
            keys = [name for key, job in chunk for name in self.names(key, "lock", "job:" + job)]
            argv: list[Any] = [job for _, job in chunk]
            argv += op.duplicates[start : start + size]  # (none: () as usual)
            calls.append(self._call("confirm", keys, argv, int))
        return calls

    def batch(
        self, op: Op[Any], together: bool = True
    ) -> tuple[list[ScriptCall], Callable[[list[Any]], Any]]:
        """The calls of a batch (sent as one pipeline per server) and how to combine their
        replies; ``together``: every key lives on one server, so a call may span keys."""
        if isinstance(op, Heartbeat):
            return self.heartbeat_calls(op), tuple
        if isinstance(op, Confirm):
            return self.confirm_calls(op, together), sum
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
    text = as_text(r)
    if text[0] == "g":  # the guard's holder answered (its pttl or value)
        return AcquireReply(False, "", 0, 0, guard="held", guard_answer=text[2:])
    state, fence, dups, holder = text.split(" ", 3)
    if state == "s":  # the guard was free, the lock another job's
        return AcquireReply(False, holder, 0, 0, guard="free")
    running = state == "r"
    return AcquireReply(state == "1", holder, int(fence), int(dups), state == "p", running)


def parse_claim(r: Sequence[Any]) -> ClaimReply:
    handoff = None
    if len(r) > 4 and r[4]:
        handoff = Handoff(as_text(r[4]), None if len(r) < 6 or r[5] is None else as_text(r[5]))
    outcome = cast(Any, as_text(r[0]))
    arguments = as_text(r[6]) if len(r) > 6 and r[6] else None
    wait_ms = int(r[7]) if len(r) > 7 and r[7] else 0
    return ClaimReply(
        outcome, int(r[1] or 0), int(r[2] or 0), as_text(r[3] or ""), handoff, arguments, wait_ms
    )


def parse_finish(r: Sequence[Any]) -> FinishReply:
    outcome = as_text(r[0])
    if outcome == "stale":
        return FinishReply(False, None, stale=True)
    handoff = None
    if r[1]:
        handoff = Handoff(as_text(r[1]), None if len(r) < 3 or r[2] is None else as_text(r[2]))
    return FinishReply(outcome == "released", handoff)


def parse_info(key: str, r: Sequence[Any]) -> LockInfo | None:
    job, state, fence, dups, confirmed, pttl, run_job, run_pttl, task, since, worker, tries = r[:12]
    began = r[12] if len(r) > 12 else None
    last = as_text(r[13]) if len(r) > 13 and r[13] else None
    due = int(r[14]) if len(r) > 14 and r[14] else None
    stop = bool(len(r) > 15 and r[15])
    run_holder = as_text(run_job) if run_job else None
    shown = (  # task, since_ms, worker, attempts, started_ms: what the tools show
        as_text(task) if task else None,
        int(since) if since else None,
        as_text(worker) if worker else None,
        int(tries) if tries else 0,
        int(began) if began and worker else None,
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
        last_duplicate=last,
        due_ms=due,
        stop_requested=stop,
    )
