"""One producer process: submits jobs for ``--seconds`` and records each answer in the ledger.

Usage (the orchestrator starts it): ``python -m chaos.producer --id 0 --seconds 60 --rate 4``.
Each submission picks a strategy and one of a few hundred names (a hot fifth of them gets half
the traffic, so duplicates are common), sometimes repeats itself at once (a double click),
sometimes carries a countdown or a short ``expires``, and sometimes is revoked a moment later.
Every answer goes to the ledger: the job id returned, whether it was deduplicated, or the
error (``StoreUnavailable`` under ``on_store_error="raise"``, a broker error while the broker
restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from . import app as chaos_app

WEIGHTS = {
    "until_executed": 0.35,
    "until_and_while_executing": 0.25,
    "while_executing": 0.12,
    "until_executing": 0.28,
}
BEHAVIORS = {"ok": 0.74, "flaky1": 0.08, "flaky2": 0.06, "fail": 0.12}


def pick(weights: dict[str, float], rng: random.Random) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


class Producer:
    def __init__(self, ident: int, names: int, rng: random.Random) -> None:
        self.ident = ident
        self.names = names
        self.rng = rng
        self.revokes: list[tuple[float, str]] = []
        self.records = chaos_app.records

    def ledger(self, entry: dict[str, Any]) -> None:
        entry["producer"] = self.ident
        self.records.rpush(chaos_app.LEDGER, json.dumps(entry))

    def submit_one(self) -> None:
        rng = self.rng
        strategy = pick(WEIGHTS, rng)
        hot = max(1, self.names // 5)
        index = rng.randrange(hot) if rng.random() < 0.5 else rng.randrange(self.names)
        name = f"k{index}"
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
        entry["t"] = time.time()
        try:
            if mode == "delay" and self.rng.random() < 0.5:
                result = task.delay(name, behavior, seconds)
            else:
                result = task.apply_async((name, behavior, seconds), **options)
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
    while time.monotonic() < end:
        producer.submit_one()
        producer.revoke_due()
        time.sleep(producer.rng.expovariate(args.rate))
    producer.revoke_due(everything=True)
    done = {"ev": "producer_done", "producer": args.id}
    chaos_app.records.rpush(chaos_app.LEDGER, json.dumps(done))


if __name__ == "__main__":
    main()
