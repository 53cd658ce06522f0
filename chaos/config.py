"""Constants shared by the app (in the workers and producers) and the orchestrator."""

from __future__ import annotations

#: Seconds. Above the longest store outage of the soak (3 s) plus a heartbeat interval (lease/3)
#: and the store timeout, so a live job keeps its lease through an outage (a lease shorter than
#: the store's outages lapses while its job runs, see docs/guarantees.md); a killed job's key
#: is free again after it.
LEASE = 8.0
TTL = 600  # seconds: far beyond the soak, so a stranded lock is still there to be seen
GRACE = 4  # seconds an unconfirmed enqueue lock lives (taskdedup_grace)
VISIBILITY_TIMEOUT = 5  # seconds before the broker hands an unacked message out again
STORE_TIMEOUT = 1  # seconds one store call may wait: a 3 s stall is an outage, not a delay
QUEUE = "chaos"
STORE_PREFIX = "chaos"
STRATEGIES = ("until_executed", "until_and_while_executing", "while_executing", "until_executing")
#: the newest-wins tasks (docs/strategies/newest-wins.md): debounce, until_executed with
#: on_conflict="supersede", and the same with running="cancel"; each submission carries a seq
#: of its own (``f"{producer}-{counter}"``) that the body records, so the checker can tell
#: whose arguments ran
NEWEST = ("debounce", "supersede", "supersede_cancel")
#: every task of the soak (``chaos.<kind>``)
KINDS = STRATEGIES + NEWEST
#: the tasks that promise never two executions of one key at once (debounce has a run lock,
#: supersede is until_executed)
EXCLUSIVE = STRATEGIES[:3] + NEWEST
#: seconds: debounce's quiet time before a burst's run, and its longest wait from the burst's
#: first submission (short, so the soak's drain is not held up)
DEBOUNCE_DELAY = 0.7
DEBOUNCE_MAX_WAIT = 2.5
RUNS = "runs"  # records server: list of JSON start/end records of the bodies
RUNNING = "running"  # records server: hash pid -> job id of the body running in that process
LEDGER = "ledger"  # records server: list of JSON producer records
PUBLISHED = "published"  # records server: set of job ids kombu published (after_task_publish)
RECEIVED = "received"  # records server: hash job id -> deliveries a worker received
PUBLISHES = "publishes"  # records server: hash job id -> messages kombu published (retries too)
POPPED = "popped"  # records server: hash job id -> messages a worker's kombu took off the broker
#: records server: hash message tag -> JSON {job, t}: every message kombu published, each with a
#: tag of its own (a header set at publish), so that a message is followed, not a count per job
#: (a message the broker restores after a worker died is delivered twice under one tag)
MESSAGES = "messages"
#: records server: hash message tag -> when a worker's kombu last recorded it as unacked (from
#: there the broker gives the message back if the worker dies; before it, a kill loses it)
HELD = "held_messages"
#: records server: hash message tag -> when a worker last acknowledged (or rejected without
#: requeue) it: the message was consumed
ACKED = "acked_messages"
MESSAGE_HEADER = "chaos_message"


def task_name(strategy: str) -> str:
    return f"chaos.{strategy}"


def signature(name: str, seq: str = "", behavior: str = "ok", seconds: float = 0.1) -> None:
    """The tasks' parameters, for computing a key's digest with the public Policy API."""
