"""The store contract: every arrow and every expiry of the lock diagram, on any store.

Each scenario takes a ``h`` fixture: a :class:`~taskdedup.testing.harness.Harness` around the
store under test. To hold a store of your own to the contract, import the scenarios into a test
module and give them a harness::

    import pytest
    from taskdedup.testing.contract import *  # noqa: F403  (the scenarios)
    from taskdedup.testing.harness import MemoryHarness, assert_records_expire

    @pytest.fixture
    def h():
        harness = MemoryHarness("my-prefix")  # or a Harness subclass around your store
        yield harness
        assert_records_expire(harness)  # G9: every record the scenario wrote expires

taskdedup's own suite runs them on the memory store, on Redis and on a SQLite store written on
the record seam (tests/test_store_contract.py).
"""

from __future__ import annotations

import asyncio
import uuid

from ..idempotency import record_key
from ..stores.base import (
    HISTORY_SIZE,
    RENEWED,
    SUPERSEDED,
    Acquire,
    Claim,
    ClaimReply,
    Confirm,
    Consume,
    Finish,
    ForceUnlock,
    Heartbeat,
    History,
    Inspect,
    JobState,
    Lease,
    ListScopes,
    ListSlots,
    MarkTick,
    Pace,
    Peek,
    Release,
    Remember,
    Reserve,
    ReserveAll,
    Retry,
    Scan,
    UnmarkTick,
    Unreserve,
)
from .harness import Harness, race

HOUR = 3_600_000


def new_key() -> str:
    return uuid.uuid4().hex


def claim(key: str, job: str, mode: str = "hold", **kw: object) -> Claim:
    args: dict[str, object] = {
        "owner": "w1",
        "lease_ms": 30_000,
        "ttl_ms": HOUR,
        "lock": mode,
        "run_lock": False,
        "memory_ms": HOUR,
    }
    args.update(kw)
    return Claim(key, job, **args)  # type: ignore[arg-type]


def acquire(key: str, job: str, ttl_ms: int = HOUR, **kw: object) -> Acquire:
    return Acquire(key, job, ttl_ms, kw.pop("grace_ms", ttl_ms), **kw)  # type: ignore[arg-type]


def test_acquire_then_duplicates_learn_the_holder(h: Harness) -> None:
    k = new_key()
    first = h.store.run(acquire(k, "A"))
    assert first.acquired and first.holder == "A" and first.fence > 0
    dup = h.store.run(acquire(k, "B"))
    assert not dup.acquired and dup.holder == "A" and dup.fence == first.fence
    assert h.store.run(acquire(k, "C")).duplicates == 2
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "A" and info.state == "queued"
    assert info.duplicates == 2


def test_hold_while_running_then_release_on_finish(h: Harness) -> None:
    k = new_key()
    fence = h.store.run(acquire(k, "A")).fence
    got = h.store.run(claim(k, "A", "hold", lease_ms=5_000))
    assert got.outcome == "run" and got.fence == fence and got.attempts == 1
    info = h.store.run(Inspect(k))
    assert info is not None and info.state == "running" and info.ttl_ms <= 5_000
    assert h.store.run(acquire(k, "B")).holder == "A"
    done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    assert done.released and done.handoff is None
    assert h.store.run(Inspect(k)) is None
    assert h.store.run(acquire(k, "C")).acquired


def test_a_lock_names_its_task_since_when_its_worker_and_attempts(h: Harness) -> None:
    """What the tools show of a lock (``taskdedup locks``): the task whose job took it and
    since when; once the job runs, its worker and attempts; a run lock names them too."""
    k = new_key()
    h.store.run(acquire(k, "A", task="ci.build"))
    queued = h.store.run(Inspect(k))
    assert queued is not None and queued.task == "ci.build" and queued.since_ms
    assert queued.worker is None and queued.attempts == 0
    h.store.run(claim(k, "A", "hold", owner="host:42", task="ci.build"))
    running = h.store.run(Inspect(k))
    assert running is not None and running.state == "running"
    assert running.task == "ci.build" and running.since_ms == queued.since_ms
    assert running.worker == "host:42" and running.attempts == 1
    r = new_key()
    h.store.run(claim(r, "R", "none", run_lock=True, owner="host:7", task="ci.deploy"))
    only_run = h.store.run(Inspect(r))
    assert only_run is not None and only_run.running_job == "R"
    assert only_run.task == "ci.deploy" and only_run.worker == "host:7" and only_run.since_ms


def test_a_keys_history_says_what_was_decided_newest_first(h: Harness) -> None:
    """``taskdedup explain``: each decision a person asks about, with the jobs it concerns,
    newest first and bounded. The ordinary life of a job (accepted, started, released) is not
    written there: the lock and the job's record tell it, and the hot path pays nothing."""
    k = new_key()
    h.store.run(acquire(k, "A", task="ci.build"))
    h.store.run(acquire(k, "B"))  # duplicates are counted on the lock, with the last one's id
    h.store.run(acquire(k, "B2"))
    assert h.store.run(History(k)) == []  # (a duplicate writes nothing more)
    h.store.run(Peek(k, record_duplicate=True))  # asked first: no job id made for it
    h.store.run(acquire(k, "B3"))
    h.store.run(claim(k, "A", "hold", owner="host:1"))
    h.store.run(claim(k, "C", "hold", owner="host:2"))  # a stale copy: the key is A's
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))  # the lock ends: one line
    h.store.run(claim(k, "A", "hold", owner="host:3"))  # a copy of the finished job
    seen = [(e.what, e.job_id, e.detail) for e in h.store.run(History(k))]
    assert seen == [
        ("copy_dropped", "A", ()),
        ("deduplicated", "B3", ("A", "4")),
        ("waited", "C", ("A",)),
    ]
    times = [e.at_ms for e in h.store.run(History(k))]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    h.store.run(acquire(k, "D", grace_ms=60_000))
    h.store.run(Release(k, "D", why="publish_failed"))  # never published: no trace
    h.store.run(acquire(k, "E"))
    h.store.run(Confirm(((k, "E"),)))
    h.store.run(Release(k, "E", why="revoked"))
    h.store.run(acquire(k, "F"))
    h.store.run(ForceUnlock(k))
    latest = [(e.what, e.job_id, e.detail) for e in h.store.run(History(k))][:3]
    assert latest == [
        ("unlocked", "F", ("operator",)),
        ("freed", "E", ("revoked",)),
        ("copy_dropped", "A", ()),
    ]
    for n in range(30):
        h.store.run(acquire(k, f"holder-{n}"))
        h.store.run(acquire(k, f"dup-{n}"))
        h.store.run(ForceUnlock(k))
    assert len(h.store.run(History(k))) == HISTORY_SIZE
    assert h.store.run(History(new_key())) == []


def test_a_hand_off_whose_publish_failed_is_written_as_freed(h: Harness) -> None:
    """The history names a handed-off job (rescheduled to), so its failed publish is written
    too, unlike a fresh lock's, which no entry names."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(acquire(k, "B", payload="[]"))
    h.store.run(claim(k, "A", "hold"))
    done = h.store.run(Finish(k, "A", False, HOUR, handoff_job_id="H", grace_ms=60_000))
    assert done.handoff is not None and done.handoff.job_id == "H"
    h.store.run(Release(k, "H", why="publish_failed"))
    seen = [(e.what, e.job_id, e.detail) for e in h.store.run(History(k))][:2]
    assert seen == [("freed", "H", ("publish_failed",)), ("finished", "A", ("rescheduled", "H"))]


def test_the_ordinary_life_of_a_job_leaves_only_its_record(h: Harness) -> None:
    """G17: a job enqueued, confirmed, run and finished leaves one record behind (its own,
    for the redelivery guard), no history and no counter; a failed publish leaves nothing."""
    for mode in ("release", "hold"):
        k = new_key()
        assert h.store.run(acquire(k, "A", grace_ms=60_000)).acquired
        h.store.run(Confirm(((k, "A"),)))
        assert h.store.run(claim(k, "A", mode)).outcome == "run"
        h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
        assert h.store.run(History(k)) == []
        assert _parts_of(h, k) == ["job:A"], mode
    failed = new_key()
    h.store.run(acquire(failed, "A", grace_ms=60_000))
    h.store.run(Release(failed, "A", why="publish_failed"))
    assert _parts_of(h, failed) == []


def _parts_of(h: Harness, key: str) -> list[str]:
    """The records the store keeps for dedup key ``key`` (``lock``, ``job:<id>``, ...)."""
    tag = "{" + key + "}:"
    return sorted(name.split(tag, 1)[1] for name in h.record_ttls() if tag in name)


def test_until_executing_releases_at_start(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    assert h.store.run(claim(k, "A", "release")).outcome == "run"
    assert h.store.run(Inspect(k)) is None
    assert h.store.run(acquire(k, "B")).acquired


def test_heartbeat_keeps_a_running_lock_past_its_lease(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", "hold", lease_ms=600))
    for _ in range(4):
        h.hold_for(0.3)
        assert h.store.run(Heartbeat((Lease(k, "A", 600),))) == (True,)
    assert h.store.run(acquire(k, "B")).holder == "A"
    # G4: heartbeats stop (the worker died): the key is free after the lease, not the ttl
    h.after(0.6, lambda: h.store.run(acquire(k, "C")).acquired)


def test_lapsed_lease_lets_the_same_job_take_over_up_to_max_attempts(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    assert h.store.run(claim(k, "A", lease_ms=300, max_attempts=2)).attempts == 1
    # a redelivered copy while the holder is alive does not run beside it (G7)
    live = h.store.run(claim(k, "A", lease_ms=300, owner="w2", max_attempts=2))
    assert live.outcome == "running" and live.holder == "w1"
    second = h.after(
        0.3,
        lambda: (
            r
            if (r := h.store.run(claim(k, "A", lease_ms=300, owner="w2", max_attempts=2))).outcome
            == "run"
            else None
        ),
    )
    assert second.attempts == 2 and second.holder == "w2"
    third = h.after(
        0.3,
        lambda: (
            r
            if (r := h.store.run(claim(k, "A", lease_ms=300, owner="w3", max_attempts=2))).outcome
            != "running"
            else None
        ),
    )
    assert third.outcome == "exhausted"
    assert h.store.run(claim(k, "A", owner="w4")).outcome == "done"


def test_a_stale_copy_never_runs_beside_the_newer_job_of_its_key(h: Harness) -> None:
    # G12: A's lease lapses (its worker died); B takes the key. A copy of A then waits while B
    # runs, and runs after it with a newer fence.
    k = new_key()
    h.store.run(acquire(k, "A"))
    a = h.store.run(claim(k, "A", lease_ms=300))
    b = h.after(0.3, lambda: r if (r := h.store.run(acquire(k, "B"))).acquired else None)
    assert b.fence > a.fence
    running_b = h.store.run(claim(k, "B", lease_ms=60_000, owner="w3"))
    assert running_b.outcome == "run"
    waiting = h.store.run(claim(k, "A", lease_ms=300, owner="w2"))
    assert waiting.outcome == "busy" and waiting.holder == "B"
    h.store.run(Finish(k, "B", throttle=False, memory_ms=HOUR))
    after = h.store.run(claim(k, "A", lease_ms=60_000, owner="w2"))
    assert after.outcome == "run" and after.fence > running_b.fence


def test_a_copy_runs_first_when_the_newer_job_is_still_queued_and_that_one_waits(
    h: Harness,
) -> None:
    # B holds the key but is only queued (it may be far behind in the queue, or lost): the
    # stale copy of A runs now and takes the key; B waits for A when it starts (G12), so the
    # two never overlap and a lost B cannot keep A waiting for ever.
    k = new_key()
    b = h.store.run(acquire(k, "B"))
    a = h.store.run(claim(k, "A", lease_ms=60_000, owner="w2"))
    assert a.outcome == "run" and a.fence > b.fence
    assert h.store.run(acquire(k, "C")).holder == "A"  # while A runs, the key is A's
    waiting = h.store.run(claim(k, "B", lease_ms=60_000, owner="w3"))
    assert waiting.outcome == "busy" and waiting.holder == "A"
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    later = h.store.run(claim(k, "B", lease_ms=60_000, owner="w3"))
    assert later.outcome == "run" and later.fence > a.fence


def test_a_job_of_a_throttled_key_runs(h: Harness) -> None:
    # until_expired's throttle is not a running job: a job sent without a lock runs
    k = new_key()
    h.store.run(acquire(k, "B"))
    h.store.run(claim(k, "B", lease_ms=5_000))
    h.store.run(Finish(k, "B", throttle=True, memory_ms=HOUR))
    assert h.store.run(claim(k, "unlocked", lease_ms=5_000)).outcome == "run"


def test_a_holder_being_published_is_answered_pending_until_confirmed_or_running(
    h: Harness,
) -> None:
    # its publish may still fail and free the key: a duplicate must not settle for it yet
    k = new_key()
    h.store.run(acquire(k, "A", grace_ms=60_000))
    first = h.store.run(acquire(k, "B"))
    assert first.pending and first.holder == "A" and first.duplicates == 1
    peek = h.store.run(Peek(k))
    assert peek is not None and peek.pending and peek.duplicates == 1  # not counted again
    h.store.run(Confirm(((k, "A"),)))
    assert not h.store.run(acquire(k, "C")).pending
    k2 = new_key()
    h.store.run(acquire(k2, "A", grace_ms=60_000))
    h.store.run(claim(k2, "A"))  # it runs, so it was published, confirmed or not
    assert not h.store.run(acquire(k2, "B")).pending


def test_run_lock_tokens_follow_the_order_of_the_runs_not_of_the_enqueues(h: Harness) -> None:
    # until_and_while_executing: A runs, B is enqueued and waits its turn, A retries and runs
    # again; then B runs. The token each run reads grows from run to run (G3), although B's
    # enqueue lock was taken before A's second run.
    k = new_key()
    h.store.run(acquire(k, "A"))
    a = h.store.run(claim(k, "A", "release", run_lock=True, lease_ms=60_000, attempt=0))
    h.store.run(acquire(k, "B"))
    assert h.store.run(claim(k, "B", "release", run_lock=True)).outcome == "busy"
    h.store.run(Retry(k, "A", HOUR, attempt=0))
    again = h.store.run(claim(k, "A", "release", run_lock=True, lease_ms=60_000, attempt=1))
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=1))
    b = h.store.run(claim(k, "B", "release", run_lock=True, lease_ms=60_000))
    assert [r.outcome for r in (a, again, b)] == ["run"] * 3
    assert a.fence < again.fence < b.fence


def test_redelivery_of_a_finished_job_does_not_run_again(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", "release"))
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    again = h.store.run(claim(k, "A", "release", owner="w2"))
    assert again.outcome == "done"


def test_retry_keeps_the_lock_and_is_not_a_duplicate_of_itself(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", attempt=0))
    assert h.store.run(Retry(k, "A", HOUR, attempt=0)) is True
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "A" and info.state == "queued"
    assert h.store.run(acquire(k, "B")).holder == "A"
    again = h.store.run(claim(k, "A", attempt=1))
    assert again.outcome == "run" and again.attempts == 2


def test_a_retry_delivered_while_its_attempt_is_recorded_running_waits_for_it(h: Harness) -> None:
    """The retried message arrives while attempt 0 is still recorded as running (its retry
    hook has not reached the store yet): it waits rather than run beside what may still be a
    live run, and runs once attempt 0's hooks are in; attempt 0's late finish is stale."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", attempt=0))
    assert h.store.run(claim(k, "A", attempt=1, owner="w2")).outcome == "running"
    assert h.store.run(Retry(k, "A", HOUR, attempt=0)) is True
    assert h.store.run(claim(k, "A", attempt=1, owner="w2")).outcome == "run"
    assert h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=0)).stale
    info = h.store.run(Inspect(k))
    assert info is not None and info.state == "running" and info.job_id == "A"
    assert h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=1)).released


def test_a_later_attempt_never_runs_beside_a_live_run_of_an_earlier_one(h: Harness) -> None:
    """Found by the soak (CI): attempt 1 ran and its retry reached the broker, not the store
    (it was down); its record lapsed; a stale copy of attempt 0 then ran, and the retry,
    attempt 2, arrived while it ran. A higher attempt number does not make a run newer than
    a live one: it waits for it."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    assert h.store.run(claim(k, "A", "release", attempt=1, lease_ms=1_000)).outcome == "run"
    h.after(1, lambda: h.store.run(JobState(k, "A")) == "none")  # attempt 1's record lapsed
    assert h.store.run(claim(k, "A", "release", attempt=0, owner="w2")).outcome == "run"
    assert h.store.run(claim(k, "A", "release", attempt=2, owner="w3")).outcome == "running"


def test_a_copy_of_an_attempt_that_asked_for_a_retry_waits_for_that_retry(h: Harness) -> None:
    """The broker delivered attempt 0 again (a visibility timeout shorter than the run) while
    it ran; attempt 0 then failed and its retry was published. The copy must not run now: the
    retry is the job's next run, and the two would run at once (found by the soak)."""
    for mode in ("hold", "release", "none"):
        k = new_key()
        h.store.run(acquire(k, "A"))
        assert h.store.run(claim(k, "A", mode, attempt=0)).outcome == "run"
        assert h.store.run(claim(k, "A", mode, attempt=0, owner="w2")).outcome == "running"
        h.store.run(Retry(k, "A", HOUR, attempt=0))
        assert h.store.run(claim(k, "A", mode, attempt=0, owner="w2")).outcome == "running"
        assert h.store.run(claim(k, "A", mode, attempt=1, owner="w3")).outcome == "run"
        assert h.store.run(claim(k, "A", mode, attempt=0, owner="w2")).outcome == "running"
        h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=1))
        assert h.store.run(claim(k, "A", mode, attempt=0, owner="w2")).outcome == "done"


def test_a_retry_confirmed_keeps_its_lock_and_copies_wait_one_never_sent_frees_both(
    h: Harness,
) -> None:
    """The retry's publish is confirmed as a fresh lock's is (G11). Confirmed: the lock lives
    its ttl and a copy of the failed attempt waits for the retry until it is due (plus the
    grace). Never confirmed (the worker died between the store's answer and the publish):
    after the grace the lock is free and the copy runs, so the job is neither lost nor stuck
    for the ttl."""
    sent, lost = new_key(), new_key()
    for k in (sent, lost):
        h.store.run(acquire(k, "A"))
        assert h.store.run(claim(k, "A", attempt=0)).outcome == "run"
        assert h.store.run(Retry(k, "A", HOUR, attempt=0, grace_ms=2_000, delay_ms=10_000))
    assert h.store.run(Confirm(((sent, "A"),))) == 1

    def after_grace() -> bool:
        info = h.store.run(Inspect(lost))
        return info is None or info.job_id != "A"

    h.after(2, after_grace)
    confirmed = h.store.run(Inspect(sent))
    assert confirmed is not None and confirmed.state == "queued" and confirmed.ttl_ms > 60_000
    assert h.store.run(claim(sent, "A", attempt=0, owner="w2")).outcome == "running"
    assert h.store.run(claim(lost, "A", attempt=0, owner="w2")).outcome == "run"


def test_a_copy_replaces_a_retry_that_never_came_and_the_late_retry_does_not_run_beside_it(
    h: Harness,
) -> None:
    """The retry went out, but the broker lost it (or it is very late): once it is overdue
    (its delay plus the grace), the waiting copy runs in its stead. The retry, should it come
    after all, finds the job running, then done: never two runs at once."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", attempt=0))
    h.store.run(Retry(k, "A", HOUR, attempt=0, grace_ms=1_000, delay_ms=1_000))
    h.store.run(Confirm(((k, "A"),)))
    assert h.store.run(claim(k, "A", attempt=0, owner="w2")).outcome == "running"
    h.after(2, lambda: h.store.run(claim(k, "A", attempt=0, owner="w2")).outcome == "run")
    assert h.store.run(claim(k, "A", attempt=1, owner="w3")).outcome == "running"
    done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=0))  # the copy's
    assert done.released and not done.stale
    assert h.store.run(claim(k, "A", attempt=1, owner="w3")).outcome == "done"


def test_a_jobs_record_says_running_queued_finished_or_none(h: Harness) -> None:
    k, lapsed = new_key(), new_key()
    assert h.store.run(JobState(k, "A")) == "none"
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", attempt=0))
    assert h.store.run(JobState(k, "A")) == "running"
    h.store.run(Retry(k, "A", HOUR, attempt=0))
    assert h.store.run(JobState(k, "A")) == "queued"
    h.store.run(claim(k, "A", attempt=1))
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, attempt=1))
    assert h.store.run(JobState(k, "A")) == "finished"
    h.store.run(acquire(lapsed, "B"))
    h.store.run(claim(lapsed, "B", lease_ms=1_000))
    h.after(1, lambda: h.store.run(JobState(lapsed, "B")) == "none")  # its worker died


def test_reschedule_once_hands_the_lock_to_one_new_job_with_the_latest_payload(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A"))
    h.store.run(acquire(k, "B", payload="args-1"))
    h.store.run(acquire(k, "C", payload="args-2"))
    done = h.store.run(
        Finish(
            k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="N", ttl_ms=HOUR, grace_ms=HOUR
        )
    )
    assert done.released and done.handoff is not None
    assert (done.handoff.job_id, done.handoff.payload) == ("N", "args-2")
    info = h.store.run(Inspect(k))
    assert info is not None and (info.job_id, info.state, info.duplicates) == ("N", "queued", 0)
    # the rescheduled job ends with no duplicates: released, no second hand-off
    h.store.run(claim(k, "N"))
    last = h.store.run(Finish(k, "N", throttle=False, memory_ms=HOUR, handoff_job_id="M"))
    assert last.released and last.handoff is None
    assert h.store.run(Inspect(k)) is None


def test_reschedule_owed_at_start_is_handed_off_by_the_claim(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(acquire(k, "B", payload="p"))
    got = h.store.run(claim(k, "A", "release", handoff_job_id="N"))
    assert got.outcome == "run" and got.handoff is not None and got.handoff.job_id == "N"
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "N"


def test_until_expired_throttles_until_the_ttl(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A", ttl_ms=800))
    h.store.run(claim(k, "A", ttl_ms=800))
    assert h.store.run(Finish(k, "A", throttle=True, memory_ms=HOUR)).released
    info = h.store.run(Inspect(k))
    assert info is not None and info.state == "throttled"
    assert h.store.run(acquire(k, "B")).holder == "A"
    h.after(0.8, lambda: h.store.run(acquire(k, "C")).acquired)


def test_queued_lock_expires_after_its_ttl(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A", ttl_ms=400))
    assert h.store.run(acquire(k, "B")).holder == "A"
    h.after(0.4, lambda: h.store.run(acquire(k, "C")).acquired)


def test_unconfirmed_lock_lives_only_its_grace_and_a_confirmed_one_its_ttl(h: Harness) -> None:
    dead, ok = new_key(), new_key()
    h.store.run(acquire(dead, "A", ttl_ms=HOUR, grace_ms=400))
    h.store.run(acquire(ok, "B", ttl_ms=HOUR, grace_ms=400))
    assert h.store.run(Confirm(((ok, "B"), (dead, "not-the-holder")))) == 1
    info = h.store.run(Inspect(ok))
    assert info is not None and info.confirmed and info.ttl_ms > 60_000
    h.after(0.4, lambda: h.store.run(acquire(dead, "C")).acquired)
    assert h.store.run(acquire(ok, "D")).holder == "B"


def test_while_executing_runs_one_job_of_a_key_at_a_time(h: Harness) -> None:
    k = new_key()
    assert h.store.run(claim(k, "A", "none", run_lock=True)).outcome == "run"
    busy = h.store.run(claim(k, "B", "none", run_lock=True))
    assert busy.outcome == "busy" and busy.holder == "A"
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    assert h.store.run(claim(k, "B", "none", run_lock=True)).outcome == "run"


def test_until_and_while_executing_frees_enqueue_but_not_running(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    assert h.store.run(claim(k, "A", "release", run_lock=True)).outcome == "run"
    assert h.store.run(acquire(k, "B")).acquired
    assert h.store.run(claim(k, "B", "release", run_lock=True)).outcome == "busy"
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    assert h.store.run(claim(k, "B", "release", run_lock=True)).outcome == "run"


def debounced(key: str, job: str, delay_ms: int, wait_ms: int, **kw: object) -> Acquire:
    """An enqueue of a debounced key: its run is due ``delay_ms`` after the latest submission,
    at most ``wait_ms`` after the burst's first."""
    return acquire(key, job, debounce_ms=delay_ms, wait_ms=wait_ms, **kw)  # type: ignore[arg-type]


def started(h: Harness, op: Claim, outcome: str = "run") -> ClaimReply | None:
    """The claim's reply once it is ``outcome``; None while the run is not due (early)."""
    reply = h.store.run(op)
    assert reply.outcome in (outcome, "early"), reply
    return reply if reply.outcome == outcome else None


def test_a_debounced_burst_runs_once_when_quiet_with_its_latest_arguments(h: Harness) -> None:
    """Every submission of a burst is answered with its first job; that job's delivery comes
    back while a later submission keeps moving the run (early), then runs once, with the
    latest arguments, and a submission after its start begins the next burst."""
    k = new_key()
    assert h.store.run(debounced(k, "A", 300, 30_000)).acquired
    for n in range(3):
        dup = h.store.run(debounced(k, f"B{n}", 300, 30_000, payload=f"args-{n}"))
        assert not dup.acquired and dup.holder == "A"
    early = h.store.run(claim(k, "A", "release", run_lock=True, latest=True))
    assert early.outcome == "early" and 0 < early.wait_ms <= 300
    assert h.store.run(JobState(k, "A")) == "none"  # nothing written: it did not start
    ran = h.after(0.3, lambda: started(h, claim(k, "A", "release", run_lock=True, latest=True)))
    assert ran.arguments == "args-2"
    told = h.store.run(History(k))  # (explain: "3 submissions were debounced onto A")
    assert [(e.what, e.job_id, e.detail) for e in told] == [("debounced", "B2", ("A", "3"))]
    nxt = h.store.run(debounced(k, "C", 300, 30_000))  # while A runs: the next burst
    assert nxt.acquired
    busy = h.after(
        0.3, lambda: started(h, claim(k, "C", "release", run_lock=True, latest=True), "busy")
    )
    assert busy.holder == "A"  # never beside the run
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    again = h.store.run(claim(k, "C", "release", run_lock=True, latest=True))
    assert again.outcome == "run" and again.arguments is None  # its own, nobody moved it
    assert h.store.run(claim(k, "A", "release", run_lock=True, latest=True)).outcome == "done"


def test_a_debounced_key_that_never_goes_quiet_runs_by_its_max_wait(h: Harness) -> None:
    k = new_key()
    h.store.run(debounced(k, "A", 400, 500))
    h.hold_for(0.2)
    h.store.run(debounced(k, "B", 400, 500, payload="b"))  # due: min(now + 400, first + 500)
    early = h.store.run(claim(k, "A", "release", run_lock=True, latest=True))
    assert early.outcome == "early" and early.wait_ms <= 300  # capped, not moved to +400
    h.hold_for(0.25)
    h.store.run(debounced(k, "C", 400, 500, payload="c"))
    ran = h.after(0.06, lambda: started(h, claim(k, "A", "release", run_lock=True, latest=True)))
    assert ran.arguments == "c"


def test_a_submission_racing_a_debounced_runs_start_is_never_lost(h: Harness) -> None:
    """A submission and the claim of the burst's due job, at the same instant: either the
    submission came first (it is folded in: the job runs, now or at its new due time, with its
    arguments) or the run took the key first (the submission starts the next burst)."""
    folded = started_next = 0
    for n in range(20):
        k = new_key()
        h.store.run(debounced(k, "A", 20, 30_000))
        h.hold_for(0.03)  # A's run is due

        def step(i: int, k: str = k, n: int = n) -> object:
            if i == 0:
                return h.store.run(claim(k, "A", "release", run_lock=True, latest=True))
            return h.store.run(debounced(k, f"B{n}", 20, 30_000, payload=f"b{n}"))

        ran, sub = race(2, step)
        assert isinstance(ran, ClaimReply) and not isinstance(sub, ClaimReply)
        if sub.acquired:  # type: ignore[attr-defined]
            started_next += 1
            assert ran.outcome == "run" and ran.arguments is None
            continue
        folded += 1
        assert sub.holder == "A"  # type: ignore[attr-defined]
        if ran.outcome == "early":
            again = claim(k, "A", "release", run_lock=True, latest=True)
            ran = h.after(0.02, lambda op=again: started(h, op))  # type: ignore[misc]
        assert ran.outcome == "run" and ran.arguments == f"b{n}"
    assert folded + started_next == 20


def test_a_debounced_holder_not_yet_confirmed_is_not_an_answer(h: Harness) -> None:
    """G11 holds for debounce too: a burst's first job whose publish is not confirmed is
    answered as pending, so a later submission is not folded into a job that may never be."""
    k = new_key()
    h.store.run(debounced(k, "A", 300, 30_000, grace_ms=60_000))
    assert h.store.run(debounced(k, "B", 300, 30_000, payload="b")).pending
    h.store.run(Confirm(((k, "A"),)))
    dup = h.store.run(debounced(k, "B", 300, 30_000, payload="b"))
    assert not dup.pending and dup.holder == "A"


def test_supersede_runs_the_queued_job_with_the_latest_arguments_then_owes_one_run(
    h: Harness,
) -> None:
    """on_conflict='supersede' (until_executed): submissions while the job waits replace its
    arguments (it keeps its place: its own message runs them); once it runs, a submission
    owes one more run, with its arguments, after it (as reschedule_once)."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(acquire(k, "B", payload="b"))
    h.store.run(acquire(k, "C", payload="c"))
    ran = h.store.run(claim(k, "A", "hold", latest=True))
    assert ran.outcome == "run" and ran.arguments == "c"
    info = h.store.run(Inspect(k))
    assert info is not None and info.duplicates == 0  # consumed by the run
    told = [(e.what, e.job_id, e.detail) for e in h.store.run(History(k))]
    assert told == [("superseded", "C", ("A", "2"))]  # (explain: "superseded by ... C")
    quiet = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="H"))
    assert quiet.released and quiet.handoff is None  # nothing came while it ran
    h.store.run(acquire(k, "A2"))
    h.store.run(claim(k, "A2", "hold", latest=True))
    h.store.run(acquire(k, "D", payload="d"))  # while A2 runs
    done = h.store.run(Finish(k, "A2", throttle=False, memory_ms=HOUR, handoff_job_id="H2"))
    assert done.handoff is not None and done.handoff.job_id == "H2"
    assert done.handoff.payload == "d"


def test_a_run_taken_over_after_its_worker_died_runs_the_latest_arguments_again(
    h: Harness,
) -> None:
    """The run that took a burst's or a superseded job's latest arguments died (its lease
    lapsed): the copy that takes over runs those arguments too, not its message's first ones
    (the job's record keeps them)."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(acquire(k, "B", payload="b"))
    first = h.store.run(claim(k, "A", "hold", latest=True, lease_ms=300))
    assert first.arguments == "b"
    op = claim(k, "A", "hold", latest=True)
    again = h.after(0.3, lambda: (reply := h.store.run(op)).outcome == "run" and reply)
    assert again.arguments == "b" and again.attempts == 2


def test_a_copy_taking_a_supersede_key_from_a_newer_queued_job_keeps_each_ones_arguments(
    h: Harness,
) -> None:
    """A's worker died while A ran and owed a run (N came meanwhile); A's lock lapsed; B took
    the free key and C superseded B's arguments while B waited; then A's copy is delivered and
    runs first (G12: B may never come). A's copy runs N's arguments (its owed run); B, when it
    comes, runs C's (its own newest), not its first, and nothing is handed on twice. (Found by
    the soak: A's copy inherited B's kept arguments and handed them on, and B ran stale.)"""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", "hold", latest=True, lease_ms=300))
    h.store.run(acquire(k, "N", payload="n"))  # while A runs: owed
    h.hold_for(0.35)  # A's worker died: its lock lapsed with the lease
    assert h.store.run(acquire(k, "B")).acquired  # the key was free
    h.store.run(Confirm(((k, "B"),)))
    h.store.run(acquire(k, "C", payload="c"))  # supersedes B's arguments
    copy = h.store.run(claim(k, "A", "hold", latest=True, handoff_job_id="H"))
    assert copy.outcome == "run" and copy.arguments == "n"  # A's own newest, not C's
    done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="H"))
    assert done.handoff is None  # B's arguments are not A's to hand on
    b = h.store.run(claim(k, "B", "hold", latest=True))
    assert b.outcome == "run" and b.arguments == "c"  # B runs its newest


def test_a_supersede_racing_the_claim_runs_its_arguments_exactly_once(h: Harness) -> None:
    """A submission and the claim of the queued job it supersedes, at the same instant: either
    it came first (the job runs with its arguments, nothing more is owed) or the claim did (it
    owes one run after the job, with its arguments). Never both, never neither."""
    in_run = owed = 0
    for n in range(20):
        k = new_key()
        h.store.run(acquire(k, "A"))

        def step(i: int, k: str = k, n: int = n) -> object:
            if i == 0:
                return h.store.run(claim(k, "A", "hold", latest=True))
            return h.store.run(acquire(k, f"B{n}", payload=f"b{n}"))

        ran, sub = race(2, step)
        assert isinstance(ran, ClaimReply) and ran.outcome == "run"
        assert not sub.acquired and sub.holder == "A"  # type: ignore[attr-defined]
        done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="H"))
        handed = done.handoff.payload if done.handoff is not None else None
        assert (ran.arguments, handed) in ((f"b{n}", None), (None, f"b{n}")), (ran, done)
        in_run += ran.arguments is not None
        owed += handed is not None
    assert in_run + owed == 20


def test_a_cancel_request_racing_the_finish_is_never_lost_nor_left_on_the_next_run(
    h: Harness,
) -> None:
    """running="cancel": a submission and the running job's finish, at the same instant:
    either it came first (its run is handed on at the finish) or the finish did (it takes the
    free key itself). Its work runs once either way, and the job that runs next is never
    found asked to stop."""
    for n in range(20):
        k = new_key()
        h.store.run(acquire(k, "A"))
        h.store.run(claim(k, "A", "hold", latest=True))

        def step(i: int, k: str = k, n: int = n) -> object:
            if i == 0:
                return h.store.run(
                    Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id=f"H{n}")
                )
            return h.store.run(acquire(k, f"N{n}", payload=f"n{n}", cancel=True))

        done, sub = race(2, step)
        took = sub.acquired  # type: ignore[attr-defined]
        handed = done.handoff.payload if done.handoff is not None else None  # type: ignore[attr-defined]
        assert took != (handed == f"n{n}"), (sub, done)  # exactly one of the two
        nxt = f"N{n}" if took else f"H{n}"
        h.store.run(claim(k, nxt, "hold", latest=True))
        assert h.store.run(Heartbeat((Lease(k, nxt, 30_000),))) == (RENEWED,)


def test_a_run_owed_to_a_holder_whose_worker_died_is_not_lost(h: Harness) -> None:
    """A submission while the holder runs owes one more run; the holder's worker dies and its
    lock lapses with the lease. The copy that takes the run over still owes it: supersede runs
    the newest arguments in the copy itself; reschedule_once hands the run on at its end."""
    for latest in (True, False):
        k = new_key()
        h.store.run(acquire(k, "A"))
        h.store.run(claim(k, "A", "hold", latest=latest, lease_ms=300))
        h.store.run(acquire(k, "N", payload="n"))  # while A runs: a run is owed
        op = claim(k, "A", "hold", latest=latest, handoff_job_id="H")

        def taken_over(op: Claim = op) -> ClaimReply | None:
            reply = h.store.run(op)
            return reply if reply.outcome == "run" else None  # (running until the lease ends)

        again = h.after(0.3, taken_over)
        done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="H"))
        if latest:  # supersede: the copy ran the newest arguments; nothing more is owed
            assert again.arguments == "n" and done.handoff is None
        else:  # reschedule_once: the copy ran its own; the owed run follows it
            assert again.arguments is None
            assert done.handoff is not None and done.handoff.payload == "n"


def test_a_submission_asks_a_running_superseded_job_to_stop_through_its_renewals(
    h: Harness,
) -> None:
    """supersede with running="cancel": a submission while the job runs marks it; the job's
    next lease renewal answers SUPERSEDED (nothing else is sent to it), and the submission's
    run is owed after it, as with reschedule_once. A queued holder is not asked: its
    arguments are replaced instead. The run that follows is not asked to stop."""
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(acquire(k, "Q", payload="q", cancel=True))  # A still queued: not asked
    assert h.store.run(claim(k, "A", "hold", latest=True)).arguments == "q"
    lease = Lease(k, "A", 30_000)
    assert h.store.run(Heartbeat((lease,))) == (RENEWED,)
    asked = h.store.run(acquire(k, "N", payload="n", cancel=True))  # while A runs
    assert asked.holder == "A" and asked.running  # (its decision: cancel_requested)
    assert h.store.run(Heartbeat((lease,))) == (SUPERSEDED,)
    info = h.store.run(Inspect(k))
    assert info is not None and info.stop_requested and info.last_duplicate == "N"
    done = h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR, handoff_job_id="H"))
    assert done.handoff is not None and done.handoff.job_id == "H"
    assert done.handoff.payload == "n"
    told = [(e.what, e.job_id, e.detail) for e in h.store.run(History(k))]
    assert ("cancel_requested", "N", ("A", "1")) in told
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "H" and not info.stop_requested
    h.store.run(claim(k, "H", "hold", latest=True))
    assert h.store.run(Heartbeat((Lease(k, "H", 30_000),))) == (RENEWED,)


def test_run_lock_is_freed_after_its_lease_when_the_worker_dies(h: Harness) -> None:
    k = new_key()
    h.store.run(claim(k, "A", "none", run_lock=True, lease_ms=300))
    h.after(0.3, lambda: h.store.run(claim(k, "B", "none", run_lock=True)).outcome == "run")


def test_only_the_holder_can_extend_release_or_hand_off(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", lease_ms=5_000))
    h.store.run(acquire(k, "X", payload="p"))
    assert h.store.run(Release(k, "B")) is False
    assert h.store.run(Heartbeat((Lease(k, "B", 60_000),))) == (False,)
    assert h.store.run(Retry(k, "B", HOUR)) is False
    not_ours = h.store.run(Finish(k, "B", throttle=False, memory_ms=HOUR, handoff_job_id="N"))
    assert not not_ours.released and not_ours.handoff is None
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "A" and info.state == "running"
    assert info.ttl_ms <= 5_000
    assert h.store.run(Release(k, "A")) is True
    assert h.store.run(Inspect(k)) is None


def test_a_queued_only_release_frees_a_queued_lock_never_a_running_one_or_a_run_lock(
    h: Harness,
) -> None:
    """A discarded or expired copy of a job frees its key only while the job waits (G13); a
    run of the job still going elsewhere keeps it (G12)."""
    queued, running, run_locked = new_key(), new_key(), new_key()
    h.store.run(acquire(queued, "A"))
    assert h.store.run(Release(queued, "A", queued_only=True)) is True
    assert h.store.run(Inspect(queued)) is None
    h.store.run(acquire(running, "B"))
    h.store.run(claim(running, "B"))
    assert h.store.run(Release(running, "B", queued_only=True)) is False
    info = h.store.run(Inspect(running))
    assert info is not None and info.job_id == "B" and info.state == "running"
    h.store.run(claim(run_locked, "C", mode="none", run_lock=True))
    assert h.store.run(Release(run_locked, "C", queued_only=True)) is False
    assert h.store.run(claim(run_locked, "D", mode="none", run_lock=True)).outcome == "busy"
    assert h.store.run(Release(run_locked, "C")) is True  # terminate: everything goes


def test_a_claim_whose_reply_was_lost_is_not_taken_for_a_run_of_its_job(h: Harness) -> None:
    """The store ran a claim but the worker never heard (a timeout after the write): the job's
    next delivery names that claim's nonce as lost and runs now, instead of waiting a lease for
    a run that never started; a claim it does not name still counts as a run elsewhere (G7)."""
    k = new_key()
    h.store.run(acquire(k, "J"))
    assert h.store.run(claim(k, "J", nonce="n1")).outcome == "run"  # its reply was lost
    assert h.store.run(claim(k, "J", nonce="n2")).outcome == "running"  # a real copy: waits
    again = h.store.run(claim(k, "J", nonce="n3", lost_claims=("n0", "n1")))
    assert again.outcome == "run" and again.attempts == 1  # the lost claim ran nothing
    assert h.store.run(claim(k, "J", nonce="n4", lost_claims=("n1",))).outcome == "running"


def test_lost_claims_are_no_attempts_of_their_job(h: Harness) -> None:
    """A store that stalls under a job's claims runs each one and answers none of them: none
    of those claims started a run, so none counts toward max_attempts, and the delivery that
    finally hears its answer runs instead of being dropped as exhausted (G14). A run that did
    start (its lease lapsed: its worker died) still counts."""
    k = new_key()
    h.store.run(acquire(k, "J"))
    lost: list[str] = []
    for n in range(4):
        got = h.store.run(claim(k, "J", nonce=f"n{n}", lost_claims=tuple(lost), max_attempts=1))
        assert (got.outcome, got.attempts) == ("run", 1), n
        lost.append(f"n{n}")
    died = new_key()
    h.store.run(acquire(died, "D"))
    h.store.run(claim(died, "D", lease_ms=300, nonce="d1", max_attempts=1))

    def taken_over() -> ClaimReply | None:
        got = h.store.run(claim(died, "D", nonce="d2", max_attempts=1))
        return got if got.outcome != "running" else None

    assert h.after(0.3, taken_over).outcome == "exhausted"


def test_fencing_tokens_strictly_increase_over_1000_acquisitions(h: Harness) -> None:
    k = new_key()
    last = 0
    for i in range(1000):
        got = h.store.run(acquire(k, f"J{i}"))
        assert got.acquired and got.fence > last
        last = got.fence
        if i % 2:
            h.store.run(Release(k, f"J{i}"))
        else:  # hand-offs draw tokens from the same counter
            h.store.run(claim(k, f"J{i}"))
            h.store.run(Finish(k, f"J{i}", throttle=False, memory_ms=1000))


def test_the_running_job_reads_its_fencing_token(h: Harness) -> None:
    k = new_key()
    fence = h.store.run(acquire(k, "A")).fence
    assert h.store.run(claim(k, "A", "release")).fence == fence
    unlocked = h.store.run(claim(k, "Z", "hold"))  # no enqueue lock: a fresh token
    assert unlocked.fence > fence


def test_scan_inspect_and_force_unlock(h: Harness) -> None:
    keys = [new_key() for _ in range(3)]
    for i, k in enumerate(keys):
        h.store.run(acquire(k, f"J{i}"))
    found = {info.key: info.job_id for info in h.store.run(Scan())}
    assert {k: found.get(k) for k in keys} == {k: f"J{i}" for i, k in enumerate(keys)}
    assert h.store.run(ForceUnlock(keys[0])) is True
    assert h.store.run(Inspect(keys[0])) is None
    assert h.store.run(ForceUnlock(keys[0])) is False
    assert h.store.run(acquire(keys[0], "new")).acquired


def test_async_entry_point_gives_the_same_answers(h: Harness) -> None:
    k = new_key()

    async def scenario() -> None:
        assert (await h.store.arun(acquire(k, "A"))).acquired
        assert (await h.store.arun(acquire(k, "B"))).holder == "A"
        assert (await h.store.arun(claim(k, "A", lease_ms=5_000))).outcome == "run"
        assert await h.store.arun(Heartbeat((Lease(k, "A", 5_000),))) == (True,)
        assert (await h.store.arun(Finish(k, "A", throttle=False, memory_ms=HOUR))).released
        assert await h.store.arun(Confirm(())) == 0

    asyncio.run(scenario())
    assert h.store.run(acquire(k, "C")).acquired


def test_the_holder_acquiring_again_changes_nothing(h: Harness) -> None:
    k = new_key()
    first = h.store.run(acquire(k, "A", grace_ms=400))
    h.store.run(acquire(k, "B"))
    again = h.store.run(acquire(k, "A"))
    assert again.acquired and again.fence == first.fence and again.duplicates == 1
    info = h.store.run(Inspect(k))
    assert info is not None and info.duplicates == 1 and not info.confirmed


def test_a_finished_job_sent_again_does_not_keep_the_lock_it_took(h: Harness) -> None:
    k = new_key()
    h.store.run(acquire(k, "A"))
    h.store.run(claim(k, "A", "release"))
    h.store.run(Finish(k, "A", throttle=False, memory_ms=HOUR))
    assert h.store.run(acquire(k, "A")).acquired  # a late re-send of A takes the free key
    assert h.store.run(claim(k, "A", "release", owner="w2")).outcome == "done"
    assert h.store.run(Inspect(k)) is None  # ...and gives it back when it is refused
    assert h.store.run(acquire(k, "B")).acquired


# ---------------------------------------------------------------- idempotency records


def test_an_idempotency_key_answers_its_first_job_and_fingerprint(h: Harness) -> None:
    k = record_key("ci-build-" + new_key())
    first = h.store.run(Remember(k, "J1", "fp-a", HOUR, HOUR))
    assert first.new and first.job_id == "J1"
    again = h.store.run(Remember(k, "J2", "fp-a", HOUR, HOUR))
    assert not again.new and again.job_id == "J1" and again.fingerprint == "fp-a"
    other = h.store.run(Remember(k, "J3", "fp-b", HOUR, HOUR))
    assert not other.new and other.job_id == "J1" and other.fingerprint == "fp-a"


def test_an_unconfirmed_idempotency_record_lapses_after_its_grace(h: Harness) -> None:
    lapsing, kept = record_key(new_key()), record_key(new_key())
    assert h.store.run(Remember(lapsing, "J1", "fp", HOUR, 300)).new
    assert h.store.run(Remember(kept, "K1", "fp", HOUR, 300)).new
    assert h.store.run(Confirm(((kept, "K1"),))) == 1
    h.after(0.3, lambda: h.store.run(Remember(lapsing, "J2", "fp", HOUR, HOUR)).new)
    assert h.store.run(Remember(kept, "K2", "fp", HOUR, HOUR)).job_id == "K1"


def test_an_unconfirmed_idempotency_record_answers_pending_until_confirmed(h: Harness) -> None:
    """Its job's publish may still fail, so a repeat must not take it as a hit yet."""
    k = record_key(new_key())
    assert h.store.run(Remember(k, "J1", "fp", HOUR, 60_000)).new
    waiting = h.store.run(Remember(k, "J2", "fp", HOUR, 60_000))
    assert waiting.pending and not waiting.new and waiting.job_id == "J1"
    assert h.store.run(Confirm(((k, "J1"),))) == 1
    settled = h.store.run(Remember(k, "J2", "fp", HOUR, 60_000))
    assert not settled.pending and not settled.new and settled.job_id == "J1"


def test_an_idempotency_record_is_freed_or_handed_on_by_its_job_only(h: Harness) -> None:
    k = record_key(new_key())
    h.store.run(Remember(k, "J1", "fp", HOUR, 60_000))
    assert not h.store.run(Release(k, "other"))
    assert not h.store.run(Remember(k, "H", "fp", HOUR, HOUR, replaces="other")).new
    moved = h.store.run(Remember(k, "H", "fp", HOUR, HOUR, replaces="J1"))
    assert moved.new and moved.job_id == "H"
    info = h.store.run(Inspect(k))
    assert info is not None and info.job_id == "H" and info.confirmed
    assert not h.store.run(Remember(k, "J3", "fp", HOUR, HOUR)).pending  # a handed-on record
    assert h.store.run(Release(k, "H"))
    assert h.store.run(Remember(k, "J2", "fp", HOUR, HOUR)).new


# ---------------------------------------------------------------- reservation scopes


def test_a_scope_grants_at_most_its_limit_and_frees_on_release(h: Harness) -> None:
    scope = "user-" + new_key()
    assert h.store.run(Reserve(scope, "a", 2, HOUR)).granted
    assert h.store.run(Reserve(scope, "b", 2, HOUR)).in_flight == 2
    refused = h.store.run(Reserve(scope, "c", 2, HOUR))
    assert not refused.granted and refused.in_flight == 2
    assert h.store.run(Reserve(scope, "a", 2, HOUR)).granted  # a holder keeps its slot
    assert h.store.run(Unreserve(scope, "a")) and not h.store.run(Unreserve(scope, "a"))
    assert h.store.run(Reserve(scope, "c", 2, HOUR)).granted
    assert {s.member for s in h.store.run(ListSlots(scope))} == {"b", "c"}
    assert scope in h.store.run(ListScopes())


def test_a_consumed_slot_belongs_to_the_job_and_lives_by_its_lease(h: Harness) -> None:
    scope = "tenant-" + new_key()
    h.store.run(Reserve(scope, "r1", 1, HOUR))
    assert h.store.run(Consume(scope, "r1", "job-1", HOUR))
    assert [s.member for s in h.store.run(ListSlots(scope))] == ["job-1"]
    assert not h.store.run(Reserve(scope, "r2", 1, HOUR)).granted
    lease = Lease(scope, "job-1", 400, slot=True)
    assert h.store.run(Heartbeat((lease,))) == (True,)  # started: one lease from now
    h.hold_for(0.25)
    assert h.store.run(Heartbeat((lease,))) == (True,)  # renewed by the heartbeat
    h.hold_for(0.25)
    assert not h.store.run(Reserve(scope, "r2", 1, HOUR)).granted  # still held
    h.after(0.4, lambda: h.store.run(Reserve(scope, "r2", 1, HOUR)).granted)  # worker died
    assert h.store.run(Heartbeat((lease,))) == (False,)


def test_a_reservation_never_consumed_expires_after_its_ttl(h: Harness) -> None:
    scope = "user-" + new_key()
    assert h.store.run(Reserve(scope, "r1", 1, 300)).granted
    assert not h.store.run(Reserve(scope, "r2", 1, HOUR)).granted
    h.after(0.3, lambda: h.store.run(Reserve(scope, "r2", 1, HOUR)).granted)


def test_fifty_concurrent_reservations_get_exactly_the_limit(h: Harness) -> None:
    scope = "user-" + new_key()
    replies = race(50, lambda i: h.store.run(Reserve(scope, f"r{i}", 5, HOUR)))
    assert sum(r.granted for r in replies) == 5
    assert len(h.store.run(ListSlots(scope))) == 5


def test_an_expired_slot_is_gone_for_every_operation(h: Harness) -> None:
    scope = "user-" + new_key()
    h.store.run(Reserve(scope, "a", 5, 300))
    h.store.run(Reserve(scope, "b", 5, HOUR))  # keeps the scope alive
    h.hold_for(0.35)
    assert not h.store.run(Unreserve(scope, "a"))
    assert not h.store.run(Consume(scope, "a", "job-a", HOUR))
    assert {s.member for s in h.store.run(ListSlots(scope))} == {"b", "job-a"}


def test_peek_answers_the_holder_and_counts_a_duplicate_but_takes_a_free_key_never(
    h: Harness,
) -> None:
    from taskdedup.stores.base import Peek

    free, held = new_key(), new_key()
    assert h.store.run(Peek(free)) is None
    assert h.store.run(Inspect(free)) is None  # nothing taken
    first = h.store.run(acquire(held, "A"))
    seen = h.store.run(Peek(held))
    assert seen is not None and seen.holder == "A" and seen.fence == first.fence
    assert seen.duplicates == 1 and not seen.acquired
    assert h.store.run(Peek(held, record_duplicate=False)).duplicates == 1  # type: ignore[union-attr]


# ---------------------------------------------------------------- pacing (GCRA)


def test_pace_lets_a_burst_start_at_once_then_spaces_the_rest_at_the_interval(
    h: Harness,
) -> None:
    """burst 3 at one every 200 ms: three start at once, then 200 ms apart; nothing is
    refused. (Each call's answer is counted from its own now, so a few ms pass between.)"""
    scope = "pace-" + new_key()
    waits = [h.store.run(Pace(scope, 200, 3)) for _ in range(5)]
    assert waits[:3] == [0, 0, 0], waits
    assert 150 <= waits[3] <= 200 and 350 <= waits[4] <= 400, waits
    assert h.store.run(Pace("other-" + new_key(), 200, 3)) == 0  # scopes are apart


def test_fifty_concurrent_paced_submissions_each_get_a_start_of_their_own(h: Harness) -> None:
    """One a second, burst 1: fifty submissions at the same instant are given fifty distinct
    starts, a second apart (none at the same time, none dropped; the few ms the calls take
    between them are well under half a second)."""
    scope = "pace-" + new_key()
    waits = sorted(race(50, lambda i: h.store.run(Pace(scope, 1000, 1))))
    slots = sorted(round(w / 1000) for w in waits)
    assert slots == list(range(50)), waits


def test_a_quiet_paced_scope_starts_at_once_again_and_keeps_nothing(h: Harness) -> None:
    """Once the scope's last start has passed, the next submission starts at once: the pace
    keeps no debt (and its record is gone when it holds nothing back: G9)."""
    scope = "pace-" + new_key()
    assert [h.store.run(Pace(scope, 150, 1)) for _ in range(2)][1] > 0
    assert h.after(0.3, lambda: h.store.run(Pace(scope, 150, 1)) == 0)


# ---------------------------------------------------------------- a schedule entry's ticks


def test_a_tick_is_taken_by_its_first_send_and_a_late_send_of_an_earlier_one_is_not_new(
    h: Harness,
) -> None:
    """The first send of a slot takes it; another send of it, or of an earlier slot (a late
    scheduler), is answered with the job of the entry's latest tick; a later slot is new.
    Entries are apart."""
    entry, day = "nightly-" + new_key(), 86_400_000
    assert h.store.run(MarkTick(entry, 1_000_000, "J1", day)) is None
    assert h.store.run(MarkTick(entry, 1_000_000, "J2", day)) == "J1"  # a second scheduler
    assert h.store.run(MarkTick(entry, 940_000, "J0", day)) == "J1"  # a late one, past slot
    assert h.store.run(MarkTick(entry, 1_060_000, "J3", day)) is None  # the next tick
    assert h.store.run(MarkTick(entry, 1_000_000, "J4", day)) == "J3"
    assert h.store.run(MarkTick("other-" + new_key(), 1_000_000, "K", day)) is None


def test_twenty_schedulers_sending_one_tick_at_once_send_it_once(h: Harness) -> None:
    """Twenty concurrent sends of one slot: exactly one takes it, and every other is told
    that one's job."""
    entry = "every-second-" + new_key()
    replies = race(20, lambda i: h.store.run(MarkTick(entry, 5_000, f"J{i}", 60_000)))
    winners = [f"J{i}" for i, reply in enumerate(replies) if reply is None]
    assert len(winners) == 1, replies
    assert {reply for reply in replies if reply is not None} == set(winners)


def test_a_tick_whose_publish_failed_is_forgotten_only_by_its_own_job(h: Harness) -> None:
    entry, day = "failing-" + new_key(), 86_400_000
    assert h.store.run(MarkTick(entry, 3_000, "J1", day)) is None
    assert h.store.run(UnmarkTick(entry, "J2")) is False  # not its tick: kept
    assert h.store.run(MarkTick(entry, 3_000, "J2", day)) == "J1"
    assert h.store.run(UnmarkTick(entry, "J1")) is True
    assert h.store.run(MarkTick(entry, 3_000, "J3", day)) is None  # sent by another


def test_an_entry_keeps_its_latest_tick_for_its_ttl_only(h: Harness) -> None:
    """The entry's record expires (G9): after it, a send of the same slot is new again."""
    entry = "short-" + new_key()
    assert h.store.run(MarkTick(entry, 7_000, "J1", 150)) is None
    assert h.after(0.3, lambda: h.store.run(MarkTick(entry, 7_000, "J2", 150)) is None)


# ---------------------------------------------------------------- stacked caps


def test_stacked_caps_are_taken_all_or_none_and_name_the_full_one(h: Harness) -> None:
    """A global cap of 3 and a per-tenant cap of 1: a tenant's second job is refused by its
    tenant's scope (index 1) and takes no global slot; another tenant's is taken; a member
    holding its slots keeps them; freeing the tenant's slot lets the next one in."""
    glob, acme, umbrella = (f"{name}-{new_key()}" for name in ("global", "acme", "umbrella"))
    day = 86_400_000
    assert h.store.run(ReserveAll(((glob, 3), (acme, 1)), "J1", day)) == -1
    assert h.store.run(ReserveAll(((glob, 3), (acme, 1)), "J2", day)) == 1
    assert [s.member for s in h.store.run(ListSlots(glob))] == ["J1"]  # none taken by J2
    assert h.store.run(ReserveAll(((glob, 3), (umbrella, 1)), "J3", day)) == -1
    assert h.store.run(ReserveAll(((glob, 3), (acme, 1)), "J1", day)) == -1  # holds: kept
    h.store.run(Unreserve(acme, "J1"))
    assert h.store.run(ReserveAll(((glob, 3), (acme, 1)), "J2", day)) == -1
    assert h.store.run(ReserveAll(((glob, 3), (umbrella, 1)), "J4", day)) == 0  # global full
    assert len(h.store.run(ListSlots(umbrella))) == 1


def test_thirty_concurrent_stacked_reservations_never_pass_either_cap(h: Harness) -> None:
    """Thirty members over four tenants at the same instant: at most 8 get in, at most 2 per
    tenant, and each refusal names a scope that is full."""
    glob = "global-" + new_key()
    tenants = [f"tenant{i}-{new_key()}" for i in range(4)]

    def take(i: int) -> int:
        parts = ((glob, 8), (tenants[i % 4], 2))
        return h.store.run(ReserveAll(parts, f"J{i}", 60_000))

    replies = race(30, take)
    granted = [i for i, reply in enumerate(replies) if reply == -1]
    assert len(granted) <= 8 and len(h.store.run(ListSlots(glob))) == len(granted)
    for t, tenant in enumerate(tenants):
        held = {s.member for s in h.store.run(ListSlots(tenant))}
        assert held == {f"J{i}" for i in granted if i % 4 == t} and len(held) <= 2
    assert len(granted) == 8  # four tenants of two: every slot was used


# ---------------------------------------------------------------- overlap of a scheduler's tick


def test_a_skipped_tick_owes_no_run_and_a_buffered_one_owes_exactly_one(h: Harness) -> None:
    """overlap on a lock whose duplicates owe a run: a tick counted while the run holds the
    key ("buffer_one") owes the one run after it, with the latest tick's arguments, however
    many ticks came; a tick not counted ("skip") owes none."""
    skipped, buffered = new_key(), new_key()
    for k in (skipped, buffered):
        h.store.run(acquire(k, "A"))
        h.store.run(claim(k, "A"))
    for n in range(3):
        h.store.run(acquire(skipped, f"T{n}", record_duplicate=False))
        h.store.run(acquire(buffered, f"T{n}", payload=f"tick-{n}"))
    finish = {"throttle": False, "memory_ms": HOUR, "ttl_ms": HOUR, "grace_ms": HOUR}
    done = h.store.run(Finish(skipped, "A", handoff_job_id="N", **finish))  # type: ignore[arg-type]
    assert done.released and done.handoff is None and h.store.run(Inspect(skipped)) is None
    done = h.store.run(Finish(buffered, "A", handoff_job_id="N", **finish))  # type: ignore[arg-type]
    assert done.handoff is not None and (done.handoff.job_id, done.handoff.payload) == (
        "N",
        "tick-2",
    )
