"""The invariants, computed from what the bodies, the producers and the orchestrator recorded.

Pure functions over plain data, so each detector can be tested on a hand-made history (see
tests/test_chaos.py). Every detector also reports how much it examined: a "0" over nothing is
not a pass.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from typing import Any

SAMPLES = 8
#: seconds: a message's publish is recorded just after it, a consumer's cut-off just after it
CLOCK_SLACK = 0.5
#: seconds around a store outage (stall or stop) within which a submission or a claim may have
#: met it: the store timeout (1 s) and the clock slack. Under an outage taskdedup degrades to
#: plain publishes (G5: no job lost, duplicates may slip through), so the newest-wins promises
#: are demanded only of bursts that met none; those that did are set apart, and counted
FAULT_MARGIN = 1.5
#: seconds: a debounced run starts no earlier than its due time by the store's clock (the same
#: machine's); this much is rounding (ms on the store)
EARLY_SLACK = 0.05
#: the outcomes of a run that ended for good (the body's end record): a success, a final
#: failure, or a stop because a newer submission asked (running="cancel")
FINAL = ("ok", "fail", "superseded")


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
    outcome: str | None  # ok / retry / fail / superseded for ended runs
    seq: str | None = None  # newest-wins tasks: the submission whose arguments it ran

    def brief(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "attempt": self.attempt,
            "fence": self.fence,
            "pid": self.pid,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "ended_by": self.ended_by,
            **({"seq": self.seq} if self.seq is not None else {}),
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
                e.get("seq"),
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
        self.tags: dict[str, list[str]] = defaultdict(list)  # per job: its messages' tags
        for tag, (job, t) in self.messages.items():
            self.sent[job] += 1
            self.tags[job].append(tag)
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
        (docs/guarantees.md): pending releases live in the worker's memory."""
        revoked = self.revoked_at.get(job)
        if revoked is None:
            return False
        # the release is due when a worker learns of the revoke with the message in hand:
        # the revoke, or a moment a worker held or consumed (discarded) one of its messages
        due = [revoked] + [t for t in self.message_times(job) if t >= revoked]
        return any(
            start - 1.0 <= moment <= end
            and any(moment <= t <= end + 1.0 for t in self.worker_deaths)
            for start, end in self.store_outages
            for moment in due
        )

    def message_times(self, job: str) -> list[float]:
        """When a worker held or consumed each message of ``job`` (for the tags kombu
        recorded)."""
        return [
            t
            for tag in self.tags.get(job, ())
            for t in (self.held_messages.get(tag), self.acked_messages.get(tag))
            if t is not None
        ]

    def met_store_fault(self, lo: float, hi: float) -> bool:
        """Whether a store outage (widened by FAULT_MARGIN) meets the span [lo, hi]."""
        return any(
            start - FAULT_MARGIN <= hi and lo <= end + FAULT_MARGIN
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
            "revoked_at": self.revoked_at.get(job),
            "messages_seen": [
                {
                    "published": round(self.messages[tag][1], 3),
                    "held": self.held_messages.get(tag),
                    "consumed": self.acked_messages.get(tag),
                }
                for tag in self.tags.get(job, ())
            ],
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
    finished = {r.job for r in runs if r.ended_by == "end" and r.outcome in FINAL}
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


# ---------------------------------------------------------------------- newest wins


def _by_key(runs: list[Run], tasks: set[str]) -> dict[tuple[str, str], list[Run]]:
    by_key: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: r.start):
        if run.task in tasks:
            by_key[(run.task, run.name)].append(run)
    return by_key


def _first_starts(runs: list[Run]) -> dict[str, float]:
    first: dict[str, float] = {}
    for run in runs:
        first[run.job] = min(first.get(run.job, run.start), run.start)
    return first


def tainted_jobs(runs: list[Run], jobs: Jobs, tasks: set[str]) -> set[str]:
    """The jobs of the newest-wins tasks whose key met a store outage while they lived.

    A job lives from its first submission (or, a job no producer started, its first publish)
    to its last run's end. A key's jobs whose lives overlap (CLOCK_SLACK allowed) form a busy
    period; a period in which any job's life meets a store outage (FAULT_MARGIN allowed) is
    tainted, every job in it too: a plain publish made during the outage runs later, maybe
    long after it (a busy queue), and takes the key from the job then queued (G12: a job sent
    without a lock runs first), so the arguments and bursts of every job around it follow
    other rules until the key is quiet again."""
    life: dict[str, list[float]] = {}
    key_of: dict[str, tuple[str, str]] = {}

    def live(job: str, key: tuple[str, str], lo: float, hi: float) -> None:
        span = life.setdefault(job, [lo, hi])
        span[0], span[1] = min(span[0], lo), max(span[1], hi)
        key_of.setdefault(job, key)

    for e in jobs.ledger:
        if e["ev"] == "submit" and e["task"] in tasks and "job" in e:
            live(e["job"], (e["task"], e["name"]), e["t"], e["t_done"])
    for run in runs:
        if run.task in tasks:
            live(run.job, (run.task, run.name), run.start, run.end)
    for job, t in jobs.messages.values():
        if job in life:
            live(job, key_of[job], t, t)
    by_key: dict[tuple[str, str], list[str]] = defaultdict(list)
    for job, key in key_of.items():
        by_key[key].append(job)
    tainted: set[str] = set()
    for key_jobs in by_key.values():
        key_jobs.sort(key=lambda j: life[j][0])
        period: list[str] = []
        hi = float("-inf")
        for job in [*key_jobs, None]:
            if job is None or life[job][0] > hi + CLOCK_SLACK:
                if any(jobs.met_store_fault(*life[j]) for j in period):
                    tainted.update(period)
                period, hi = [], float("-inf")
            if job is not None:
                period.append(job)
                hi = max(hi, life[job][1])
    return tainted


def lapsed_jobs(runs: list[Run], jobs: Jobs, lapse: dict[str, float]) -> set[str]:
    """Debounced jobs whose first run started more than ``max_wait + grace`` after their
    burst's first submission (``lapse``: task -> those seconds): a re-delivery after a kill -9,
    a busy queue. Until commit 2d47df2 the store let a debounce lock (and with it the burst's
    latest arguments) lapse then, so such a run ran its first submission's arguments and
    dropped the later ones: the soak found that. Their violations are still violations; they
    are counted under a name of their own, so a return of that bug is recognized at once."""
    first = _first_starts([r for r in runs if r.task in lapse])
    out: set[str] = set()
    for job, start in first.items():
        subs = jobs.submits.get(job, [])
        task = subs[0]["task"] if subs else None
        if task in lapse and start > min(e["t"] for e in subs) + lapse[task]:
            out.add(job)
    return out


def _seqs(jobs: Jobs) -> dict[str, dict[str, Any]]:
    """seq -> the submission that carried it (answered or refused)."""
    return {e["seq"]: e for e in jobs.ledger if e["ev"] == "submit" and "seq" in e}


def latest_arguments(
    runs: list[Run], jobs: Jobs, tasks: set[str], lapse: dict[str, float] | None = None
) -> dict[str, Any]:
    """Each run of a newest-wins job J ran the arguments (the seq) of a submission answered
    with J, and no other submission answered with J lies wholly after that one (its ``t``
    after the chosen one's ``t_done``) and wholly before the run's start (CLOCK_SLACK before
    it): the latest submission the job could have seen. A run of a job no producer started
    (supersede's hand-off, published by the worker when the job before it ended) takes its
    candidates from the submissions answered with the job that ran before it on that key,
    sent after that job's first start (the duplicates that owed one more run). A retry's run
    (attempt > 0) is only checked to run a candidate's arguments. Runs of jobs in a busy period
    of their key that met a store outage (:func:`tainted_jobs`) are set apart, and counted;
    violations by debounced jobs whose run came past max_wait + grace (:func:`lapsed_jobs`)
    are counted under a name of their own, ``lapsed_count`` (still violations)."""
    seqs = _seqs(jobs)
    first = _first_starts(runs)
    tainted = tainted_jobs(runs, jobs, tasks)
    lapsed = lapsed_jobs(runs, jobs, lapse or {})
    found: list[dict[str, Any]] = []
    by_lapse: list[dict[str, Any]] = []
    examined = handoffs = retries = set_apart = 0
    by_task: dict[str, int] = defaultdict(int)
    for (task, name), key_runs in _by_key(runs, tasks).items():
        for run in key_runs:
            candidates = [e for e in jobs.submits.get(run.job, []) if "seq" in e]
            handoff = not any(not e["dedup"] for e in candidates)
            before = None
            if handoff:
                earlier = [
                    r for r in key_runs if r.job != run.job and first[r.job] < first[run.job]
                ]
                before = max(earlier, key=lambda r: first[r.job]).job if earlier else None
                if before is not None:
                    since = first[before] - CLOCK_SLACK
                    owed = [
                        e
                        for e in jobs.submits.get(before, [])
                        if "seq" in e and e["dedup"] and e["t"] >= since
                    ]
                    candidates = owed + candidates
            if run.job in tainted or before in tainted:
                set_apart += 1
                continue
            examined += 1
            by_task[task] += 1
            handoffs += handoff
            retries += run.attempt > 0
            chosen = seqs.get(run.seq or "")
            problem = None
            if chosen is None or all(e["seq"] != chosen["seq"] for e in candidates):
                problem = "ran the arguments of no submission answered with its job"
                if handoff and before is None:
                    problem = "a job no producer started, with no job before it on its key"
            elif run.attempt == 0:
                newer = [
                    e
                    for e in candidates
                    if e["t"] > chosen["t_done"] and e["t_done"] < run.start - CLOCK_SLACK
                ]
                if newer:
                    problem = f"stale: {len(newer)} newer submission(s) came before it started"
                    chosen = {**chosen, "newer": [e["seq"] for e in newer][:4]}
            if problem is not None:
                (by_lapse if run.job in lapsed else found).append(
                    {
                        "problem": problem,
                        "task": task,
                        "name": name,
                        "run": run.brief(),
                        "handoff_of": before,
                        "chosen": chosen,
                        "candidates": [(e["seq"], round(e["t"], 3)) for e in candidates][-6:],
                        **jobs.about(run.job),
                    }
                )
    return {
        "count": len(found),
        "runs_examined": examined,
        "runs_examined_by_task": dict(by_task),
        "handoff_runs_examined": handoffs,
        "retry_runs_examined": retries,
        "set_apart_store_fault": set_apart,
        "samples": found[:SAMPLES],
        "lapsed_count": len(by_lapse),
        "lapsed_samples": by_lapse[:SAMPLES],
    }


def one_run_per_burst(
    runs: list[Run],
    jobs: Jobs,
    tasks: set[str],
    delay: float,
    max_wait: float,
    lapse: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Debounce: a burst (the submissions answered with one job id) runs once.

    - no job id has two successful runs (a kill's re-delivery is a run cut short, a retry's
      run follows a run that asked for it);
    - no run belongs to a job id no producer was answered with (a duplicate gets no run of
      its own), and no submission's seq ended successfully under two job ids;
    - a burst's run starts no earlier than its due time: ``delay`` after the latest
      submission answered with it that completed before the run (``max_wait`` after the
      first, if sooner), by the store's clock, so never before the burst is over;
    - two bursts of one key start at least ``delay`` apart (the next burst's first
      submission comes after the previous job's claim), CLOCK_SLACK allowed.

    Jobs (and pairs) of a key's busy period that met a store outage (:func:`tainted_jobs`)
    are set apart, and counted; a close pair whose earlier job ran past max_wait + grace
    (:func:`lapsed_jobs`) is counted under a name of its own, ``lapsed_count``."""
    by_key = _by_key(runs, tasks)
    first = _first_starts([r for key_runs in by_key.values() for r in key_runs])
    tainted = tainted_jobs(runs, jobs, tasks)
    lapsed = lapsed_jobs(runs, jobs, lapse or {})
    close_lapsed: list[dict[str, Any]] = []
    late: list[float] = []  # first start after the burst's first submission, past max_wait
    twice: list[dict[str, Any]] = []
    orphans: list[dict[str, Any]] = []
    early: list[dict[str, Any]] = []
    close: list[dict[str, Any]] = []
    seq_jobs: dict[str, set[str]] = defaultdict(set)
    lags: list[float] = []
    examined = jobs_examined = set_apart = pairs = pairs_apart = 0
    for (task, name), key_runs in by_key.items():
        job_runs: dict[str, list[Run]] = defaultdict(list)
        for run in key_runs:
            job_runs[run.job].append(run)
            if run.ended_by == "end" and run.outcome == "ok" and run.seq:
                seq_jobs[run.seq].add(run.job)
        for job, its_runs in job_runs.items():
            subs = jobs.submits.get(job, [])
            if job in tainted:
                set_apart += 1
                continue
            jobs_examined += 1
            examined += len(its_runs)
            brief = {"task": task, "name": name, "job": job, **jobs.about(job)}
            if not subs:
                orphans.append({**brief, "runs": [r.brief() for r in its_runs]})
                continue
            oks = [r for r in its_runs if r.ended_by == "end" and r.outcome == "ok"]
            if len(oks) > 1:
                twice.append({**brief, "runs": [r.brief() for r in its_runs]})
            start = first[job]
            late.append(start - min(e["t"] for e in subs) - max_wait)
            before = [e for e in subs if e["t_done"] < start]
            if before:
                due = min(max(e["t"] for e in before) + delay, min(e["t"] for e in subs) + max_wait)
                lags.append(start - due)
                if start < due - EARLY_SLACK:
                    early.append({**brief, "start": round(start, 3), "due": round(due, 3)})
        ordered = sorted(job_runs, key=lambda j: first[j])
        for earlier, later in itertools.pairwise(ordered):
            a, b = first[earlier], first[later]
            if earlier in tainted or later in tainted:
                pairs_apart += 1
                continue
            pairs += 1
            if b - a < delay - CLOCK_SLACK:
                (close_lapsed if earlier in lapsed else close).append(
                    {
                        "task": task,
                        "name": name,
                        "earlier": earlier,
                        "later": later,
                        "apart_s": round(b - a, 3),
                    }
                )
    # a seq that ran under two jobs of which one met a store outage is set apart: a call the
    # stalled store answered too late was published as a job of its own (G5) and yet folded
    # into the burst when the store woke (docs/strategies/newest-wins.md)
    twice_all = {seq: sorted(ids) for seq, ids in seq_jobs.items() if len(ids) > 1}
    twice_seqs = {seq: ids for seq, ids in twice_all.items() if not tainted.intersection(ids)}
    lags.sort()
    return {
        "count": len(twice) + len(orphans) + len(twice_seqs) + len(early) + len(close),
        "runs_examined": examined,
        "jobs_examined": jobs_examined,
        "set_apart_store_fault": set_apart,
        "jobs_run_twice": len(twice),
        "runs_of_jobs_no_producer_got": len(orphans),
        "seqs_run_under_two_jobs": len(twice_seqs),
        "seqs_run_under_two_jobs_set_apart_store_fault": len(twice_all) - len(twice_seqs),
        "runs_before_due": len(early),
        "bursts_started_within_delay": len(close),
        "burst_pairs_compared": pairs,
        "burst_pairs_set_apart_store_fault": pairs_apart,
        "start_after_due_s": {
            "median": round(lags[len(lags) // 2], 3) if lags else None,
            "max": round(lags[-1], 3) if lags else None,
        },
        # how often a burst's run came past its max_wait + grace (the store's life for its
        # lock, which keeps the latest arguments): see docs/strategies/newest-wins.md
        "start_past_max_wait_s": {
            "over_0": sum(1 for x in late if x > 0),
            "max": round(max(late), 3) if late else None,
        },
        "samples": (twice + orphans + early + close)[:SAMPLES]
        + [{"seq": s, "jobs": j} for s, j in list(twice_seqs.items())[:SAMPLES]],
        "lapsed_count": len(close_lapsed),
        "lapsed_samples": close_lapsed[:SAMPLES],
        "jobs_run_after_their_lock_lapsed": len(lapsed & set(first)),
    }


def newest_ran(
    runs: list[Run], jobs: Jobs, tasks: set[str], lapse: dict[str, float] | None = None
) -> dict[str, Any]:
    """Nothing newer is dropped: for each answered submission of a newest-wins task, a run
    of its key that ended for good ran its arguments or those of a later submission of that
    key (a queued job's duplicate, a duplicate owed a run after the running job, or the next
    burst). Excused: submissions answered with a revoked or expired job (docs: a revoke
    drops the job and the duplicates it answered for), or with a job lost in the broker
    transport. Set apart: submissions answered with a job of a key's busy period that met a
    store outage (:func:`tainted_jobs`). Under a name of their own (``lapsed_count``, still
    violations): submissions answered with a debounced job whose run came past max_wait +
    grace (:func:`lapsed_jobs`)."""
    seqs = _seqs(jobs)
    tainted = tainted_jobs(runs, jobs, tasks)
    lapsed = lapsed_jobs(runs, jobs, lapse or {})
    by_lapse: list[dict[str, Any]] = []
    newest: dict[tuple[str, str], float] = {}  # key -> t of the latest submission that ran
    for run in runs:
        chosen = seqs.get(run.seq or "")
        if run.task in tasks and run.ended_by == "end" and run.outcome in FINAL and chosen:
            key = (run.task, run.name)
            newest[key] = max(newest.get(key, chosen["t"]), chosen["t"])
    missing: list[dict[str, Any]] = []
    examined = excused = set_apart = 0
    for e in jobs.ledger:
        if e["ev"] != "submit" or e["task"] not in tasks or "job" not in e:
            continue
        if e["job"] in tainted:
            set_apart += 1
            continue
        if e["job"] in jobs.revoked or jobs.about(e["job"])["result"] == "REVOKED":
            excused += 1
            continue
        if jobs.lost_in_transport(e["job"]):
            excused += 1
            continue
        examined += 1
        if newest.get((e["task"], e["name"]), float("-inf")) < e["t"]:
            item = {k: e.get(k) for k in ("task", "name", "seq", "job", "dedup", "t")}
            (by_lapse if e["job"] in lapsed else missing).append(item)
    return {
        "count": len(missing),
        "submissions_examined": examined,
        "excused_revoked_or_lost_in_transport": excused,
        "set_apart_store_fault": set_apart,
        "samples": missing[:SAMPLES],
        "lapsed_count": len(by_lapse),
        "lapsed_samples": by_lapse[:SAMPLES],
    }
