"""Shared pieces of the benchmarks: a Redis to measure on, timing, and the README table."""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


@dataclass
class Row:
    group: str
    name: str
    samples_ns: list[int]

    @property
    def p50_us(self) -> float:
        return statistics.median(self.samples_ns) / 1000

    @property
    def p99_us(self) -> float:
        ordered = sorted(self.samples_ns)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000

    @property
    def ops_per_s(self) -> float:
        return len(self.samples_ns) / (sum(self.samples_ns) / 1e9)


def measure(group: str, name: str, n: int, step: Callable[[int], object]) -> Row:
    """Time ``step(i)`` for i in range(n), one sample per call, after a short warm-up."""
    for i in range(min(50, n)):
        step(-1 - i)
    samples = []
    clock = time.perf_counter_ns
    for i in range(n):
        start = clock()
        step(i)
        samples.append(clock() - start)
    return Row(group, name, samples)


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """REDIS_URL, else 127.0.0.1:6379 if it answers, else a private redis-server."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    local = "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(local, socket_connect_timeout=0.5).ping()
        yield local
        return
    except redis.RedisError:
        pass
    sys.path.insert(0, str(ROOT / "tests"))
    from redis_server import PrivateRedis  # type: ignore[import-not-found]

    with PrivateRedis() as server:
        yield server.url


def table(rows: list[Row]) -> str:
    lines = [
        "| group | operation | p50 (µs) | p99 (µs) | ops/s (one client) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.group} | {r.name} | {r.p50_us:.0f} | {r.p99_us:.0f} | {r.ops_per_s:,.0f} |"
        )
    return "\n".join(lines)


def update_readme(text: str) -> bool:
    """Put ``text`` between the bench markers of README.md; False if the markers are missing."""
    if not README.exists():
        return False
    readme = README.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        return False
    README.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", readme))
    return True
