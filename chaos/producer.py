"""One producer process: submits jobs for ``--seconds`` and records each answer in the ledger.

Usage (the orchestrator starts it): ``python -m chaos.producer --id 0 --seconds 60 --rate 4``.
Each submission picks a strategy and one of a few hundred names (a hot fifth of them gets half
the traffic, so duplicates are common), sometimes repeats itself at once (a double click),
sometimes carries a countdown or a short ``expires``, and sometimes is revoked a moment later.
Every answer goes to the ledger: the job id returned, whether it was deduplicated, or the
error (``StoreUnavailable`` under ``on_store_error="raise"``, a broker error while the broker
restarts).

A share of the traffic goes to the newest-wins tasks (debounce, supersede, supersede with
running="cancel") in bursts: several submissions of one name a fraction of a second apart
(sometimes a longer gap, so a burst splits or meets its job running), each with a seq of its
own (``f"{producer}-{counter}"``) in its arguments and in its ledger record.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import time
from typing import Any

from . import app as chaos_app
from .config import NEWEST

WEIGHTS = {
    "until_executed": 0.28,
    "until_and_while_executing": 0.2,
    "while_executing": 0.1,
    "until_executing": 0.22,
    "debounce": 0.11,
    "supersede": 0.07,
    "supersede_cancel": 0.02,
}
BEHAVIORS = {"ok": 0.74, "flaky1": 0.08, "flaky2": 0.06, "fail": 0.12}
#: the newest-wins tasks: the latest submission's behavior is the one that runs
NEWEST_BEHAVIORS = {"ok": 0.84, "flaky1": 0.08, "fail": 0.08}
#: submissions in one burst of a newest-wins task
BURST = {1: 0.15, 2: 0.25, 3: 0.25, 4: 0.2, 6: 0.15}


def pick(weights: dict[str, float], rng: random.Random) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


class Producer:
    def __init__(self, ident: int, names: int, rng: random.Random) -> None:
        self.ident = ident
        self.names = names
        self.rng = rng
        self.revokes: list[tuple[float, str]] = []
        self.records = chaos_app.records
        self.seqs = itertools.count()
        #: the later submissions of bursts: (when, order, send arguments), a heap
        self.bursts: list[tuple[float, int, tuple[Any, ...]]] = []
        self.order = itertools.count()

    def ledger(self, entry: dict[str, Any]) -> None:
        entry["producer"] = self.ident
        self.records.rpush(chaos_app.LEDGER, json.dumps(entry))

    def submit_one(self) -> None:
        rng = self.rng
        strategy = pick(WEIGHTS, rng)
        hot = max(1, self.names // 5)
        index = rng.randrange(hot) if rng.random() < 0.5 else rng.randrange(self.names)
        name = f"k{index}"
        if strategy in NEWEST:
            self.burst(strategy, name)
            return
        behavior = pick(BEHAVIORS, rng)
        seconds = round(0.05 + rng.random() ** 2 * 0.95, 3)
        options: dict[str, Any] = {}
        roll = rng.random()
        mode = "delay"
        if roll < 0.12:
            mode, options["countdown"] = "countdown", round(rng.uniform(0.5, 3.0), 2)
        elif roll < 0.20:
            mode, options["expires"] = "expires", round(rng.uniform(0.5, 2.0), 2)
        elif roll < 0.26:
            mode = "revoke"
        repeats = 1 + (rng.randrange(1, 4) if rng.random() < 0.2 else 0)
        for _ in range(repeats):
            self.send(strategy, name, behavior, seconds, mode, options)

    def burst(self, strategy: str, name: str) -> None:
        """A burst of one name of a newest-wins task: the first submission now, the others
        a moment apart (sent by :meth:`send_due`), each with a seq and behavior of its own.
        Debounce gets no countdown, expires or revoke (its run's time is the burst's); the
        supersede task sometimes a countdown (including_scheduled) or a revoke of its first
        job. The cancel task works 1-2.5 s: a worker renews its leases every lease/3 (2.7 s),
        which brings the stop request, so a run sees it when a renewal falls within it (a
        longer body would hold the soak's four pool processes up)."""
        rng = self.rng
        count = int(pick({str(k): v for k, v in BURST.items()}, rng))
        mode, options = "delay", {}
        if strategy == "supersede":
            roll = rng.random()
            if roll < 0.12:
                mode, options = "countdown", {"countdown": round(rng.uniform(0.5, 2.0), 2)}
            elif roll < 0.18:
                mode = "revoke"
        at = time.monotonic()
        for i in range(count):
            if strategy == "supersede_cancel":
                seconds = round(rng.uniform(1.0, 2.5), 3)
            else:
                seconds = round(0.05 + rng.random() ** 2 * 0.35, 3)
            call = (strategy, name, pick(NEWEST_BEHAVIORS, rng), seconds)
            item = (*call, mode if i == 0 or mode != "revoke" else "delay", options)
            if i == 0:
                self.send(*item)
                continue
            # mostly inside the debounce delay (one burst), sometimes past it
            at += rng.uniform(0.05, 0.5) if rng.random() < 0.8 else rng.uniform(0.8, 1.6)
            heapq.heappush(self.bursts, (at, next(self.order), item))

    def send_due(self, everything: bool = False) -> None:
        while self.bursts and (everything or self.bursts[0][0] <= time.monotonic()):
            at, _, item = heapq.heappop(self.bursts)
            if everything:
                time.sleep(max(0.0, at - time.monotonic()))
            self.send(*item)

    def next_burst(self) -> float:
        return self.bursts[0][0] if self.bursts else float("inf")

    def send(
        self,
        strategy: str,
        name: str,
        behavior: str,
        seconds: float,
        mode: str,
        options: dict[str, Any],
    ) -> None:
        task = chaos_app.TASKS[strategy]
        entry: dict[str, Any] = {
            "ev": "submit",
            "task": task.name,
            "strategy": strategy,
            "name": name,
            "behavior": behavior,
            "mode": mode,
            "on_store_error": os.environ.get("TASKDEDUP_ON_STORE_ERROR", "enqueue"),
            **options,
        }
        args: tuple[Any, ...] = (name, behavior, seconds)
        if strategy in NEWEST:
            entry["seq"] = f"{self.ident}-{next(self.seqs)}"
            args = (name, entry["seq"], behavior, seconds)
        entry["t"] = time.time()
        try:
            if mode == "delay" and self.rng.random() < 0.5:
                result = task.delay(*args)
            else:
                result = task.apply_async(args, **options)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            entry["t_done"] = time.time()
            self.ledger(entry)
            return
        entry["t_done"] = time.time()
        entry["job"] = result.id
        entry["dedup"] = bool(getattr(result, "deduplicated", False))
        self.ledger(entry)
        if mode == "revoke" and not entry["dedup"]:
            self.revokes.append((time.time() + self.rng.uniform(0.1, 2.0), result.id))

    def revoke_due(self, everything: bool = False) -> None:
        now = time.time()
        due = [item for item in self.revokes if everything or item[0] <= now]
        self.revokes = [item for item in self.revokes if item not in due]
        for _, job in due:
            entry: dict[str, Any] = {"ev": "revoke", "job": job, "t": time.time()}
            try:
                chaos_app.app.control.revoke(job)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            self.ledger(entry)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--rate", type=float, required=True, help="submissions per second")
    parser.add_argument("--names", type=int, required=True, help="names per strategy")
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    producer = Producer(args.id, args.names, random.Random(args.seed))
    end = time.monotonic() + args.seconds
    next_new = time.monotonic()
    while time.monotonic() < end:
        if time.monotonic() >= next_new:
            producer.submit_one()
            next_new = time.monotonic() + producer.rng.expovariate(args.rate)
        producer.send_due()
        producer.revoke_due()
        time.sleep(max(0.0, min(next_new, producer.next_burst()) - time.monotonic()))
    producer.send_due(everything=True)  # the bursts under way end as planned
    producer.revoke_due(everything=True)
    done = {"ev": "producer_done", "producer": args.id}
    chaos_app.records.rpush(chaos_app.LEDGER, json.dumps(done))


if __name__ == "__main__":
    main()
