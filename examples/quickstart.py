"""taskdedup in one screen, on the in-memory store (no server needed).

Run it with ``make demo``. It walks one key through the lock's life: a job is enqueued and
acquires the lock, two resubmissions are deduplicated onto it, a worker claims it, a
redelivered copy is refused, and when the job finishes the key is free again.
"""

from __future__ import annotations

from taskdedup import Deduplicator, MemoryStore, Policy, Settings


def send_invoice(customer_id: int, month: str = "2026-11") -> None:
    """The task body; taskdedup only needs its signature to build keys."""


def main() -> None:
    dedup = Deduplicator(MemoryStore(), Settings())
    policy = Policy("until_executed", ttl=3600, lease=30).bind("billing.send_invoice", send_invoice)

    first = dedup.enqueue(policy, (42,), job_id="job-1")
    print(f"enqueue send_invoice(42)             -> {first.outcome}: publish {first.job_id}")
    dedup.published(first)

    again = dedup.enqueue(policy, (), {"customer_id": 42}, job_id="job-2")
    print(f"enqueue send_invoice(customer_id=42) -> deduplicated onto {again.job_id}")
    third = dedup.enqueue(policy, (42, "2026-11"), job_id="job-3")
    print(f"enqueue send_invoice(42, '2026-11')  -> deduplicated onto {third.job_id}")
    other = dedup.enqueue(policy, (7,), job_id="job-4")
    print(f"enqueue send_invoice(7)              -> {other.outcome}: publish {other.job_id}")

    assert first.key is not None
    run = dedup.claim(policy, "job-1", key=first.key)
    print(f"worker claims job-1                  -> {run.outcome} (fencing token {run.fence})")
    copy = dedup.claim(policy, "job-1", key=first.key)
    print(f"broker redelivers job-1              -> {copy.outcome}: not run twice")

    done = dedup.finish(policy, first.key, "job-1")
    print(f"job-1 finishes                       -> lock released: {done.released}")
    fresh = dedup.enqueue(policy, (42,), job_id="job-5")
    print(f"enqueue send_invoice(42) again       -> {fresh.outcome}: publish {fresh.job_id}")

    print(f"decisions counted: {dict(sorted(dedup.stats.items()))}")
    dedup.close()


if __name__ == "__main__":
    main()
