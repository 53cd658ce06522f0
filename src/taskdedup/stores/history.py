"""A key's decision history on the record seam (``taskdedup explain``), as lib.lua keeps it
for Redis: newest first, at most HISTORY_SIZE entries, kept HISTORY_MS after the last. Only
what a person asks about is written (see lib.lua); nothing when the history setting is off."""

from __future__ import annotations

from .base import HISTORY_MS, HISTORY_SIZE, ClaimReply, Event, History
from .records import Records


def remember_event(r: Records, key: str, what: str, job_id: str, *detail: object) -> None:
    if not r.history:  # the history setting is off
        return
    name = r.name(key, "log")
    entries = (r.get(name) or {"v": []})["v"]
    entry = Event(r.now, what, job_id, tuple(str(d) for d in detail)).entry()
    r.put(name, {"v": [entry, *entries][:HISTORY_SIZE]}, r.now + HISTORY_MS)


def note_duplicates(
    r: Records, key: str, lock: dict[str, object], what: str = "deduplicated"
) -> None:
    """The duplicates a holder's lock answered, written once as the lock ends (lib.lua's
    note_duplicates): how many, and the last one's id ('-' when none was made). ``what`` names
    what they did when it was more than being answered: ``debounced``, ``superseded``,
    ``cancel_requested``."""
    if lock.get("d"):
        remember_event(r, key, what, str(lock.get("l") or "-"), lock["j"], lock["d"])


def remember_claim(r: Records, key: str, job_id: str, reply: ClaimReply) -> ClaimReply:
    """The claim's answer in the key's history (as claim.lua records it): a run is not written
    there (the job's record has it), a delivery that waits or is dropped is."""
    if reply.outcome in ("run", "early"):  # ordinary: the lock and job record tell them
        return reply
    if reply.outcome == "done":
        remember_event(r, key, "copy_dropped", job_id)
    elif reply.outcome == "exhausted":
        remember_event(r, key, "exhausted", job_id, reply.attempts)
    else:  # busy, or running elsewhere: the delivery waits and is sent again
        remember_event(r, key, "waited", job_id, reply.holder)
    return reply


def history(op: History, r: Records) -> list[Event]:
    rec = r.get(r.name(op.key, "log"))
    return [Event.parse(entry) for entry in (rec["v"] if rec else [])]
