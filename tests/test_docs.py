"""Every page of the documentation says what runs: each page's Python snippets run as written,
in order, in a namespace of the page's own; its shell commands run too (or are checked against
what exists); and the site builds with ``mkdocs build --strict``, so a warning fails the suite.

The pages are README.md and every page of mkdocs.yml's nav. A snippet's Celery broker is
swapped for Celery's in-process ``memory://`` transport (and a Redis result backend for
``cache+memory://``), taskiq's ``ListQueueBroker`` for ``InMemoryBroker``, and the store for
``memory://``, so most pages need no server and touch nothing shared. A snippet that names the
PostgreSQL of the examples gets the tests' one, under a key prefix of the test's own; the
migration page's peer Redis (``redis://127.0.0.1:6379/1``, where celery-once and
celery-singleton keep their keys) is a private redis-server; the ``taskdedup`` command examples
read the tests' Redis under a key prefix of the test's own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.S | re.M)
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
PEER_REDIS = "redis://127.0.0.1:6379/1"

#: Pages with no code to run: prose, tables and output. A new page with no Python must be
#: added here, so that no page escapes the snippet test unnoticed.
NO_PYTHON = {
    "index.md",
    "design.md",
    "architecture.md",
    "guarantees.md",
    "benchmarks.md",
    "development.md",
    "operating/runbook.md",
    "operating/cli.md",
    "operating/logs.md",
    "reference/headers.md",
    "api/taskdedup.md",
    "api/celery.md",
    "api/taskiq.md",
    "api/stores.md",
    "api/testing.md",
    "api/compat.md",
    "api/settings.md",
}
#: The contract and the architecture are kept word for word elsewhere (docs/design.md with the
#: team's shared copy; tests/test_architecture.py reads docs/architecture.md): their diagrams
#: are fences without a language, which the fence check lets pass on these two pages only.
KEPT_AS_IS = {"design.md", "architecture.md"}
#: ```python runs, ```console holds commands (checked below), ```text and ```mermaid are output
#: and diagrams.
LANGUAGES = {"python", "console", "text", "mermaid"}


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, relative to docs/, in order (each nav line is
    ``- Title: page.md`` or ``- page.md``; read without a YAML parser, which the test extra
    does not bring)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:\n") :]
    return re.findall(r"^\s+- (?:[^\n]*?: )?([\w/.-]+\.md)\s*$", nav, re.M)


NAV = nav_pages()
#: README.md is a page too (its path is relative to the repository, the others' to docs/).
PAGES = ["README.md", *NAV]


def page_path(page: str) -> Path:
    return ROOT / page if page == "README.md" else DOCS / page


def fences(page: str) -> list[tuple[str, str]]:
    """The fenced blocks of ``page``: (language, body), in order."""
    return [(lang.strip(), body) for lang, body in FENCE.findall(page_path(page).read_text())]


def snippets(page: str) -> list[str]:
    return [body for lang, body in fences(page) if lang == "python"]


def test_every_page_of_the_nav_is_run_or_listed_as_having_no_python() -> None:
    assert len(NAV) == len(set(NAV)), "a page is twice in the nav"
    for page in NAV:
        assert page_path(page).is_file(), f"mkdocs.yml names {page}, which does not exist"
        if page in NO_PYTHON:
            assert not snippets(page), f"{page} has Python snippets: take it out of NO_PYTHON"
        else:
            assert snippets(page), f"{page} has no Python snippet: list it in NO_PYTHON"
    assert set(NAV) >= NO_PYTHON, NO_PYTHON - set(NAV)


def test_every_page_of_docs_is_in_the_nav() -> None:
    """The research notes are excluded from the site (mkdocs.yml's exclude_docs)."""
    pages = {
        str(path.relative_to(DOCS))
        for path in DOCS.rglob("*.md")
        if path.relative_to(DOCS).parts[0] != "research"
    }
    assert pages == set(NAV), pages.symmetric_difference(NAV)


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_says_what_it_is(page: str) -> None:
    """A block is Python (run), console (commands, checked), text (output) or a diagram; a
    block with no language would escape both checks."""
    for lang, body in fences(page):
        if page in KEPT_AS_IS and lang == "":
            continue
        assert lang in LANGUAGES, f"{page}: a ```{lang} block:\n{body}"


def _adapt(code: str) -> str:
    """The swaps for servers the test does not have (see the module's docstring)."""
    code = code.replace(f'broker="{REDIS}"', 'broker="memory://"')
    code = code.replace(f'backend="{REDIS}"', 'backend="cache+memory://"')
    code = code.replace(f'ListQueueBroker("{REDIS}", socket_timeout=None)', "InMemoryBroker()")
    return code.replace(
        "from taskiq_redis import ListQueueBroker", "from taskiq import InMemoryBroker"
    )


@pytest.fixture
def celery_state() -> Iterator[None]:
    """A page's ``@shared_task`` registers its task on every Celery app finalized later, and
    a snippet may set the current app: both are put back after the page, so no later test
    finds the docs' tasks in an app of its own."""
    from celery import _state

    before, default = _state._tls.current_app, _state.default_app
    finalizers = set(_state._on_app_finalizers)
    yield
    _state._set_current_app(before)
    _state.set_default_app(default)
    _state._on_app_finalizers.clear()
    _state._on_app_finalizers.update(finalizers)


@pytest.mark.usefixtures("celery_state")
@pytest.mark.parametrize("page", [page for page in PAGES if page not in NO_PYTHON])
def test_the_python_snippets_of_each_page_run_in_order(
    page: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A page's snippets run one after the other in one namespace, as a reader pastes them."""
    blocks = snippets(page)
    for name in list(os.environ):
        if name.startswith("TASKDEDUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TASKDEDUP_URL", "memory://")
    if any(PEER_REDIS in block for block in blocks):
        peer = request.getfixturevalue("private_redis_url")
        blocks = [block.replace(f'"{PEER_REDIS}"', repr(peer)) for block in blocks]
    name = "docs_" + re.sub(r"\W", "_", page.removesuffix(".md"))
    module = types.ModuleType(name)  # taskiq looks task functions' modules up
    monkeypatch.setitem(sys.modules, name, module)
    namespace: dict[str, Any] = module.__dict__
    for index, snippet in enumerate(blocks):
        code = _adapt(snippet)
        on_postgres = POSTGRES in code
        if on_postgres:
            postgres_url = request.getfixturevalue("postgres_url")
            code = code.replace(POSTGRES, postgres_url)
            monkeypatch.setenv("TASKDEDUP_URL", postgres_url)
            monkeypatch.setenv("TASKDEDUP_KEY_PREFIX", request.getfixturevalue("key_prefix"))
        try:
            exec(compile(code, f"{page} snippet {index}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{page} snippet {index} failed: {exc!r}\n{snippet}") from exc
        finally:
            if on_postgres:
                monkeypatch.setenv("TASKDEDUP_URL", "memory://")
                monkeypatch.delenv("TASKDEDUP_KEY_PREFIX")


def commands(page: str) -> list[str]:
    """The commands of a page's ```console blocks (a ``#`` starts a comment)."""
    found = []
    for lang, body in fences(page):
        if lang == "console":
            for line in body.splitlines():
                command = line.split(" #", 1)[0].strip()
                if command:
                    found.append(command)
    return found


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.M))


def extras() -> set[str]:
    """The extras of pyproject.toml (read without tomllib, which Python 3.10 has not)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("[project.optional-dependencies]") :]
    section = section[: section.index("\n[", 1)]
    return set(re.findall(r"^([a-z][a-z0-9-]*) = \[", section, re.M))


@pytest.mark.parametrize("page", [page for page in PAGES if commands(page)])
def test_the_commands_of_each_page_exist_and_run(
    page: str, request: pytest.FixtureRequest, key_prefix: str
) -> None:
    """``pip install`` names an extra that exists, ``make`` a target of the Makefile, and each
    ``taskdedup`` command runs (on the tests' Redis, under the test's own prefix) without a
    usage error or a crash (exit 0, or 1: nothing held, or a warning from ``doctor``)."""
    from click.testing import CliRunner

    from taskdedup.cli import cli

    for command in commands(page):
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                match = re.fullmatch(r"taskdedup(?:\[([a-z,]+)\])?", spec)
                assert match, f"{page}: pip install of {spec!r}"
                assert set(filter(None, (match.group(1) or "").split(","))) <= extras(), command
        elif words[0] == "make":
            assert set(words[1:]) <= make_targets(), f"{page}: {command}"
        elif words[0] == "taskdedup":
            args = words[1:]
            if REDIS in args:
                redis_url = request.getfixturevalue("redis_url")
                args = [redis_url if arg == REDIS else arg for arg in args]
                args = [key_prefix if arg == "taskdedup" else arg for arg in args]
            done = CliRunner().invoke(cli, args, prog_name="taskdedup")
            assert done.exception is None or isinstance(done.exception, SystemExit), (
                f"{page}: {command}\n{done.output}"
            )
            assert done.exit_code in (0, 1), (
                f"{page}: {command} exited {done.exit_code}\n{done.output}"
            )
        else:
            raise AssertionError(f"{page}: a command the test does not know: {command}")


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    """What ``make docs`` runs: ``mkdocs build --strict`` fails on any warning (a broken link,
    a page outside the nav, a docstring mkdocstrings cannot read)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make test has it)")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "bench-throughput.png").is_file()
