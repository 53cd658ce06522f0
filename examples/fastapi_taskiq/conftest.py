"""The example's tests need no Redis: ``ENVIRONMENT=pytest`` makes the broker taskiq's
InMemoryBroker (see broker.py), and taskdedup's pytest plugin puts its middleware on a store of
each test's own (``taskdedup_install``: the in-memory store, or Redis with --taskdedup-redis)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

os.environ["ENVIRONMENT"] = "pytest"  # before the app is imported: the in-memory broker
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tasks
from app import app
from broker import broker


@pytest.fixture
def client(taskdedup_install: Callable[[Any], Any]) -> Iterator[TestClient]:
    """The API, its lifespan started (the broker with it); the broker on this test's store."""
    taskdedup_install(broker)
    tasks.outbox.clear()
    with TestClient(app) as client:
        yield client
        assert client.portal is not None
        client.portal.call(broker.wait_all)  # (no job left half-run when its event loop stops)


@pytest.fixture
def slow_mail(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The mail server is slow: a receipt job waits in ``mail_receipt`` until the test sets
    the event, so a second click arrives while the first click's job still runs."""
    sent = threading.Event()
    mail_receipt = tasks.mail_receipt

    async def held(order_id: int, email: str) -> None:
        while not sent.is_set():
            await asyncio.sleep(0.01)
        await mail_receipt(order_id, email)

    monkeypatch.setattr(tasks, "mail_receipt", held)
    yield sent
    sent.set()
