"""What the demo's jobs record, so the demo can check what really ran.

Each run appends ``start`` and ``end`` entries (job id, arguments, pid, time) to a Redis list
per name; the demo reads them back. A job may also wait at a *gate* (a Redis key the demo sets)
so that it is surely still running while the demo submits duplicates: no timing guesses.
Every key lives under ``demo-marks:``, apart from taskdedup's own keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, cast

import redis

#: taskdedup's key prefix in the demo (the workers' and the CLI's ``--prefix``).
PREFIX = "demo"
#: The journal's own keys.
MARKS = "demo-marks"
#: A gate left shut this long is a broken demo: the job gives up rather than hang.
GATE_TIMEOUT = 30.0


def url() -> str:
    """The private Redis, passed to the workers by the demo."""
    return os.environ["DEMO_REDIS_URL"]


@dataclass(frozen=True)
class Entry:
    """One line of a run log."""

    event: str  # "start" or "end"
    job: str
    args: list[Any]
    pid: int
    at: float


class Journal:
    """Run logs and gates on the private Redis."""

    def __init__(self, redis_url: str | None = None) -> None:
        self.client = redis.Redis.from_url(redis_url or url())

    def record(self, name: str, event: str, job: str, *args: Any) -> None:
        entry = {"event": event, "job": job, "args": list(args), "pid": os.getpid()}
        self.client.rpush(f"{MARKS}:runs:{name}", json.dumps({**entry, "at": time.time()}))

    def runs(self, name: str) -> list[Entry]:
        raw = cast("list[bytes]", self.client.lrange(f"{MARKS}:runs:{name}", 0, -1))
        return [Entry(**json.loads(line)) for line in raw]

    def open_gate(self, name: str) -> None:
        self.client.set(f"{MARKS}:gate:{name}", 1)

    def open_all_gates(self) -> None:
        """At the end, and after a failure: a job still waiting goes on, so that its worker's
        warm shutdown need not wait for it (nothing to do if Redis is gone)."""
        with contextlib.suppress(redis.RedisError):
            self.client.set(f"{MARKS}:gates-open", 1)

    def gate_open(self, name: str) -> bool:
        return bool(self.client.exists(f"{MARKS}:gate:{name}", f"{MARKS}:gates-open"))

    def wait_gate(self, name: str) -> None:
        """Block until the demo opens the gate (a Celery job)."""
        deadline = time.monotonic() + GATE_TIMEOUT
        while not self.gate_open(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {name!r} never opened")
            time.sleep(0.02)

    async def await_gate(self, name: str) -> None:
        """Wait until the demo opens the gate without blocking the event loop (a taskiq job:
        taskdedup renews its lease from that loop)."""
        deadline = time.monotonic() + GATE_TIMEOUT
        while not self.gate_open(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {name!r} never opened")
            await asyncio.sleep(0.02)

    def ready(self, worker: str) -> None:
        self.client.set(f"{MARKS}:ready:{worker}", os.getpid())

    def is_ready(self, worker: str) -> bool:
        return bool(self.client.exists(f"{MARKS}:ready:{worker}"))

    def close(self) -> None:
        self.client.close()
