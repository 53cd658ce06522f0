"""``taskdedup explain``: what was decided for a key and why, most recent first.

The key is named by itself, by a job id (found by its job record or in the keys' histories),
or by a task and its arguments (``explain ci.build sha=abc``), whose key the task's policy
computes as a submission would. The history is the store's: what a person asks about (the
duplicates a lock answered, written as it ends; a wait, a dropped copy, a retry, a hand-off, a
lock freed), a bounded list per key kept a day after its last entry. The ordinary life of the
job holding the key (accepted, started, the duplicates answered so far) is read from its lock
and its job record and told in the same list.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..stores.base import Event, History, Inspect, JobState, LockInfo
from .target import Target

#: What each kind of entry says, given its job and details.
SAYS = {
    "accepted": "accepted: {job} took the key {0}",
    "started": "started: {job} runs on {0} (attempt {1})",
    "waited": "waited: a delivery of {job} found the key held by {0}; sent again later",
    "copy_dropped": "copy dropped: a delivery of {job}, which had finished, did not run",
    "exhausted": "exhausted: {job} stopped after {0} attempts",
    "retrying": "retrying: {job} keeps the key for its retry",
    "freed": "freed: {job}'s lock was released ({0})",
    "unlocked": "unlocked by an operator (it was {job}'s)",
}
FINISHED = {
    "released": "finished: {job} ended and released the key",
    "throttled": "finished: {job} ended; the key stays held until its ttl (until_expired)",
    "rescheduled": "finished: {job} ended; the key passed to {1}, the one rescheduled run",
    "not_holder": "finished: {job} ended; the key was no longer its own",
}
#: Entries after which the key is still held: if nothing holds it now, a ttl or lease lapsed.
HOLDING = {"accepted", "deduplicated", "superseded", "started", "waited", "retrying"}
#: The lines for a lock's duplicates, by what they did: one duplicate (its id), several (their
#: number and the last one's id), given the holder. ``debounced``: folded into a burst's one
#: run; ``superseded``: their arguments replaced the queued holder's; ``cancel_requested``:
#: they asked the running holder to stop. The last one's arguments are those that ran next.
DUPLICATES = {
    "deduplicated": (
        "deduplicated: {who} was answered with {holder}",
        "deduplicated: {count} submissions were answered with {holder}{last}",
    ),
    "debounced": (
        "debounced: {who} was debounced onto {holder}, which ran with its arguments",
        "debounced: {count} submissions were debounced onto {holder}{last}; it ran with the"
        " last one's arguments",
    ),
    "superseded": (
        "superseded: {holder}'s arguments were superseded by those of {who}, which it ran with",
        "superseded: {holder}'s arguments were superseded by {count} newer submissions{last};"
        " it ran with the last one's",
    ),
    "cancel_requested": (
        "cancel requested: {who} asked {holder} to stop while it ran; one run followed it",
        "cancel requested: {count} submissions asked {holder} to stop while it ran{last}; one"
        " run, with the last one's arguments, followed it",
    ),
}
#: When no entry is left to tell.
NOTHING = (
    "  (nothing unusual recorded in the last day: a job that ran and ended as it should leaves"
    " no entry once its lock is gone; or the key was never used)"
)


def find_key(target: Target, words: tuple[str, ...]) -> str:
    """The key ``words`` name: a task and its arguments, a key, or a job id."""
    first, rest = words[0], words[1:]
    policy = target.policies.get(first)
    if policy is not None:
        args, kwargs = _call(rest)
        try:
            return policy.key_for(args, kwargs)
        except Exception as exc:
            raise click.UsageError(f"{first}: these arguments make no key ({exc})") from None
    if rest:
        raise click.UsageError(f"{first} is no deduplicated task of this app or broker")
    if target.store.run(History(first)) or target.store.run(Inspect(first)) is not None:
        return first
    found = _keys_of_job(target, first)
    if not found:
        raise click.UsageError(
            f"{first}: no key held or with a history, no job, no task of that name (a key whose"
            " jobs all ran and ended as they should keeps nothing once its lock is gone)"
        )
    return found[0]


def explain(target: Target, key: str, as_json: bool, job: str | None = None) -> None:
    """What was decided for ``key``, newest first (``job``: the job id it was asked about)."""
    info = target.store.run(Inspect(key))
    kept = target.store.run(History(key))
    events = sorted([*kept, *_ordinary(info)], key=lambda e: e.at_ms, reverse=True)
    if as_json:
        now = None if info is None else {"job_id": info.job_id, "state": info.state,
                                          "duplicates": info.duplicates,
                                          "last_duplicate": info.last_duplicate,
                                          "stop_requested": info.stop_requested}  # fmt: skip
        entries = [{"at_ms": e.at_ms, "what": e.what, "job_id": e.job_id,
                    "detail": list(e.detail), "says": says(e)} for e in events]  # fmt: skip
        click.echo(json.dumps({"key": key, "now": now, "history": entries}))
        return
    click.echo(f"key {key}: {_now(target, key, info, kept, job)}")
    for e in events:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at_ms / 1000))
        click.echo(f"  {stamp}.{e.at_ms % 1000:03d}  {says(e)}")
    if not events:
        click.echo(NOTHING)


def _ordinary(info: LockInfo | None) -> list[Event]:
    """The holder's acceptance and start, as its lock and job record tell them (the history
    does not keep them: writing them cost every job four commands)."""
    if info is None:
        return []
    told = []  # newest first, as the history is (so two in the same millisecond keep order)
    if info.worker:
        began = info.started_ms or info.since_ms or 0
        told.append(Event(began, "started", info.job_id, (info.worker, str(info.attempts))))
    if info.since_ms:
        told.append(Event(info.since_ms, "accepted", info.job_id, (info.task or "",)))
    return told


def _duplicates(e: Event) -> str:
    """One line for the duplicates a lock answered: what they did, how many, and the last one
    (its job id, or none when it was asked before a job id was made)."""
    holder = e.detail[0] if e.detail else "?"
    count = int(e.detail[1]) if len(e.detail) > 1 and e.detail[1].isdigit() else 1
    one, several = DUPLICATES[e.what]
    who = "a submission" if e.job_id == "-" else f"the submission {e.job_id}"
    last = "" if e.job_id == "-" else f" (the last: {e.job_id})"
    return (one if count == 1 else several).format(who=who, holder=holder, count=count, last=last)


def says(e: Event) -> str:
    if e.what in DUPLICATES:
        return _duplicates(e)
    if e.what == "finished":
        template = FINISHED.get(e.detail[0] if e.detail else "", "finished: {job}")
    else:
        template = SAYS.get(e.what, e.what + " {job}")
    detail = [*e.detail, "", ""]
    if e.what == "accepted" and e.detail:
        detail[0] = f"({e.detail[0]})"
    return template.format(*detail, job=e.job_id).replace(" ()", "").rstrip()  # (no why)


def due_in(due_ms: int) -> float:
    """Seconds until a debounced run is due (0 once it is)."""
    return max(0.0, due_ms / 1000 - time.time())


def _answered(info: LockInfo, supersedes: bool) -> str:
    """The duplicates the holder answered so far (counted on its lock: the history gets them
    in one line when the lock ends), and what they did to it. ``supersedes``: its task's
    policy is ``on_conflict="supersede"``."""
    if not info.duplicates:
        return ""
    n = info.duplicates
    plural = "" if n == 1 else "s"
    last = info.last_duplicate
    told = "" if not last or last == "-" else f", the last {last}"
    if info.due_ms is not None:
        return f"; {n} submission{plural} debounced onto it so far{told}"
    if info.stop_requested:
        return f"; cancel requested by {n} submission{plural}{told}: its run follows this one"
    if supersedes and info.state == "queued":
        return f"; superseded by {n} newer submission{plural}{told}, whose arguments it runs"
    return f"; it answered {n} duplicate{plural} so far{told}"


def _now(
    target: Target, key: str, info: LockInfo | None, events: list[Event], job: str | None
) -> str:
    store = target.store
    if info is not None:
        where = f" on {info.worker}" if info.worker else ""
        now = f"{info.state}, held by {info.job_id}{where} ({info.task or 'task unknown'})"
        if info.due_ms is not None and info.state == "queued":  # debounce
            now += f"; its run is due in {due_in(info.due_ms):.1f}s"
        tp = target.policies.get(info.task or "")
        return now + _answered(info, tp is not None and tp.policy.on_conflict == "supersede")
    if not events or events[0].what not in HOLDING:  # (a job asked about: its record tells)
        ended = job not in (None, key) and store.run(JobState(key, job)) == "finished"
        return f"free: {job} ran and finished" if ended else "free"
    last = events[0]  # (a delivery that waited is the job that later ran: a killed run's copy)
    holder = last.detail[0] if last.what in DUPLICATES else last.job_id
    if store.run(JobState(key, holder)) == "finished":  # its end is not written: it is usual
        return f"free: {holder} ran and finished"
    return "free: its ttl or lease ran out after the last decision (expired)"


def _call(words: tuple[str, ...]) -> tuple[list[Any], dict[str, Any]]:
    """Arguments as a shell gives them: ``name=value`` is a keyword; values are JSON when they
    parse as JSON (``3``, ``true``, ``"x"``, ``[1, 2]``), text otherwise."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for word in words:
        name, sep, value = word.partition("=")
        if sep and name.isidentifier():
            kwargs[name] = _value(value)
        else:
            args.append(_value(word))
    return args, kwargs


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _keys_of_job(target: Target, job_id: str) -> list[str]:
    """The keys of ``job_id``: the one its job record lives under, the one whose lock it holds,
    else those whose history names it (Redis: a SCAN each)."""
    from ..stores.redis import RedisStore
    from ..stores.redis_calls import as_text

    store = target.store
    if not isinstance(store, RedisStore):
        return []
    head = store.prefix + ":{"
    pattern = f"{store.prefix}:{{*}}:job:{_glob_escape(job_id)}"
    for raw in store.client.scan_iter(match=pattern, count=500):
        name = as_text(raw)
        return [name[len(head) : name.rindex("}")]]
    for part in ("lock", "run"):  # a job not started yet: the lock it holds
        for raw in store.client.scan_iter(match=f"{store.prefix}:{{*}}:{part}", count=500):
            if as_text(store.client.hget(raw, "j") or b"") == job_id:
                name = as_text(raw)
                return [name[len(head) : name.rindex("}")]]
    keys = []
    for raw in store.client.scan_iter(match=f"{store.prefix}:{{*}}:log", count=500):
        name = as_text(raw)
        entries = [as_text(e) for e in store.client.lrange(name, 0, -1)]
        if any(f" {job_id} " in f"{entry} " for entry in entries):
            keys.append(name[len(head) : name.rindex("}")])
    return keys


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
