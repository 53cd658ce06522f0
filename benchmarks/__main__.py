"""Run every benchmark in one process; print one table, write it to docs/benchmarks.md and the
figures to benchmarks/results/latest.json.

``--quick``: a few rounds only (a smoke run); ``--only core,celery,taskiq,drain,plot,store``:
some groups (core, celery and drain also measure the PostgreSQL and SQLite stores beside the
Redis store, in the same groups, where they can be: see ``sql_stores.py``; plot: enqueue
throughput against producer threads and processes, docs/bench-throughput.png; store: the
store's Redis commands and CPU per enqueue, duplicate and drained job, and what a finished job
leaves, counted on a Redis of its own after the timed groups); ``--no-docs``: leave
docs/benchmarks.md alone. Only a whole run writes the docs' table and latest.json; a partial
one (``--only``, ``--quick``, ``--no-docs``) writes results/probe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks import (
    celery_publish,
    core_latency,
    store_work,
    taskiq_kiq,
    throughput,
    worker_drain,
)
from benchmarks.common import RESULTS, machine, ratios, redis_url, table, update_page
from benchmarks.sql_stores import sql_stores

GROUPS = ("core", "celery", "taskiq", "drain", "plot", "store")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(GROUPS), help=",".join(GROUPS))
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if only - set(GROUPS):
        parser.error(f"unknown group(s) {', '.join(sorted(only - set(GROUPS)))}: {GROUPS}")
    scale = 10 if args.quick else 1
    started = time.strftime("%Y-%m-%d")
    rows = []
    curves: dict[str, object] = {}
    store: dict[str, Any] | None = None
    with redis_url() as url, sql_stores() as sql:
        if "core" in only:
            rows += core_latency.run(url, sql, n=3000 // scale, rounds=2 if args.quick else 10)
        if "celery" in only:
            rows += celery_publish.run(url, n=4000 // scale, rounds=20 // scale or 2, sql=sql)
        if "taskiq" in only:
            rows += taskiq_kiq.run(url, n=4000 // scale, rounds=20 // scale or 2)
        if "drain" in only:
            rows += worker_drain.run(url, n=1000 // scale, rounds=1 if args.quick else 3, sql=sql)
        if "plot" in only:
            curves = throughput.run(url, seconds=0.3 if args.quick else 1.5)
            print(f"throughput plot drawn to {throughput.PLOT}")
        if "store" in only:  # counted, not timed: after the timed groups, on a Redis of its own
            store = store_work.run(url, n=700 // scale, rounds=1 if args.quick else 3)
    about = machine(sql.postgres)
    parts = [table(rows)] if rows else []
    if store is not None:
        parts.append(store_work.text(store))
    text = "\n\n".join(parts)
    note = f"\n\nMeasured {started} by `make bench` on {about['summary']}."
    print(text + note)
    RESULTS.parent.mkdir(exist_ok=True)
    # Only a whole run stands for the docs: a partial one (--only, --quick, --no-docs)
    # goes to probe.json, beside it, so latest.json and the table keep coming from one run.
    whole = only == set(GROUPS) and not args.quick and not args.no_docs
    out = RESULTS if whole else RESULTS.with_name("probe.json")
    figures = [
        {"group": r.group, "operation": r.name, "p50_us": round(r.p50_us, 1),
         "p99_us": round(r.p99_us, 1), "ops_per_s": round(r.ops_per_s), "vs_plain": ratio}
        for r, ratio in zip(rows, ratios(rows), strict=True)
    ]  # fmt: skip
    out.write_text(
        json.dumps(
            {
                "date": started,
                "machine": about,
                "rows": figures,
                "throughput": curves,
                "store_work": store,
            },
            indent=1,
        )
    )
    print(f"figures written to {out}")
    if whole and update_page(text + note):
        print("docs/benchmarks.md benchmark table updated.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
