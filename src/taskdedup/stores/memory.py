"""MemoryStore: the store protocol in one process, for tests and single-process apps.

It mirrors the Redis scripts record for record (the contract suite runs on both), keeps every
record with an expiry, and takes an injectable clock so tests can move time by hand. One lock
guards all records; no operation awaits while holding it, so it is safe from threads and from
asyncio alike.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
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
    JobStatus,
    Lease,
    ListScopes,
    ListSlots,
    LockInfo,
    LockState,
    Op,
    Peek,
    R,
    Release,
    Remember,
    RememberReply,
    Reserve,
    ReserveReply,
    Retry,
    Scan,
    Slot,
    Store,
    Unreserve,
    scope_key,
)

Clock = Callable[[], float]  # seconds
_STATES: dict[str, LockState] = {"q": "queued", "r": "running", "t": "throttled"}
FENCE_KEEP_MS = 86_400_000


class MemoryStore(Store):
    """An in-process store; ``key_prefix`` starts every record's name (``prefix=`` is its
    deprecated spelling), ``clock`` returns seconds (default: ``time.time``)."""

    def __init__(
        self,
        key_prefix: str = "taskdedup",
        clock: Clock | None = None,
        *,
        prefix: str | None = None,
    ) -> None:
        if prefix is not None:
            warnings.warn(
                "MemoryStore(prefix=...) is deprecated: use key_prefix=, as in the key_prefix "
                "setting",
                DeprecationWarning,
                stacklevel=2,
            )
            key_prefix = prefix
        self.prefix = key_prefix
        self.clock = clock or time.time
        self._records: dict[str, tuple[dict[str, Any], int]] = {}  # name -> (fields, expires ms)
        self._mutex = threading.Lock()
        self._handlers: dict[type[Any], Callable[[Any, int], Any]] = {
            Acquire: self._acquire,
            Peek: self._peek,
            Claim: self._claim,
            Heartbeat: self._heartbeat,
            Retry: self._retry,
            Finish: self._finish,
            Release: self._release,
            Confirm: self._confirm,
            Inspect: self._inspect,
            JobState: self._job_state,
            Scan: self._scan,
            ForceUnlock: self._force_unlock,
            Remember: self._remember,
            Reserve: self._reserve,
            Consume: self._consume,
            Unreserve: self._unreserve,
            ListSlots: self._list_slots,
            ListScopes: self._list_scopes,
        }

    # -- the protocol

    def run(self, op: Op[R]) -> R:
        handler = self._handlers[type(op)]
        with self._mutex:
            return cast(R, handler(op, self._now()))

    async def arun(self, op: Op[R]) -> R:
        return self.run(op)

    # -- records (all callers hold the mutex)

    def _now(self) -> int:
        return int(self.clock() * 1000)

    def _name(self, key: str, part: str) -> str:
        return f"{self.prefix}:{{{key}}}:{part}"

    def _get(self, name: str, now: int) -> dict[str, Any] | None:
        entry = self._records.get(name)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._records[name]
            return None
        return entry[0]

    def _put(self, name: str, fields: dict[str, Any], expires: int) -> None:
        self._records[name] = (fields, expires)

    def _expire(self, name: str, at: int) -> None:
        entry = self._records.get(name)
        if entry is not None:
            self._records[name] = (entry[0], at)

    def _delete(self, name: str) -> None:
        self._records.pop(name, None)

    def ttl_ms(self, name: str) -> int | None:
        """Remaining life of a raw record (tests use it to check G9); None if absent."""
        with self._mutex:
            now = self._now()
            return None if self._get(name, now) is None else self._records[name][1] - now

    def names(self) -> list[str]:
        """Names of all live records."""
        with self._mutex:
            now = self._now()
            return [n for n in list(self._records) if self._get(n, now) is not None]

    def _next_fence(self, key: str, ttl_ms: int, now: int) -> int:
        name = self._name(key, "fence")
        rec = self._get(name, now)
        fence = rec["v"] + 1 if rec else int(self.clock() * 1_000_000)
        self._put(name, {"v": fence}, now + ttl_ms + FENCE_KEEP_MS)
        return fence

    def _handoff(
        self, key: str, lock: dict[str, Any], job: str, ttl: int, grace: int, now: int
    ) -> Handoff:
        payload = lock.get("p")
        fence = self._next_fence(key, ttl, now)
        self._put(
            self._name(key, "lock"),
            {"j": job, "s": "q", "f": fence, "d": 0, "e": now + ttl, "c": int(grace >= ttl)},
            now + grace,
        )
        return Handoff(job, payload)

    # -- operations

    def _acquire(self, op: Acquire, now: int) -> AcquireReply:
        name = self._name(op.key, "lock")
        lock = self._get(name, now)
        if lock is not None and lock["j"] == op.job_id:  # the holder again: no change
            return AcquireReply(True, op.job_id, lock["f"], lock["d"])
        if lock is not None:
            if op.record_duplicate:
                lock["d"] += 1
                if op.payload is not None:
                    lock["p"] = op.payload
            return AcquireReply(
                False, lock["j"], lock["f"], lock["d"], pending=lock["s"] == "q" and lock["c"] == 0
            )
        fence = self._next_fence(op.key, op.ttl_ms, now)
        confirmed = 1 if op.grace_ms >= op.ttl_ms else 0
        self._put(
            name,
            {"j": op.job_id, "s": "q", "f": fence, "d": 0, "e": now + op.ttl_ms, "c": confirmed},
            now + min(op.grace_ms, op.ttl_ms),
        )
        return AcquireReply(True, op.job_id, fence, 0)

    def _peek(self, op: Peek, now: int) -> AcquireReply | None:
        lock = self._get(self._name(op.key, "lock"), now)
        if lock is None:
            return None
        if lock["s"] == "q" and lock["c"] == 0:
            return AcquireReply(False, lock["j"], lock["f"], lock["d"], pending=True)
        if op.record_duplicate:
            lock["d"] += 1
        return AcquireReply(False, lock["j"], lock["f"], lock["d"])

    def _claim(self, op: Claim, now: int) -> ClaimReply:
        job_name = self._name(op.key, "job:" + op.job_id)
        rec = self._get(job_name, now)
        attempts = 1
        if rec is not None:
            if rec["s"] == "d":  # a finished job holds nothing: free what a late re-send took
                self._release_locks(op.key, op.job_id, now)
                return ClaimReply("done", rec["f"], rec["a"], rec["o"])
            attempts = rec["a"] + 1
            # a copy of an attempt that asked for a retry, and that retry went out (or may
            # still): it is the job's next run; this copy waits (dropped once the job is
            # done). A retry never confirmed within the grace never went out: this one runs.
            retried = (
                rec["s"] == "q" and rec["n"] is not None and (rec.get("c", 1) or rec["u"] > now)
            )
            if retried and op.attempt is not None and op.attempt <= rec["n"]:
                return ClaimReply("running", rec["f"], rec["a"], rec["o"])
            if rec["s"] == "r":
                newer = op.attempt is not None and rec["n"] is not None and op.attempt > rec["n"]
                lost = bool(rec.get("k")) and rec.get("k") in op.lost_claims
                if lost:  # that claim's run never started: it was no attempt
                    attempts -= 1
                if rec["u"] > now and not newer and not lost:
                    return ClaimReply("running", rec["f"], rec["a"], rec["o"])
                if not newer and op.max_attempts and attempts > op.max_attempts:
                    rec["s"] = "d"
                    self._expire(job_name, now + op.memory_ms)
                    self._release_locks(op.key, op.job_id, now)
                    return ClaimReply("exhausted", rec["f"], rec["a"], rec["o"])
        run_name = self._name(op.key, "run")
        if op.run_lock:
            running = self._get(run_name, now)
            if running is not None and running["j"] != op.job_id:
                return ClaimReply("busy", 0, attempts - 1, running["j"])
        lock_name = self._name(op.key, "lock")
        lock = self._get(lock_name, now)
        fence: int | None = None
        handoff: Handoff | None = None
        if op.lock == "hold" and lock is not None and lock["j"] != op.job_id:
            # another job's key: this copy is stale or was sent without a lock (G12)
            if lock["s"] == "r":  # that job runs: wait for it to end
                return ClaimReply("busy", 0, attempts - 1, lock["j"])
            if lock["s"] == "q":  # it waits in the queue: run first; it will wait for us
                fence = self._next_fence(op.key, op.ttl_ms, now)
                lock.update(j=op.job_id, s="r", f=fence, c=1)
                self._expire(lock_name, now + op.lease_ms)
        if lock is not None and lock["j"] == op.job_id and fence is None:
            fence = lock["f"]
            if op.lock == "hold":
                lock["s"], lock["c"] = "r", 1  # it was published: it runs
                self._expire(lock_name, now + op.lease_ms)
            elif op.lock == "release":
                if lock["d"] > 0 and op.handoff_job_id:
                    handoff = self._handoff(
                        op.key, lock, op.handoff_job_id, op.ttl_ms, op.grace_ms, now
                    )
                else:
                    self._delete(lock_name)
        elif lock is None and op.lock == "hold":
            fence = self._next_fence(op.key, op.ttl_ms, now)
            self._put(
                lock_name,
                {"j": op.job_id, "s": "r", "f": fence, "d": 0, "e": now + op.ttl_ms, "c": 1},
                now + op.lease_ms,
            )
        if fence is None or op.run_lock:  # a run lock's token orders the runs (G3)
            fence = self._next_fence(op.key, op.ttl_ms, now)
        if op.run_lock:
            self._put(run_name, {"j": op.job_id, "o": op.owner}, now + op.lease_ms)
        self._put(
            job_name,
            {
                "s": "r",
                "o": op.owner,
                "u": now + op.lease_ms,
                "a": attempts,
                "n": op.attempt,
                "f": fence,
                "m": op.memory_ms,
                "k": op.nonce,
            },
            now + op.lease_ms + op.memory_ms,
        )
        return ClaimReply("run", fence, attempts, op.owner, handoff)

    def _heartbeat(self, op: Heartbeat, now: int) -> tuple[bool, ...]:
        answers = []
        for lease in op.leases:
            if lease.slot:
                answers.append(self._renew_slot(lease, now))
                continue
            alive = False
            job_name = self._name(lease.key, "job:" + lease.job_id)
            rec = self._get(job_name, now)
            if rec is not None and rec["s"] == "r":
                rec["u"] = now + lease.lease_ms
                self._expire(job_name, now + lease.lease_ms + rec["m"])
                alive = True
            lock_name = self._name(lease.key, "lock")
            lock = self._get(lock_name, now)
            if lock is not None and lock["j"] == lease.job_id and lock["s"] == "r":
                self._expire(lock_name, now + lease.lease_ms)
                alive = True
            run_name = self._name(lease.key, "run")
            running = self._get(run_name, now)
            if running is not None and running["j"] == lease.job_id:
                self._expire(run_name, now + lease.lease_ms)
                alive = True
            answers.append(alive)
        return tuple(answers)

    def _stale(self, rec: dict[str, Any] | None, attempt: int | None) -> bool:
        return (
            rec is not None and attempt is not None and rec["n"] is not None and attempt < rec["n"]
        )

    def _retry(self, op: Retry, now: int) -> bool:
        job_name = self._name(op.key, "job:" + op.job_id)
        rec = self._get(job_name, now)
        if self._stale(rec, op.attempt):
            return False
        grace = min(op.grace_ms, op.ttl_ms)
        if rec is not None:  # it waits for the retry's publish to be confirmed (G11)
            rec.update(s="q", c=0, u=now + grace)
            self._expire(job_name, now + op.ttl_ms)
        run_name = self._name(op.key, "run")
        running = self._get(run_name, now)
        if running is not None and running["j"] == op.job_id:
            self._delete(run_name)
        lock_name = self._name(op.key, "lock")
        lock = self._get(lock_name, now)
        if lock is None or lock["j"] != op.job_id:
            return False
        lock.update(s="q", e=now + op.ttl_ms, c=0)
        self._expire(lock_name, now + grace)
        return True

    def _finish(self, op: Finish, now: int) -> FinishReply:
        job_name = self._name(op.key, "job:" + op.job_id)
        rec = self._get(job_name, now)
        if self._stale(rec, op.attempt):
            return FinishReply(False, None, stale=True)
        if rec is not None:
            rec["s"] = "d"
            self._expire(job_name, now + op.memory_ms)
        else:
            self._put(
                job_name,
                {"s": "d", "o": "", "a": 1, "n": op.attempt, "f": 0, "m": 0},
                now + op.memory_ms,
            )
        run_name = self._name(op.key, "run")
        running = self._get(run_name, now)
        if running is not None and running["j"] == op.job_id:
            self._delete(run_name)
        lock_name = self._name(op.key, "lock")
        lock = self._get(lock_name, now)
        if lock is None or lock["j"] != op.job_id:
            return FinishReply(False)
        if lock["d"] > 0 and op.handoff_job_id:
            return FinishReply(
                True, self._handoff(op.key, lock, op.handoff_job_id, op.ttl_ms, op.grace_ms, now)
            )
        if op.throttle and lock["e"] > now:
            lock["s"] = "t"
            self._expire(lock_name, lock["e"])
        else:
            self._delete(lock_name)
        return FinishReply(True)

    def _release_locks(self, key: str, job_id: str, now: int) -> bool:
        released = False
        for part in ("lock", "run"):
            name = self._name(key, part)
            rec = self._get(name, now)
            if rec is not None and rec["j"] == job_id:
                self._delete(name)
                released = True
        return released

    def _release(self, op: Release, now: int) -> bool:
        if op.queued_only:
            name = self._name(op.key, "lock")
            lock = self._get(name, now)
            if lock is None or lock["j"] != op.job_id or lock["s"] != "q":
                return False
            self._delete(name)
            return True
        lock = self._get(self._name(op.key, "lock"), now)
        unconfirmed = lock is not None and lock["j"] == op.job_id and not lock["c"]
        released = self._release_locks(op.key, op.job_id, now)
        if unconfirmed:  # its token was never used: a failed publish leaves nothing behind
            self._delete(self._name(op.key, "fence"))
        return released

    def _confirm(self, op: Confirm, now: int) -> int:
        confirmed = 0
        for key, job_id in op.items:
            rec = self._get(self._name(key, "job:" + job_id), now)
            if rec is not None and rec["s"] == "q":  # its retry went out
                rec["c"] = 1
            name = self._name(key, "lock")
            lock = self._get(name, now)
            if lock is not None and lock["j"] == job_id and lock["s"] == "q" and not lock["c"]:
                lock["c"] = 1
                self._expire(name, lock["e"])
                confirmed += 1
        return confirmed

    def _job_state(self, op: JobState, now: int) -> JobStatus:
        rec = self._get(self._name(op.key, "job:" + op.job_id), now)
        if rec is None:
            return "none"
        if rec["s"] in ("d", "q"):
            return "finished" if rec["s"] == "d" else "queued"
        return "running" if rec["s"] == "r" and rec["u"] > now else "none"

    def _info(self, key: str, now: int) -> LockInfo | None:
        lock = self._get(self._name(key, "lock"), now)
        running = self._get(self._name(key, "run"), now)
        if lock is None and running is None:
            return None
        run_job = running["j"] if running else None
        if lock is None:
            ttl = self._records[self._name(key, "run")][1] - now
            return LockInfo(key, run_job or "", "running", 0, 0, ttl, True, run_job)
        ttl = self._records[self._name(key, "lock")][1] - now
        return LockInfo(
            key, lock["j"], _STATES[lock["s"]], lock["f"], lock["d"], ttl, bool(lock["c"]), run_job
        )

    def _inspect(self, op: Inspect, now: int) -> LockInfo | None:
        return self._info(op.key, now)

    def _scan(self, op: Scan, now: int) -> list[LockInfo]:
        head = self.prefix + ":{"
        keys = []
        for name in list(self._records):
            if name.startswith(head) and name.endswith(("}:lock", "}:run")):
                key = name[len(head) : name.rindex("}")]
                if key not in keys:
                    keys.append(key)
        found = [info for key in keys if (info := self._info(key, now)) is not None]
        return found[: op.limit]

    def _force_unlock(self, op: ForceUnlock, now: int) -> bool:
        removed = False
        for part in ("lock", "run"):
            name = self._name(op.key, part)
            if self._get(name, now) is not None:
                self._delete(name)
                removed = True
        return removed

    # -- idempotency keys: a record shaped like an enqueue lock (confirm and release apply)

    def _remember(self, op: Remember, now: int) -> RememberReply:
        name = self._name(op.key, "lock")
        rec = self._get(name, now)
        if rec is not None and rec["j"] != op.replaces:
            return RememberReply(False, rec["j"], rec["p"], pending=not rec["c"])
        confirmed = rec is not None or op.grace_ms >= op.ttl_ms
        fields = {"j": op.job_id, "p": op.fingerprint, "s": "q", "f": 0, "d": 0}
        fields.update({"e": now + op.ttl_ms, "c": int(confirmed)})
        self._put(name, fields, now + (op.ttl_ms if confirmed else op.grace_ms))
        return RememberReply(True, op.job_id, op.fingerprint)

    # -- reservation scopes: {"scope": name, "m": {member: expires ms}}

    def _slots(self, scope: str, now: int) -> dict[str, int]:
        rec = self._get(self._name(scope_key(scope), "slots"), now)
        if rec is None:
            return {}
        live = {m: at for m, at in rec["m"].items() if at > now}
        rec["m"] = live
        return live

    def _keep_slots(self, scope: str, slots: dict[str, int]) -> None:
        name = self._name(scope_key(scope), "slots")
        if not slots:
            self._delete(name)
        else:
            self._put(name, {"scope": scope, "m": slots}, max(slots.values()))

    def _reserve(self, op: Reserve, now: int) -> ReserveReply:
        slots = self._slots(op.scope, now)
        if op.member not in slots and len(slots) >= op.limit:
            return ReserveReply(False, len(slots))
        slots[op.member] = now + op.ttl_ms
        self._keep_slots(op.scope, slots)
        return ReserveReply(True, len(slots))

    def _consume(self, op: Consume, now: int) -> bool:
        slots = self._slots(op.scope, now)
        had = slots.pop(op.member, None) is not None
        slots[op.job_id] = now + op.ttl_ms
        self._keep_slots(op.scope, slots)
        return had

    def _unreserve(self, op: Unreserve, now: int) -> bool:
        slots = self._slots(op.scope, now)
        if slots.pop(op.member, None) is None:
            return False
        self._keep_slots(op.scope, slots)
        return True

    def _renew_slot(self, lease: Lease, now: int) -> bool:
        slots = self._slots(lease.key, now)
        if lease.job_id not in slots:
            return False
        slots[lease.job_id] = now + lease.lease_ms
        self._keep_slots(lease.key, slots)
        return True

    def _list_slots(self, op: ListSlots, now: int) -> list[Slot]:
        slots = self._slots(op.scope, now)
        return [Slot(m, at - now) for m, at in sorted(slots.items(), key=lambda kv: kv[1])]

    def _list_scopes(self, op: ListScopes, now: int) -> list[str]:
        head = self.prefix + ":{res:"
        found = []
        for name in list(self._records):
            if name.startswith(head) and name.endswith("}:slots"):
                rec = self._get(name, now)
                if rec is not None:
                    found.append(rec["scope"])
        return found[: op.limit]
