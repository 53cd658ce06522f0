"""Celery canvas (G15): a chain, group or chord never hangs or loses a step because a member
was deduplicated; a deduplicated member's continuation runs after the winner, with its result.

Real in-process workers on a Redis broker and a Redis result backend. Task bodies count their
runs in Redis, so "ran once" is what the store saw, not what a test variable says.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group, signals
from celery.contrib.testing.worker import start_worker

from harness import wait_for
from taskdedup.celery import deduplicate, install
from test_celery import make_app

TIMEOUT = 30  # seconds a canvas may take before it counts as hung


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Celery:
    app = make_app(redis_url, key_prefix)
    install(app)
    return app


class Marks:
    """Run counters and call logs in Redis, under the test's prefix (every key expires)."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client, self.prefix = client, prefix

    def ran(self, name: str, *args: Any) -> None:
        key = f"{self.prefix}:runs:{name}:{json.dumps(args)}"
        self.client.incr(key)
        self.client.expire(key, 600)

    def runs(self, name: str, *args: Any) -> int:
        return int(self.client.get(f"{self.prefix}:runs:{name}:{json.dumps(args)}") or 0)

    def called(self, name: str, value: Any) -> None:
        key = f"{self.prefix}:calls:{name}"
        self.client.rpush(key, json.dumps(value))
        self.client.expire(key, 600)

    def calls(self, name: str) -> list[Any]:
        return [json.loads(v) for v in self.client.lrange(f"{self.prefix}:calls:{name}", 0, -1)]


@pytest.fixture
def marks(redis_client: redis.Redis, key_prefix: str) -> Iterator[Marks]:
    yield Marks(redis_client, key_prefix)


def threads_worker(app: Celery) -> Any:
    return start_worker(app, pool="threads", concurrency=4, perform_ping_check=False)


def test_two_identical_chains_both_complete_and_the_shared_step_runs_once(
    app: Celery, marks: Marks
) -> None:
    gate = threading.Event()

    @app.task(shared=False)
    def add_one(x: int) -> int:
        marks.ran("add_one", x)
        return x + 1

    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        assert gate.wait(TIMEOUT)
        return x * 2

    with threads_worker(app):
        first = chain(add_one.s(1), double.s()).apply_async()
        wait_for(lambda: marks.runs("double", 2) == 1, what="the first chain's double to start")
        second = chain(add_one.s(1), double.s()).apply_async()
        # its add_one has run and sent double(2) on, while the first double(2) holds the key
        wait_for(lambda: second.parent.ready(), what="the second chain's first step")
        gate.set()
        assert first.get(timeout=TIMEOUT) == 4
        assert second.get(timeout=TIMEOUT) == 4
    assert marks.runs("double", 2) == 1
    assert marks.runs("add_one", 1) == 2


def test_identical_chains_with_the_default_strategy(app: Celery, marks: Marks) -> None:
    """until_executing: the second chain's last step is sent while the first one's is queued."""

    @app.task(shared=False)
    def add_one(x: int) -> int:
        return x + 1

    @deduplicate()
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    first = chain(add_one.s(1), double.s()).apply_async()
    second = chain(add_one.s(1), double.s()).apply_async()
    # solo: add_one, add_one, then double: the second double(2) finds the first one queued
    with start_worker(app, pool="solo", perform_ping_check=False):
        assert first.get(timeout=TIMEOUT) == 4
        assert second.get(timeout=TIMEOUT) == 4
    assert marks.runs("double", 2) == 1


def test_a_deduplicated_middle_step_hands_its_result_to_the_rest_of_each_chain(
    app: Celery, marks: Marks
) -> None:
    @app.task(shared=False)
    def add_one(x: int) -> int:
        marks.ran("add_one", x)
        return x + 1

    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    first = chain(double.s(3), add_one.s(), add_one.s()).apply_async()
    second = chain(double.s(3), add_one.s(), add_one.s()).apply_async()
    with threads_worker(app):
        assert first.get(timeout=TIMEOUT) == 8
        assert second.get(timeout=TIMEOUT) == 8
    assert marks.runs("double", 3) == 1
    assert marks.runs("add_one", 6) == 2 and marks.runs("add_one", 7) == 2


def test_link_callbacks_of_a_duplicate_run_with_the_winners_result(
    app: Celery, marks: Marks
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    @app.task(shared=False)
    def record(value: int, tag: str) -> None:
        marks.called("record", [tag, value])

    first = double.apply_async((5,), link=record.s("first"))
    second = double.apply_async((5,), link=record.s("second"))
    assert second.deduplicated and second.id == first.id
    with threads_worker(app):
        wait_for(lambda: len(marks.calls("record")) == 2, TIMEOUT, "both callbacks")
    assert sorted(marks.calls("record")) == [["first", 10], ["second", 10]]
    assert marks.runs("double", 5) == 1


def test_a_group_with_duplicate_members_completes(app: Celery, marks: Marks) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    result = group(double.s(1), double.s(1), double.s(2), double.s(1)).apply_async()
    with threads_worker(app):
        assert result.get(timeout=TIMEOUT) == [2, 2, 4, 2]
    assert marks.runs("double", 1) == 1 and marks.runs("double", 2) == 1


def test_a_chord_whose_header_has_duplicates_completes_with_every_result(
    app: Celery, marks: Marks
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    @app.task(shared=False)
    def total(values: list[int]) -> int:
        marks.called("total", values)
        return sum(values)

    result = chord([double.s(1), double.s(1), double.s(2)], total.s()).apply_async()
    with threads_worker(app):
        assert result.get(timeout=TIMEOUT) == 8
    assert marks.calls("total") == [[2, 2, 4]]
    assert marks.runs("double", 1) == 1


def test_a_failing_holder_fails_the_duplicates_canvas_as_celery_would(
    app: Celery, marks: Marks
) -> None:
    @deduplicate("until_executed")
    @app.task(shared=False)
    def explode(x: int) -> int:
        marks.ran("explode", x)
        raise ValueError(f"boom {x}")

    @app.task(shared=False)
    def add_one(x: int) -> int:
        return x + 1

    @app.task(shared=False)
    def on_error(tag: str) -> None:
        marks.called("errors", tag)

    first = explode.apply_async((1,), link_error=on_error.si("first"))
    second = explode.apply_async((1,), link_error=on_error.si("second"))
    assert second.deduplicated
    chains = [chain(explode.s(2), add_one.s()).apply_async() for _ in range(2)]
    with threads_worker(app):
        wait_for(lambda: len(marks.calls("errors")) == 2, TIMEOUT, "both errbacks")
        for result in chains:
            with pytest.raises(ValueError, match="boom 2"):
                result.get(timeout=TIMEOUT)
        with pytest.raises(ValueError, match="boom 1"):
            first.get(timeout=TIMEOUT)
    assert sorted(marks.calls("errors")) == ["first", "second"]
    assert marks.runs("explode", 1) == 1 and marks.runs("explode", 2) == 1


def test_identical_chords_whose_body_is_deduplicated_both_complete(
    app: Celery, marks: Marks
) -> None:
    gate = threading.Event()

    @app.task(shared=False)
    def square(x: int) -> int:
        return x * x

    @deduplicate("until_executed")
    @app.task(shared=False)
    def total(values: list[int]) -> int:
        marks.ran("total", values)
        assert gate.wait(TIMEOUT)
        return sum(values)

    published: list[tuple[str, str]] = []  # (task, id) of each message, worker's included

    def note(sender: Any = None, headers: Any = None, **_: Any) -> None:
        published.append((headers["task"], headers["id"]))

    signals.after_task_publish.connect(note, weak=False)
    try:
        with threads_worker(app):
            first = chord([square.s(1), square.s(2)], total.s()).apply_async()
            wait_for(lambda: marks.runs("total", [1, 4]) == 1, TIMEOUT, "the first body to start")
            second = chord([square.s(1), square.s(2)], total.s()).apply_async()
            # the header's results are stored before the body is sent: wait for the body
            # itself, which stands as a follower of the running first body
            body = ("taskdedup.follow", second.id)
            wait_for(lambda: body in published, TIMEOUT, "the second body to follow the first")
            gate.set()
            assert first.get(timeout=TIMEOUT) == 5
            assert second.get(timeout=TIMEOUT) == 5
    finally:
        signals.after_task_publish.disconnect(note)
    assert marks.runs("total", [1, 4]) == 1


def test_a_step_whose_holder_is_gone_without_a_result_runs_itself(
    app: Celery, marks: Marks, key_prefix: str
) -> None:
    """The holder sits on a queue no worker reads and its lock lapses (ttl): the follower
    stops waiting after its patience and the step runs under its own id."""

    @deduplicate("until_executed", ttl=2, lease=1)
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        return x * 2

    @app.task(shared=False)
    def add_one(x: int) -> int:
        return x + 1

    stuck = double.apply_async((7,), queue=f"{key_prefix}-nobody")
    result = chain(double.s(7), add_one.s()).apply_async()
    assert result.parent.id != stuck.id
    with threads_worker(app):
        assert result.get(timeout=TIMEOUT) == 15
    assert marks.runs("double", 7) == 1  # the step, run by itself; the stuck holder never ran
    assert not stuck.ready()


def test_without_a_result_backend_a_duplicate_step_is_published_as_it_is(
    redis_url: str, key_prefix: str, marks: Marks
) -> None:
    """No result to hand on: the step runs itself rather than being lost."""
    app = make_app(redis_url, key_prefix)
    app.conf.update(result_backend=None)
    app.backend  # noqa: B018 (the disabled backend, made now)
    install(app)
    gate = threading.Event()

    @app.task(shared=False)
    def add_one(x: int) -> int:
        return x + 1

    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        assert gate.wait(TIMEOUT)
        return x * 2

    ended: list[str] = []

    def postrun(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if (
            getattr(sender, "name", None) == add_one.name
        ):  # after its result and its next step were sent
            ended.append(task_id)

    signals.task_postrun.connect(postrun, weak=False)
    try:
        with threads_worker(app):
            chain(add_one.s(1), double.s()).apply_async()
            wait_for(lambda: marks.runs("double", 2) == 1, TIMEOUT, "the first double to start")
            chain(add_one.s(1), double.s()).apply_async()
            wait_for(lambda: len(ended) == 2, TIMEOUT, "the second chain's first step")
            gate.set()
            wait_for(lambda: marks.runs("double", 2) == 2, TIMEOUT, "the second double")
    finally:
        signals.task_postrun.disconnect(postrun)


def test_a_follower_that_cannot_read_the_result_backend_looks_again_later(
    app: Celery, marks: Marks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result backend fails while the follower polls the holder: the follower looks again
    later instead of failing the duplicate's chain."""
    gate = threading.Event()

    @app.task(shared=False)
    def add_one(x: int) -> int:
        return x + 1

    @deduplicate("until_executed")
    @app.task(shared=False)
    def double(x: int) -> int:
        marks.ran("double", x)
        assert gate.wait(TIMEOUT)
        return x * 2

    with threads_worker(app):
        first = chain(add_one.s(1), double.s()).apply_async()
        wait_for(lambda: marks.runs("double", 2) == 1, what="the first chain's double to start")
        real, failures = app.AsyncResult, [0]

        class Unreadable:
            """The holder's result while the backend is down: every read fails."""

            @property
            def state(self) -> str:
                failures[0] += 1
                raise ConnectionError("the result backend does not answer")

        def async_result(task_id: str, *args: Any, **kwargs: Any) -> Any:
            if task_id == first.id and not gate.is_set():
                return Unreadable()
            return real(task_id, *args, **kwargs)

        monkeypatch.setattr(app, "AsyncResult", async_result)
        second = chain(add_one.s(1), double.s()).apply_async()
        wait_for(lambda: failures[0] >= 2, what="the follower to meet the backend down twice")
        gate.set()  # the backend answers again, and the holder ends
        assert first.get(timeout=TIMEOUT) == 4
        assert second.get(timeout=TIMEOUT) == 4
    assert marks.runs("double", 2) == 1
