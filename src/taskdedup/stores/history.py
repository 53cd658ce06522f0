"""A key's decision history on the record seam (``taskdedup explain``), as lib.lua keeps it
for Redis: newest first, at most HISTORY_SIZE entries, kept HISTORY_MS after the last."""

from __future__ import annotations

from .base import HISTORY_MS, HISTORY_SIZE, ClaimReply, Event, History
from .records import Records


def remember_event(r: Records, key: str, what: str, job_id: str, *detail: object) -> None:
    name = r.name(key, "log")
    entries = (r.get(name) or {"v": []})["v"]
    entry = Event(r.now, what, job_id, tuple(str(d) for d in detail)).entry()
    r.put(name, {"v": [entry, *entries][:HISTORY_SIZE]}, r.now + HISTORY_MS)


def forget_accepted(r: Records, key: str, job_id: str) -> bool:
    """Drop the newest entry if it is ``job_id``'s acceptance (a publish that failed); True if
    it was (the history goes with it when nothing else is left)."""
    name = r.name(key, "log")
    entries = (r.get(name) or {"v": []})["v"]
    if not entries or f" accepted {job_id} " not in entries[0] + " ":
        return False
    if entries[1:]:
        r.put(name, {"v": entries[1:]}, r.now + HISTORY_MS)
    else:
        r.delete(name)
    return True


def remember_claim(r: Records, key: str, job_id: str, reply: ClaimReply) -> ClaimReply:
    """The claim's answer in the key's history (as claim.lua records it)."""
    if reply.outcome == "run":
        remember_event(r, key, "started", job_id, reply.holder, reply.attempts)
    elif reply.outcome == "done":
        remember_event(r, key, "copy_dropped", job_id)
    elif reply.outcome == "exhausted":
        remember_event(r, key, "exhausted", job_id, reply.attempts)
    else:  # busy, or running elsewhere: the delivery waits and is sent again
        remember_event(r, key, "waited", job_id, reply.holder)
    return reply


def history(op: History, r: Records) -> list[Event]:
    rec = r.get(r.name(op.key, "log"))
    return [Event.parse(entry) for entry in (rec["v"] if rec else [])]
