"""Idempotency records, reservation scopes and pacing on the record seam (see
``transitions.py``)."""

from __future__ import annotations

from .base import (
    Consume,
    Lease,
    ListScopes,
    ListSlots,
    MarkTick,
    Pace,
    Remember,
    RememberReply,
    Reserve,
    ReserveAll,
    ReserveReply,
    Slot,
    UnmarkTick,
    Unreserve,
    scope_key,
)
from .records import Records

# -- idempotency keys: a record shaped like an enqueue lock (confirm and release apply)


def remember(op: Remember, r: Records) -> RememberReply:
    name = r.name(op.key, "lock")
    rec = r.get(name)
    if rec is not None and rec["j"] != op.replaces:
        return RememberReply(False, rec["j"], rec["p"], pending=not rec["c"])
    confirmed = rec is not None or op.grace_ms >= op.ttl_ms
    fields = {"j": op.job_id, "p": op.fingerprint, "s": "q", "f": 0, "d": 0}
    fields.update({"e": r.now + op.ttl_ms, "c": int(confirmed)})
    r.put(name, fields, r.now + (op.ttl_ms if confirmed else op.grace_ms))
    return RememberReply(True, op.job_id, op.fingerprint)


# -- reservation scopes: {"scope": name, "m": {member: expires ms}}


def live_slots(r: Records, scope: str) -> dict[str, int]:
    rec = r.get(r.name(scope_key(scope), "slots"))
    if rec is None:
        return {}
    live = {m: at for m, at in rec["m"].items() if at > r.now}
    rec["m"] = live
    return live


def keep_slots(r: Records, scope: str, slots: dict[str, int]) -> None:
    name = r.name(scope_key(scope), "slots")
    if not slots:
        r.delete(name)
    else:
        r.put(name, {"scope": scope, "m": slots}, max(slots.values()))


def reserve(op: Reserve, r: Records) -> ReserveReply:
    slots = live_slots(r, op.scope)
    if op.member not in slots and len(slots) >= op.limit:
        return ReserveReply(False, len(slots))
    slots[op.member] = r.now + op.ttl_ms
    keep_slots(r, op.scope, slots)
    return ReserveReply(True, len(slots))


def reserve_all(op: ReserveAll, r: Records) -> int:
    held = [live_slots(r, scope) for scope, _ in op.parts]
    for index, ((_, limit), slots) in enumerate(zip(op.parts, held, strict=True)):
        if op.member not in slots and len(slots) >= limit:
            return index
    for (scope, _), slots in zip(op.parts, held, strict=True):
        slots[op.member] = r.now + op.ttl_ms
        keep_slots(r, scope, slots)
    return -1


def consume(op: Consume, r: Records) -> bool:
    slots = live_slots(r, op.scope)
    had = slots.pop(op.member, None) is not None
    slots[op.job_id] = r.now + op.ttl_ms
    keep_slots(r, op.scope, slots)
    return had


def unreserve(op: Unreserve, r: Records) -> bool:
    slots = live_slots(r, op.scope)
    if slots.pop(op.member, None) is None:
        return False
    keep_slots(r, op.scope, slots)
    return True


def renew_slot(r: Records, lease: Lease) -> bool:
    slots = live_slots(r, lease.key)
    if lease.job_id not in slots:
        return False
    slots[lease.job_id] = r.now + lease.lease_ms
    keep_slots(r, lease.key, slots)
    return True


def list_slots(op: ListSlots, r: Records) -> list[Slot]:
    slots = live_slots(r, op.scope)
    return [Slot(m, at - r.now) for m, at in sorted(slots.items(), key=lambda kv: kv[1])]


def list_scopes(op: ListScopes, r: Records) -> list[str]:
    head = r.prefix + ":{res:"
    found = []
    for name in r.names():
        if name.startswith(head) and name.endswith("}:slots"):
            rec = r.get(name)
            if rec is not None:
                found.append(rec["scope"])
    return found[: op.limit]


# -- pacing: {"t": theoretical arrival time, ms} per scope (pace.lua's twin)


def pace(op: Pace, r: Records) -> int:
    name = r.name(scope_key(op.scope, "pace"), "pace")
    rec = r.get(name)
    tat = max(rec["t"] if rec is not None else r.now, r.now)
    start = max(r.now, tat - (op.burst - 1) * op.interval_ms)
    r.put(name, {"t": tat + op.interval_ms}, tat + op.interval_ms)
    return start - r.now


# -- a schedule entry's latest tick: {"s": slot ms, "j": its job} (tick.lua's twin)


def mark_tick(op: MarkTick, r: Records) -> str | None:
    name = r.name(scope_key(op.entry, "tick"), "tick")
    rec = r.get(name)
    if rec is not None and rec["s"] >= op.slot_ms:
        return str(rec["j"])
    r.put(name, {"s": op.slot_ms, "j": op.job_id}, r.now + op.ttl_ms)
    return None


def unmark_tick(op: UnmarkTick, r: Records) -> bool:
    name = r.name(scope_key(op.entry, "tick"), "tick")
    rec = r.get(name)
    if rec is None or rec["j"] != op.job_id:
        return False
    r.delete(name)
    return True
