"""Installing taskdedup as users do: what ``import taskdedup`` costs, and what the extras bring.

The full check (each extra from the built wheel in a clean venv, one real submission) is
``make install-check`` (``.ci/install-check``), which CI runs after the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_taskdedup_does_not_load_redis_py_until_a_redis_store_is_asked_for() -> None:
    code = (
        "import sys, taskdedup\n"
        "assert 'redis' not in sys.modules, 'import taskdedup loaded redis-py'\n"
        "from taskdedup import RedisStore\n"
        "assert RedisStore.__module__ == 'taskdedup.stores.redis'\n"
        "assert 'redis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_celery_extra_brings_kombus_redis_transport_with_what_it_imports() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.startswith("celery[redis]") for req in extras["celery"]), extras["celery"]
    assert any(req.startswith("taskiq-redis") for req in extras["taskiq"]), extras["taskiq"]
