"""Shared pieces of the benchmarks: a Redis to measure on, timing, and the docs' table."""

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
PAGE = ROOT / "docs" / "benchmarks.md"  # (the docs site's Benchmarks page)
RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
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


def ratios(rows: list[Row]) -> list[float | None]:
    """Each row's speed against the plain framework's row of its group with the same kind of
    arguments (plain p50 / row p50: above 1 is faster than plain); None for the core rows."""
    plain = {}
    for r in rows:
        if r.name.startswith("plain"):
            plain[(r.group, r.name.split(", ", 1)[-1])] = r.p50_us
    found: list[float | None] = []
    for r in rows:
        base = plain.get((r.group, r.name.rsplit(", ", 1)[-1]))
        found.append(None if base is None else round(base / r.p50_us, 2))
    return found


def table(rows: list[Row]) -> str:
    lines = [
        "| group | operation | p50 (µs) | p99 (µs) | ops/s (one client) | vs plain |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r, ratio in zip(rows, ratios(rows), strict=True):
        vs = "" if ratio is None else f"{ratio:.2f}x"
        figures = f"{r.p50_us:.0f} | {r.p99_us:.0f} | {r.ops_per_s:,.0f} | {vs}"
        lines.append(f"| {r.group} | {r.name} | {figures} |")
    return "\n".join(lines)


def machine(postgres: str | None = None) -> dict[str, str]:
    """What the figures were measured on, as a reader needs it to compare (``postgres``: the
    PostgreSQL store's database URL, when its rows were measured)."""
    import platform
    import sqlite3

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if "model name" in line),
        platform.processor() or "?",
    )
    import celery
    import kombu
    import taskiq

    from benchmarks.sql_stores import postgres_version

    about = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "taskiq": getattr(taskiq, "__version__", "?"),
        "sqlite": sqlite3.sqlite_version,
    }
    try:
        about["redis_server"] = redis.Redis().info("server")["redis_version"]
    except redis.RedisError:
        about["redis_server"] = "?"
    servers = f"Redis {about['redis_server']}"
    try:
        version = postgres_version(postgres)
    except Exception:  # the figures stand without it
        version = None
    if version:
        about["postgresql"] = version
        servers += f", PostgreSQL {version}"
    about["summary"] = (
        f"{about['cpu']}, {about['cores']} cores, Python {about['python']}, {servers} "
        f"and RabbitMQ on loopback, SQLite {about['sqlite']}, celery {about['celery']}, "
        f"redis-py {about['redis_py']}"
    )
    return about


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.readlines()
    except OSError:
        return []


def update_page(text: str) -> bool:
    """Put ``text`` between the bench markers of docs/benchmarks.md; False if they are missing."""
    if not PAGE.exists():
        return False
    readme = PAGE.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        return False
    PAGE.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", readme))
    return True
