"""``taskdedup explain``: what was decided for a key and why, most recent first.

The key is named by itself, by a job id found in the keys' histories, or by a task and its
arguments (``explain ci.build sha=abc``), whose key the task's policy computes as a submission
would. The history is the store's (a bounded list per key, kept a day after its last entry).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..stores.base import Event, History, Inspect, LockInfo
from .target import Target

#: What each kind of entry says, given its job and details.
SAYS = {
    "accepted": "accepted: {job} took the key {0}",
    "deduplicated": "deduplicated: the submission {job} was answered with {0}",
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
HOLDING = {"accepted", "deduplicated", "started", "waited", "retrying"}


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
        raise click.UsageError(f"{first}: no key, no job in the keys' histories, no task")
    return found[0]


def explain(target: Target, key: str, as_json: bool) -> None:
    events = target.store.run(History(key))
    info = target.store.run(Inspect(key))
    if as_json:
        now = None if info is None else {"job_id": info.job_id, "state": info.state}
        entries = [{"at_ms": e.at_ms, "what": e.what, "job_id": e.job_id,
                    "detail": list(e.detail), "says": says(e)} for e in events]  # fmt: skip
        click.echo(json.dumps({"key": key, "now": now, "history": entries}))
        return
    click.echo(f"key {key}: {_now(info, events)}")
    for e in events:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at_ms / 1000))
        click.echo(f"  {stamp}.{e.at_ms % 1000:03d}  {says(e)}")
    if not events:
        click.echo("  (no decision recorded: none in the last day, or the key was never used)")


def says(e: Event) -> str:
    if e.what == "finished":
        template = FINISHED.get(e.detail[0] if e.detail else "", "finished: {job}")
    elif e.what == "deduplicated" and e.job_id == "-":  # asked before a job id was made
        template = "deduplicated: a submission was answered with {0}"
    else:
        template = SAYS.get(e.what, e.what + " {job}")
    detail = [*e.detail, "", ""]
    if e.what == "accepted" and e.detail:
        detail[0] = f"({e.detail[0]})"
    return template.format(*detail, job=e.job_id).replace(" ()", "").rstrip()  # (no why)


def _now(info: LockInfo | None, events: list[Event]) -> str:
    if info is not None:
        where = f" on {info.worker}" if info.worker else ""
        return f"{info.state}, held by {info.job_id}{where} ({info.task or 'task unknown'})"
    if events and (events[0].what in HOLDING or events[0].detail[:1] == ("throttled",)):
        return "free: its ttl or lease ran out after the last decision (expired)"
    return "free"


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
    """The keys whose history names ``job_id`` (Redis: a SCAN of the histories)."""
    from ..stores.redis import RedisStore
    from ..stores.redis_calls import as_text

    store = target.store
    if not isinstance(store, RedisStore):
        return []
    head = store.prefix + ":{"
    keys = []
    for raw in store.client.scan_iter(match=f"{store.prefix}:{{*}}:log", count=500):
        name = as_text(raw)
        entries = [as_text(e) for e in store.client.lrange(name, 0, -1)]
        if any(f" {job_id} " in f"{entry} " for entry in entries):
            keys.append(name[len(head) : name.rindex("}")])
    return keys
