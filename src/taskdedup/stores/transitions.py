"""The lock's transitions on the record seam: one pure function per operation of the lock
diagram, mirroring the Redis scripts in ``lua/`` record for record (the contract suite runs
both). Each runs inside one transaction of ``Records``; time is ``records.now``."""

from __future__ import annotations

from typing import Any

from .base import (
    IDEMPOTENCY_KEY,
    LOST,
    RENEWED,
    SUPERSEDED,
    Acquire,
    AcquireReply,
    Claim,
    ClaimReply,
    Confirm,
    Finish,
    FinishReply,
    ForceUnlock,
    Handoff,
    Heartbeat,
    Inspect,
    JobState,
    JobStatus,
    LockInfo,
    LockState,
    Peek,
    Release,
    Retry,
    Scan,
)
from .history import note_duplicates, remember_claim, remember_event
from .records import Records
from .slots import renew_slot

_STATES: dict[str, LockState] = {"q": "queued", "r": "running", "t": "throttled"}


def hand_off(r: Records, key: str, lock: dict[str, Any], job: str, ttl: int, grace: int) -> Handoff:
    payload = lock.get("p")
    fence = r.next_fence(lock["f"])
    fields = {"j": job, "s": "q", "f": fence, "d": 0, "e": r.now + ttl, "c": int(grace >= ttl)}
    fields["h"] = 1  # a handed-off lock (its history names it: a failed publish is written)
    r.put(r.name(key, "lock"), {**fields, "t": lock.get("t", ""), "a": r.now}, r.now + grace)
    return Handoff(job, payload)


def owe(rec: dict[str, Any] | None, lock: dict[str, Any], job: str) -> None:
    """Keep on the running holder's job record the run owed after it (its lock dies a lease
    after its worker; the record lives longer, so a copy taking the run over still owes it)."""
    if rec is not None:
        rec.update(od=lock["d"], op=lock["p"], ol=job)


def keep_for(r: Records, key: str, lock: dict[str, Any], ttl: int) -> None:
    """A copy runs first on a supersede key whose lock a newer queued job holds: the arguments
    kept for that job go to its record (its run takes them), the lock owes nothing for it."""
    if lock.get("p") is not None:
        name = r.name(key, "job:" + lock["j"])
        rec = r.get(name)
        if rec is None:
            r.put(name, {"p": lock["p"]}, r.now + ttl)
        else:
            rec["p"] = lock["p"]
            r.expire(name, r.now + ttl)
    lock.pop("p", None)
    lock.pop("l", None)
    lock["d"] = 0


def count_duplicate(
    lock: dict[str, Any], job: str, payload: str | None, due: int | None = None
) -> None:
    """One more duplicate of the lock's holder: counted, with the latest one's id and payload
    (reschedule_once, debounce) and when a debounced run is now due kept on the lock; the
    history is written as the lock ends (lib.lua's twin)."""
    lock["d"] += 1
    lock["l"] = job
    if payload is not None:
        lock["p"] = payload
    if due is not None:
        lock["u"] = due


def acquire(op: Acquire, r: Records) -> AcquireReply:
    if op.guard is not None:  # (a guard lives on another server: see TakesGuards)
        raise TypeError("this store cannot take a guard key with its lock")
    name = r.name(op.key, "lock")
    lock = r.get(name)
    if lock is not None and lock["j"] == op.job_id:  # the holder again: no change
        return AcquireReply(True, op.job_id, lock["f"], lock["d"])
    if lock is not None:
        due = None  # debounce: the burst's run moves to delay after this submission
        if op.debounce_ms and lock["s"] == "q" and "w" in lock:
            due = min(r.now + op.debounce_ms, lock["w"])
        if op.record_duplicate:
            count_duplicate(lock, op.job_id, op.payload, due)
            if op.cancel and lock["s"] == "r":  # the running holder is asked to stop
                lock["x"] = 1
            if op.payload is not None and lock["s"] == "r":  # the owed run outlives the lock
                owe(r.get(r.name(op.key, "job:" + lock["j"])), lock, op.job_id)  # (acquire.lua)
        pending = lock["s"] == "q" and lock["c"] == 0
        return AcquireReply(False, lock["j"], lock["f"], lock["d"], pending, lock["s"] == "r")
    fence = r.next_fence(None)
    confirmed = 1 if op.grace_ms >= op.ttl_ms else 0
    fields = {"j": op.job_id, "s": "q", "f": fence, "d": 0, "e": r.now + op.ttl_ms}
    fields.update(c=confirmed, t=op.task, a=r.now)  # 't', 'a': for the tools
    if op.debounce_ms:  # 'u': when the run is due; 'w': the latest it may be moved to
        fields.update(u=r.now + op.debounce_ms, w=r.now + op.wait_ms)
    r.put(name, fields, r.now + min(op.grace_ms, op.ttl_ms))
    return AcquireReply(True, op.job_id, fence, 0)


def peek(op: Peek, r: Records) -> AcquireReply | None:
    lock = r.get(r.name(op.key, "lock"))
    if lock is None:
        return None
    if lock["s"] == "q" and lock["c"] == 0:
        return AcquireReply(False, lock["j"], lock["f"], lock["d"], pending=True)
    if op.record_duplicate:
        count_duplicate(lock, "-", None)  # (no job id was made)
    return AcquireReply(False, lock["j"], lock["f"], lock["d"])


def claim(op: Claim, r: Records) -> ClaimReply:
    return remember_claim(r, op.key, op.job_id, _claim(op, r))


def _claim(op: Claim, r: Records) -> ClaimReply:
    job_name = r.name(op.key, "job:" + op.job_id)
    rec = r.get(job_name)
    kept = None
    if rec is not None and "s" not in rec:  # only the arguments kept for it (keep_for)
        kept, rec = rec.get("p"), None
    attempts = 1
    if rec is not None:
        if rec["s"] == "d":  # a finished job holds nothing: free what a late re-send took
            release_locks(r, op.key, op.job_id)
            return ClaimReply("done", rec["f"], rec["a"], rec["o"])
        attempts = rec["a"] + 1
        # a copy of an attempt that asked for a retry: it waits while the retry may still be
        # sent (unconfirmed, within the grace) or, sent, may still come (its delay plus the
        # grace); past that it runs as that retry (see claim.lua)
        retried = rec["s"] == "q" and rec["n"] is not None
        if retried and op.attempt is not None and op.attempt <= rec["n"]:
            wait = rec.get("w", 0) if rec.get("c", 1) else rec["u"]
            if wait > r.now:
                return ClaimReply("running", rec["f"], rec["a"], rec["o"])
        if rec["s"] == "r":
            newer = op.attempt is not None and rec["n"] is not None and op.attempt > rec["n"]
            lost = bool(rec.get("k")) and rec.get("k") in op.lost_claims
            if lost:  # that claim's run never started: it was no attempt
                attempts -= 1
            # a live run holds the job, whatever this delivery's attempt number (G12)
            if rec["u"] > r.now and not lost:
                return ClaimReply("running", rec["f"], rec["a"], rec["o"])
            if not newer and op.max_attempts and attempts > op.max_attempts:
                rec["s"] = "d"
                r.expire(job_name, r.now + op.memory_ms)
                release_locks(r, op.key, op.job_id)
                return ClaimReply("exhausted", rec["f"], rec["a"], rec["o"])
    lock_name = r.name(op.key, "lock")
    lock = r.get(lock_name)
    if lock is not None and lock["j"] == op.job_id and "u" in lock and lock["s"] == "q":
        wait = lock["u"] - r.now  # debounce: a later submission moved the run
        if wait > 0:
            return ClaimReply("early", 0, attempts - 1, op.job_id, wait_ms=wait)
    run_name = r.name(op.key, "run")
    if op.run_lock:
        running = r.get(run_name)
        if running is not None and running["j"] != op.job_id:
            return ClaimReply("busy", 0, attempts - 1, running["j"])
    fence: int | None = None
    handoff: Handoff | None = None
    # what the record keeps of a run owed to submissions made while this job ran (owe())
    prior = rec or {}
    owed: dict[str, Any] = {k: prior[k] for k in ("od", "op", "ol") if k in prior}
    ours = lock is not None and lock["j"] == op.job_id
    latest = lock.get("p") if op.latest and ours and lock is not None else None
    if (
        op.latest
        and not ours
        and latest is None
        and rec is not None
        and rec["s"] == "r"
        and ("od" in rec)
    ):
        latest, owed = rec["op"], {}  # taken over: the newest a submission while it ran left
    if op.latest and latest is None and rec is not None:  # a run taken over runs what the
        latest = rec.get("p")  # run before it ran: its record keeps them
    if op.latest and latest is None:
        latest = kept
    if op.lock == "hold" and lock is not None and lock["j"] != op.job_id:
        # another job's key: this copy is stale or was sent without a lock (G12)
        if lock["s"] == "r":  # that job runs: wait for it to end
            return ClaimReply("busy", 0, attempts - 1, lock["j"])
        if lock["s"] == "q":  # it waits in the queue: run first; it will wait for us
            fence = r.next_fence(lock["f"])
            if op.latest:  # supersede: its kept arguments stay its own (claim.lua)
                keep_for(r, op.key, lock, op.ttl_ms)
            lock.update(j=op.job_id, s="r", f=fence, c=1)
            r.expire(lock_name, r.now + op.lease_ms)
    if lock is not None and lock["j"] == op.job_id and fence is None:
        fence = lock["f"]
        if op.lock == "hold" and latest is not None:  # supersede: the duplicates so far are
            note_duplicates(r, op.key, lock, "superseded")  # consumed; one while it runs owes
            # its own run
            lock.pop("p", None)
            lock.pop("l", None)
            lock.update(s="r", c=1, d=0)
            r.expire(lock_name, r.now + op.lease_ms)
        elif op.lock == "hold":
            lock["s"], lock["c"] = "r", 1  # it was published: it runs
            r.expire(lock_name, r.now + op.lease_ms)
        elif op.lock == "release":
            note_duplicates(r, op.key, lock, "debounced" if "u" in lock else "deduplicated")
            if lock["d"] > 0 and op.handoff_job_id:
                handoff = hand_off(r, op.key, lock, op.handoff_job_id, op.ttl_ms, op.grace_ms)
            else:
                r.delete(lock_name)
    elif lock is None and op.lock == "hold":
        fence = r.next_fence(None)
        fields = {"j": op.job_id, "s": "r", "f": fence, "d": 0, "e": r.now + op.ttl_ms, "c": 1}
        if rec is not None and rec["s"] == "r" and rec.get("od") and not op.latest:
            fields.update(d=rec["od"], p=rec["op"], l=rec["ol"])  # reschedule_once still owes
            # the run a submission made while the run taken over ran, after this one
        r.put(lock_name, {**fields, "t": op.task, "a": r.now}, r.now + op.lease_ms)
    if fence is None or op.run_lock:  # a run lock's token orders the runs (G3)
        fence = r.next_fence(fence if fence is not None or lock is None else lock["f"])
    if op.run_lock:
        run = {"j": op.job_id, "o": op.owner, "t": op.task, "a": r.now}
        r.put(run_name, run, r.now + op.lease_ms)
    r.put(
        job_name,
        {
            "s": "r",
            "o": op.owner,
            "u": r.now + op.lease_ms,
            "a": attempts,
            "n": op.attempt,
            "f": fence,
            "m": op.memory_ms,
            "k": op.nonce,
            "l": int(op.run_lock),
            "b": r.now,
            **({"p": latest} if latest is not None else {}),
            **owed,
        },
        r.now + op.lease_ms + op.memory_ms,
    )
    return ClaimReply("run", fence, attempts, op.owner, handoff, arguments=latest)


def heartbeat(op: Heartbeat, r: Records) -> tuple[int, ...]:
    answers = []
    for lease in op.leases:
        if lease.slot:
            answers.append(int(renew_slot(r, lease)))
            continue
        alive = LOST
        job_name = r.name(lease.key, "job:" + lease.job_id)
        rec = r.get(job_name)
        if rec is not None and rec["s"] == "r":
            rec["u"] = r.now + lease.lease_ms
            r.expire(job_name, r.now + lease.lease_ms + rec["m"])
            alive = RENEWED
        lock_name = r.name(lease.key, "lock")
        lock = r.get(lock_name)
        if lock is not None and lock["j"] == lease.job_id and lock["s"] == "r":
            r.expire(lock_name, r.now + lease.lease_ms)
            alive = SUPERSEDED if lock.get("x") else RENEWED
        run_name = r.name(lease.key, "run")
        running = r.get(run_name)
        if running is not None and running["j"] == lease.job_id:
            r.expire(run_name, r.now + lease.lease_ms)
            alive = alive or RENEWED
        answers.append(alive)
    return tuple(answers)


def stale(rec: dict[str, Any] | None, attempt: int | None) -> bool:
    n = None if rec is None else rec.get("n")  # (a record of kept arguments only has none)
    return attempt is not None and n is not None and attempt < n


def retry(op: Retry, r: Records) -> bool:
    job_name = r.name(op.key, "job:" + op.job_id)
    rec = r.get(job_name)
    if stale(rec, op.attempt):
        return False
    grace = min(op.grace_ms, op.ttl_ms)
    if rec is not None:  # it waits for the retry's publish to be confirmed (G11)
        rec.update(s="q", c=0, u=r.now + grace, w=r.now + op.delay_ms + grace)
        r.expire(job_name, r.now + op.ttl_ms)
    release_if_holder(r, op.key, "run", op.job_id)
    lock_name = r.name(op.key, "lock")
    lock = r.get(lock_name)
    if lock is None or lock["j"] != op.job_id:
        return False
    lock.update(s="q", e=r.now + op.ttl_ms, c=0, y=1)  # 'y': a retry's lock
    r.expire(lock_name, r.now + grace)
    remember_event(r, op.key, "retrying", op.job_id)
    return True


def finish(op: Finish, r: Records) -> FinishReply:
    job_name = r.name(op.key, "job:" + op.job_id)
    rec = r.get(job_name)
    if stale(rec, op.attempt):
        return FinishReply(False, None, stale=True)
    if rec is not None and "s" in rec:
        rec["s"] = "d"
        r.expire(job_name, r.now + op.memory_ms)
    else:
        r.put(
            job_name,
            {"s": "d", "o": "", "a": 1, "n": op.attempt, "f": 0, "m": 0},
            r.now + op.memory_ms,
        )
    if rec is None or rec.get("l", 1):  # the run lock, when this run took it
        release_if_holder(r, op.key, "run", op.job_id)
    lock_name = r.name(op.key, "lock")
    lock = r.get(lock_name)
    if lock is None or lock["j"] != op.job_id:
        return FinishReply(False)
    note_duplicates(r, op.key, lock, "cancel_requested" if lock.get("x") else "deduplicated")
    if lock["d"] > 0 and op.handoff_job_id:
        handoff = hand_off(r, op.key, lock, op.handoff_job_id, op.ttl_ms, op.grace_ms)
        remember_event(r, op.key, "finished", op.job_id, "rescheduled", op.handoff_job_id)
        return FinishReply(True, handoff)
    if op.throttle and lock["e"] > r.now:
        lock["s"] = "t"
        r.expire(lock_name, lock["e"])
    else:
        r.delete(lock_name)
    return FinishReply(True)


def release_if_holder(r: Records, key: str, part: str, job_id: str) -> bool:
    """Delete the ``part`` record of ``key`` ("lock" or "run") if ``job_id`` holds it."""
    name = r.name(key, part)
    rec = r.get(name)
    if rec is None or rec["j"] != job_id:
        return False
    r.delete(name)
    return True


def release_locks(r: Records, key: str, job_id: str) -> bool:
    released = release_if_holder(r, key, "lock", job_id)
    return release_if_holder(r, key, "run", job_id) or released


def release(op: Release, r: Records) -> bool:
    lock = r.get(r.name(op.key, "lock"))
    ours = lock is not None and lock["j"] == op.job_id and not op.queued_only
    # never confirmed, no retry, no duplicate counted: no history entry names it, and a
    # failed publish leaves nothing behind
    kept = lock is not None and (lock["c"] or lock.get("y") or lock.get("h") or lock["d"])
    unpublished = ours and not kept
    released = _release(op, r)
    if released and not unpublished:
        if ours and lock is not None:
            note_duplicates(r, op.key, lock)
        remember_event(r, op.key, "freed", op.job_id, op.why)
    return released


def _release(op: Release, r: Records) -> bool:
    if op.queued_only:
        name = r.name(op.key, "lock")
        lock = r.get(name)
        if lock is None or lock["j"] != op.job_id or lock["s"] != "q":
            return False
        r.delete(name)
        return True
    released = release_locks(r, op.key, op.job_id)
    return released


def confirm(op: Confirm, r: Records) -> int:
    confirmed = 0
    for index, (key, job_id) in enumerate(op.items):
        rec = r.get(r.name(key, "job:" + job_id))
        if rec is not None and rec.get("s") == "q":  # its retry went out
            rec["c"] = 1
        name = r.name(key, "lock")
        lock = r.get(name)
        if lock is not None and lock["j"] == job_id and op.duplicates:
            lock["d"] += op.duplicates[index]
        if lock is not None and lock["j"] == job_id and lock["s"] == "q" and not lock["c"]:
            lock["c"] = 1
            r.expire(name, lock["e"])
            confirmed += 1
    return confirmed


def job_state(op: JobState, r: Records) -> JobStatus:
    rec = r.get(r.name(op.key, "job:" + op.job_id))
    if rec is None or "s" not in rec:  # (a record of kept arguments only: not started)
        return "none"
    if rec["s"] in ("d", "q"):
        return "finished" if rec["s"] == "d" else "queued"
    return "running" if rec["s"] == "r" and rec["u"] > r.now else "none"


def info(r: Records, key: str) -> LockInfo | None:
    lock = r.get(r.name(key, "lock"))
    running = r.get(r.name(key, "run"))
    if lock is None and running is None:
        return None
    run_job = running["j"] if running else None
    holder = (lock or running or {})["j"]  # (its job record: worker and attempts)
    rec = r.get(r.name(key, "job:" + holder)) or {}
    taken = lock or running or {}
    began = rec.get("b") if rec.get("o") else None  # when the holder's run began
    shown = (taken.get("t") or None, taken.get("a"), rec.get("o") or None, rec.get("a", 0), began)
    if lock is None:
        ttl = r.ttl(r.name(key, "run"))
        return LockInfo(key, run_job or "", "running", 0, 0, ttl, True, run_job, *shown)
    ttl = r.ttl(r.name(key, "lock"))
    return LockInfo(
        key,
        lock["j"],
        _STATES[lock["s"]],
        lock["f"],
        lock["d"],
        ttl,
        bool(lock["c"]),
        run_job,
        *shown,
        last_duplicate=lock.get("l"),
        due_ms=lock.get("u"),
        stop_requested=bool(lock.get("x")),
    )


def inspect(op: Inspect, r: Records) -> LockInfo | None:
    return info(r, op.key)


def scan(op: Scan, r: Records) -> list[LockInfo]:
    head = r.prefix + ":{"
    keys = []
    for name in r.names():
        if name.startswith(head) and name.endswith(("}:lock", "}:run")):
            key = name[len(head) : name.rindex("}")]
            if key not in keys and not key.startswith(IDEMPOTENCY_KEY):
                keys.append(key)
    found = [found for key in keys if (found := info(r, key)) is not None]
    return found[: op.limit]


def force_unlock(op: ForceUnlock, r: Records) -> bool:
    removed = []
    for part in ("lock", "run"):
        name = r.name(op.key, part)
        rec = r.get(name)
        if rec is not None:
            r.delete(name)
            removed.append(rec["j"])
            if part == "lock":
                note_duplicates(r, op.key, rec)
    if removed:
        remember_event(r, op.key, "unlocked", removed[0], "operator")
    return bool(removed)
