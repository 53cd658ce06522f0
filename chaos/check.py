"""The invariants, computed from what the bodies, the producers and the orchestrator recorded.

Pure functions over plain data, so each detector can be tested on a hand-made history (see
tests/test_chaos.py). Every detector also reports how much it examined: a "0" over nothing is
not a pass.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

SAMPLES = 8
#: seconds: a message's publish is recorded just after it, a consumer's cut-off just after it
CLOCK_SLACK = 0.5


@dataclasses.dataclass
class Run:
    """One execution of a task body, from its start record to its end (or its kill)."""

    run: str
    task: str
    name: str
    job: str
    attempt: int
    fence: int | None
    pid: int
    start: float
    end: float
    ended_by: str  # "end" (the body returned or raised), "kill", or "open" (neither)
    outcome: str | None  # ok / retry / fail for ended runs

    def brief(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "attempt": self.attempt,
            "fence": self.fence,
            "pid": self.pid,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "ended_by": self.ended_by,
        }


def build_runs(
    events: list[dict[str, Any]], kills: list[dict[str, Any]], now: float
) -> tuple[list[Run], dict[str, int]]:
    """Pair start and end records; a run with no end ends when its process was killed, or is
    'open' (it ends ``now``, the most pessimistic choice for the overlap check)."""
    ends = {e["run"]: e for e in events if e["ev"] == "end"}
    killed_at: dict[int, float] = {}
    for kill in kills:
        for pid in kill["pids"]:
            killed_at.setdefault(pid, kill["t"])
    runs: list[Run] = []
    tally = {"end": 0, "kill": 0, "open": 0}
    for e in events:
        if e["ev"] != "start":
            continue
        end = ends.get(e["run"])
        if end is not None:
            stop, how, outcome = end["t"], "end", end["outcome"]
        elif e["pid"] in killed_at and killed_at[e["pid"]] >= e["t"]:
            stop, how, outcome = killed_at[e["pid"]], "kill", None
        else:
            stop, how, outcome = now, "open", None
        tally[how] += 1
        runs.append(
            Run(
                e["run"],
                e["task"],
                e["name"],
                e["job"],
                e["attempt"],
                e["fence"],
                e["pid"],
                e["t"],
                stop,
                how,
                outcome,
            )
        )
    return runs, tally


@dataclasses.dataclass
class Jobs:
    """What is known of each job id besides its runs: how callers got it, the worker's
    result, whether kombu published it and how often a worker received it."""

    ledger: list[dict[str, Any]]
    states: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    published: set[str] = dataclasses.field(default_factory=set)
    received: dict[str, int] = dataclasses.field(default_factory=dict)
    #: only once the broker is empty is a message no worker received known to be lost
    drained: bool = True
    #: per job id: messages kombu published, and messages a worker's kombu took off the broker
    publishes: dict[str, int] = dataclasses.field(default_factory=dict)
    popped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: when a worker's broker consumer was cut off: its whole worker killed or found dead, or
    #: the broker restarted under it
    consumer_kills: list[float] = dataclasses.field(default_factory=list)
    #: every message kombu published: its tag -> (job id, when)
    messages: dict[str, tuple[str, float]] = dataclasses.field(default_factory=dict)
    #: per message tag: when a worker's kombu last recorded it as unacked (held), and when a
    #: worker last consumed it (acknowledged, or rejected without requeue)
    held_messages: dict[str, float] = dataclasses.field(default_factory=dict)
    acked_messages: dict[str, float] = dataclasses.field(default_factory=dict)
    #: when the store could not answer (stalled or stopped), and when a whole worker was
    #: killed or found dead
    store_outages: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    worker_deaths: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.submits: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.revoked: set[str] = set()
        for entry in self.ledger:
            if entry["ev"] == "submit" and "job" in entry:
                self.submits[entry["job"]].append(entry)
            elif entry["ev"] == "revoke" and "error" not in entry:
                self.revoked.add(entry["job"])
        self.revoked |= {job for job, st in self.states.items() if st.get("status") == "REVOKED"}
        self.revoked_at = {e["job"]: e["t"] for e in self.ledger if e["ev"] == "revoke"}
        #: per job: when each of its messages not consumed was last seen (published or held)
        self.unconsumed: dict[str, list[float]] = defaultdict(list)
        self.sent: dict[str, int] = defaultdict(int)
        for tag, (job, t) in self.messages.items():
            self.sent[job] += 1
            held = self.held_messages.get(tag)
            acked = self.acked_messages.get(tag)
            if acked is not None and (held is None or acked >= held):
                continue
            self.unconsumed[job].append(max(t, held or 0.0))

    def lost_in_transport(self, job: str) -> bool:
        """A message of this job that kombu published was never consumed by a worker
        (acknowledged, or rejected for good), and a worker's consumer was cut off (its worker
        killed or dead, or the broker restarted) after the message was last seen: published,
        or held as unacked by a worker that then died (the broker gave it back). Once the broker
        is empty, such a message was taken off it by a consumer cut off before it recorded the
        message as unacked: kombu's Redis transport does that in a second command, so the
        message is lost (celery/celery#4354, #7950). Followed message by message (each carries
        a tag of its own), so a message the broker gave back and delivered again does not hide
        another that was lost. Any other loss counts against taskdedup."""
        if not self.drained or self.about(job)["result"] in ("SUCCESS", "FAILURE"):
            return False
        return any(
            kill >= seen - CLOCK_SLACK
            for seen in self.unconsumed.get(job, ())
            for kill in self.consumer_kills
        )

    def release_died_with_its_worker(self, job: str) -> bool:
        """A revoked job whose worker could not tell the store (it was stalled or stopped)
        and was killed before the store answered again: the release it kept to send when
        the store is back died with it, and the key lapses after its ttl. A known limit
        (README, *Guarantees*): pending releases live in the worker's memory."""
        revoked = self.revoked_at.get(job)
        if revoked is None:
            return False
        return any(
            start - 1.0 <= revoked <= end
            and any(revoked <= t <= end + 1.0 for t in self.worker_deaths)
            for start, end in self.store_outages
        )

    def about(self, job: str | None) -> dict[str, Any]:
        if job is None:
            return {}
        subs = self.submits.get(job, [])
        fresh = [e for e in subs if not e["dedup"]]
        first = fresh[0] if fresh else (subs[0] if subs else None)
        info: dict[str, Any] = {
            "submitted": round(first["t"], 3) if first else None,
            "mode": first["mode"] if first else None,
            "fresh": bool(fresh),
            "on_store_error": first.get("on_store_error") if first else None,
            "duplicates_answered": len(subs) - len(fresh),
            "published": job in self.published,
            "publishes": self.publishes.get(job, 0),
            "popped": self.popped.get(job, 0),
            "messages": self.sent.get(job, 0),
            "messages_not_consumed": len(self.unconsumed.get(job, ())),
            "received": self.received.get(job, 0),
            "revoked": job in self.revoked,
            "result": (self.states.get(job) or {}).get("status"),
        }
        return info


def overlaps(runs: list[Run], exclusive_tasks: set[str], jobs: Jobs) -> dict[str, Any]:
    """Two executions of one key at once (any job ids, a job beside its own copy included),
    for the strategies that promise none. Also: fencing tokens that go backwards among runs
    that had one, and runs that had none (fence 0: ran without the lock)."""
    by_key: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        if run.task in exclusive_tasks:
            by_key[(run.task, run.name)].append(run)
    found: list[dict[str, Any]] = []
    regressions: list[dict[str, Any]] = []
    unfenced = 0
    compared = 0
    for (task, name), key_runs in by_key.items():
        key_runs.sort(key=lambda r: r.start)
        for i, later in enumerate(key_runs):
            if not later.fence:
                unfenced += 1
            for earlier in key_runs[:i]:
                compared += 1
                if earlier.end > later.start:
                    found.append(
                        {
                            "task": task,
                            "name": name,
                            "overlap_s": round(min(earlier.end, later.end) - later.start, 3),
                            "first": {**earlier.brief(), **jobs.about(earlier.job)},
                            "second": {**later.brief(), **jobs.about(later.job)},
                        }
                    )
            fenced = [r for r in key_runs[:i] if r.fence and r.job != later.job]
            if later.fence and fenced:
                newest = max(fenced, key=lambda r: r.fence or 0)
                if newest.fence and later.fence < newest.fence:
                    regressions.append(
                        {
                            "task": task,
                            "name": name,
                            "earlier": newest.brief(),
                            "later": {**later.brief(), **jobs.about(later.job)},
                        }
                    )
    return {
        "count": len(found),
        "keys_with_overlap": len({(f["task"], f["name"]) for f in found}),
        "keys_examined": len(by_key),
        "runs_examined": sum(len(v) for v in by_key.values()),
        "pairs_compared": compared,
        "samples": found[:SAMPLES],
        "runs_without_fence": unfenced,
        "fence_regressions": len(regressions),
        "fence_regression_samples": regressions[:SAMPLES],
    }


def unfinished(runs: list[Run], jobs: Jobs) -> dict[str, Any]:
    """Every job id a producer was handed (fresh or as a duplicate's holder) must have run to
    its end: success or final failure, recorded by the body. Excused: a job the worker dropped
    as revoked or expired (its result is REVOKED). Counted apart, and not against taskdedup:
    a job kombu published that no worker ever received (lost in the broker transport)."""
    finished = {r.job for r in runs if r.ended_by == "end" and r.outcome in ("ok", "fail")}
    missing: list[dict[str, Any]] = []
    transport: list[dict[str, Any]] = []
    excused = 0
    for job, entries in jobs.submits.items():
        if job in finished:
            continue
        about = jobs.about(job)
        if about["result"] == "REVOKED":
            excused += 1
            continue
        item = {
            "job": job,
            "task": entries[0]["task"],
            "name": entries[0]["name"],
            **about,
            "result_detail": str((jobs.states.get(job) or {}).get("result"))[:200],
            "runs": [(r.attempt, r.ended_by, r.outcome) for r in runs if r.job == job],
        }
        if jobs.lost_in_transport(job):
            transport.append(item)
        else:
            missing.append(item)
    return {
        "count": len(missing),
        "jobs_examined": len(jobs.submits),
        "fresh_jobs": sum(1 for subs in jobs.submits.values() if any(not e["dedup"] for e in subs)),
        "finished": len(finished & set(jobs.submits)),
        "excused_revoked_or_expired": excused,
        "samples": missing[:SAMPLES],
        "lost_in_transport": len(transport),
        "lost_in_transport_samples": transport[:SAMPLES],
    }


def still_held(
    held: list[dict[str, Any]],
    digests: dict[str, tuple[str, str]],
    jobs: Jobs,
    runs: list[Run],
) -> dict[str, Any]:
    """Keys the store still holds after the queues drained and one lease (+ grace) passed;
    those whose holder is a revoked or expired job are counted apart as well. Not counted: a
    key whose holder's message the broker transport lost (no worker ever saw it, so no library
    can free it before its ttl)."""
    samples: list[dict[str, Any]] = []
    revoked_held: list[dict[str, Any]] = []
    transport: list[dict[str, Any]] = []
    died: list[dict[str, Any]] = []
    for record in held:
        task, name = digests.get(record["digest"], ("?", "?"))
        item = {**record, "task": task, "name": name, **jobs.about(record.get("job"))}
        if record.get("job") and jobs.lost_in_transport(record["job"]):
            transport.append(item)
            continue
        if record.get("job") and jobs.release_died_with_its_worker(record["job"]):
            died.append(item)
            continue
        samples.append(item)
        if record.get("job") in jobs.revoked:
            revoked_held.append(item)
    return {
        "count": len({h["digest"] for h in samples}),
        "records": len(held),
        "held_by_jobs_lost_in_transport": len(transport),
        "held_by_revoked_jobs_whose_release_died_with_its_worker": len(died),
        "release_died_samples": died[:SAMPLES],
        "samples": samples[:SAMPLES],
        "revoked_count": len({h["digest"] for h in revoked_held}),
        "revoked_samples": revoked_held[:SAMPLES],
    }
