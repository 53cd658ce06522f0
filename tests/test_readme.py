"""Every Python snippet in README.md runs as written, in order, like one session.

The Celery snippet's broker is swapped for Celery's in-process ``memory://`` transport, the
taskiq snippet's for taskiq's ``InMemoryBroker`` (and the store for ``memory://``), so the test
needs no server and touches nothing shared.
"""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def test_readme_snippets_run_in_order(
    monkeypatch: pytest.MonkeyPatch, postgres_url: str, key_prefix: str, private_redis_url: str
) -> None:
    """The snippets that need PostgreSQL (the SQL store's transactional enqueue) get the
    tests' one, under a key prefix of the test's own; the migration snippets' peer Redis
    (``redis://127.0.0.1:6379/1``, where celery-once and celery-singleton keep their keys) is
    a private redis-server."""
    assert len(SNIPPETS) >= 8
    for name in list(os.environ):
        if name.startswith("TASKDEDUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TASKDEDUP_URL", "memory://")
    module = types.ModuleType("readme")  # taskiq looks task functions' modules up
    monkeypatch.setitem(sys.modules, "readme", module)
    namespace: dict[str, Any] = module.__dict__
    for index, snippet in enumerate(SNIPPETS):
        code = snippet.replace('broker="redis://127.0.0.1:6379/0"', 'broker="memory://"')
        code = code.replace('"redis://127.0.0.1:6379/1"', repr(private_redis_url))
        code = code.replace(
            'ListQueueBroker("redis://127.0.0.1:6379/0", socket_timeout=None)', "InMemoryBroker()"
        )
        code = code.replace(
            "from taskiq_redis import ListQueueBroker", "from taskiq import InMemoryBroker"
        )
        on_postgres = POSTGRES in code
        if on_postgres:
            code = code.replace(POSTGRES, postgres_url)
            monkeypatch.setenv("TASKDEDUP_URL", postgres_url)
            monkeypatch.setenv("TASKDEDUP_KEY_PREFIX", key_prefix)
        try:
            exec(compile(code, f"README.md snippet {index}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"README snippet {index} failed: {exc!r}\n{snippet}") from exc
        finally:
            if on_postgres:
                monkeypatch.setenv("TASKDEDUP_URL", "memory://")
                monkeypatch.delenv("TASKDEDUP_KEY_PREFIX")
