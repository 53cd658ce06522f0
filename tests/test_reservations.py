"""The standalone reservation guard: reserve, consume, release, list; sync and asyncio."""

from __future__ import annotations

import asyncio

import pytest

from harness import Harness
from taskdedup import ConfigError, QuotaExceeded, ReservationGuard


def test_a_consumed_reservation_is_held_by_its_job(h: Harness) -> None:
    guard = ReservationGuard(h.store)
    with guard.reserve("user-42", max_concurrent=2, ttl=300) as first:
        first.consume("job-1")
    with guard.reserve("user-42", max_concurrent=2, ttl=300) as second:
        second.consume("job-2")
    with pytest.raises(QuotaExceeded) as refused:
        guard.reserve("user-42", max_concurrent=2)
    assert str(refused.value) == "Quota exceeded: maximum 2 concurrent jobs for scope user-42"
    assert refused.value.scope == "user-42" and refused.value.limit == 2
    assert {slot.member for slot in guard.active("user-42")} == {"job-1", "job-2"}
    assert "user-42" in guard.scopes()
    assert guard.release("user-42", "job-1")  # the job ended
    guard.reserve("user-42", max_concurrent=2).release()


def test_leaving_the_block_with_an_exception_releases_the_slot(h: Harness) -> None:
    guard = ReservationGuard(h.store)
    with pytest.raises(RuntimeError), guard.reserve("tenant-a", max_concurrent=1):
        raise RuntimeError("dispatch failed")
    with guard.reserve("tenant-a", max_concurrent=1) as held:
        held.consume("job-9")
    assert [slot.member for slot in guard.active("tenant-a")] == ["job-9"]


def test_a_reservation_never_consumed_is_free_after_its_ttl(h: Harness) -> None:
    guard = ReservationGuard(h.store)
    guard.reserve("tenant-b", max_concurrent=1, ttl=0.5)  # the client dies here
    with pytest.raises(QuotaExceeded):
        guard.reserve("tenant-b", max_concurrent=1)

    def free() -> bool:
        try:
            guard.reserve("tenant-b", max_concurrent=1)  # held: its record must expire (G9)
        except QuotaExceeded:
            return False
        return True

    h.after(0.5, free)


def test_the_asyncio_form_behaves_alike(h: Harness) -> None:
    guard = ReservationGuard(h.store)

    async def main() -> None:
        async with await guard.areserve("user-7", max_concurrent=1) as held:
            await held.aconsume("job-1")
        with pytest.raises(QuotaExceeded):
            await guard.areserve("user-7", max_concurrent=1)
        assert [s.member for s in await guard.aactive("user-7")] == ["job-1"]
        assert await guard.arelease("user-7", "job-1")
        with pytest.raises(ValueError):
            async with await guard.areserve("user-7", max_concurrent=1):
                raise ValueError("publish failed")
        assert await guard.aactive("user-7") == []
        await guard.areserve("user-7", max_concurrent=1)  # held: its record must expire (G9)

    asyncio.run(main())


def test_a_bad_limit_is_a_config_error() -> None:
    from taskdedup import MemoryStore

    with pytest.raises(ConfigError, match="max_concurrent"):
        ReservationGuard(MemoryStore()).reserve("s", max_concurrent=0)
