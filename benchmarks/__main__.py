"""Run every benchmark in one process and print (and put in README.md) one table."""

from __future__ import annotations

import platform
import sys
import time

from benchmarks import celery_publish, core_latency, taskiq_kiq
from benchmarks.common import redis_url, table, update_readme


def main() -> int:
    started = time.strftime("%Y-%m-%d")
    with redis_url() as url:
        rows = core_latency.run(url) + celery_publish.run(url) + taskiq_kiq.run(url)
    text = table(rows)
    note = (
        f"\n\nMeasured {started} by `make bench` on {platform.machine()} "
        f"(Python {platform.python_version()}, Redis on loopback)."
    )
    print(text + note)
    if "--no-readme" not in sys.argv and update_readme(text + note):
        print("README.md benchmark table updated.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
