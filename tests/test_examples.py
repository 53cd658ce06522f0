"""The examples run as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart_needs_no_server() -> None:
    out = run("quickstart.py", REDIS_URL="redis://127.0.0.1:1/0")
    assert "deduplicated onto job-1" in out and "redelivers job-1" in out


def test_celery_example(redis_url: str) -> None:
    out = run("celery_app.py", REDIS_URL=redis_url)
    assert "same job: True, deduplicated: True" in out
    assert "DuplicateJob" in out and "done after 2 retries" in out
    assert "new job: True" in out


def test_ci_submit_example(redis_url: str) -> None:
    out = run("ci_submit.py", REDIS_URL=redis_url)
    assert "idempotent_hit=True" in out and "same build: True" in out
    assert "IdempotencyKeyMismatch" in out
    assert "Quota exceeded: maximum 2 concurrent jobs for scope repo=acme/shop" in out
    assert "built acme/shop@4f2a9c1" in out
