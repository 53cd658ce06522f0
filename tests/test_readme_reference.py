"""The documentation's reference says the truth: every setting, policy option, reservation
option, header, label, metric and pytest fixture in the code is on its page with its default,
and every one the README or a page of docs/ names exists.

A setting added without a line in the docs, a default changed in one place only, or a name the
docs keep after the code dropped it fails here. (The reference moved from README.md to the
pages of docs/; each table is read from the page that holds it.)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from taskdedup import Policy, ReservePolicy, Settings
from taskdedup.celery import messages
from taskdedup.decide import envelope
from taskdedup.taskiq import options as taskiq_options

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Where each reference lives now: its title, and the page of docs/ that holds it.
PAGES = {
    "Settings": "reference/settings.md",
    "Policy options": "reference/policy.md",
    "Reservation guard": "strategies/reservations.md",
    "Message headers and labels": "reference/headers.md",
    "Metrics and events": "operating/metrics.md",
    "Testing your tasks": "testing.md",
}
#: Every page a user reads for what to write: the README and the pages of docs/, but the
#: research notes and the two pages about the code's insides (design.md, the contract kept word
#: for word with the team's copy; architecture.md, which names internal hooks).
README = "\n".join(
    path.read_text()
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    if "research" not in path.relative_to(ROOT).parts
    and path.relative_to(ROOT).as_posix() not in ("docs/design.md", "docs/architecture.md")
)


def section(title: str) -> str:
    """The text of the page of docs/ that holds the reference ``title``."""
    return (DOCS / PAGES[title]).read_text()


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the markdown tables in ``text`` whose first cell is a `name`: name -> cells."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^\| `([a-z_]+)=?` ", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return rows


def shown(default: Any) -> str:
    """A default as the docs write it in its default column."""
    if isinstance(default, frozenset) and not default:
        return "empty"
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"`{default}`"


def test_every_setting_is_in_the_settings_table_with_its_default_and_no_other() -> None:
    rows = table_rows(section("Settings"))
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert set(rows) == set(fields), "Settings table vs Settings fields"
    for name, default in fields.items():
        assert rows[name][1].startswith(shown(default)), (name, rows[name][1], shown(default))
        assert rows[name][3] == f"`TASKDEDUP_{name.upper()}`", name


def test_every_policy_option_is_in_the_policy_block_with_its_default_and_no_other() -> None:
    block = section("Policy options")
    named = dict(re.findall(r"^\s+([a-z_]+)=.*?#\s*(.*)$", block, re.MULTILINE))
    fields = {f.name for f in dataclasses.fields(Policy)}
    assert set(named) == fields, "Policy options vs Policy fields"
    for name in fields:
        default = dataclasses.fields(Policy)[
            [f.name for f in dataclasses.fields(Policy)].index(name)
        ]
        assert named[name].startswith("default"), (name, named[name])
        said = named[name].split(";")[0]
        assert str(default.default).split(".")[0] in said or name in ("ttl",), (name, said)


def test_every_reservation_option_is_in_the_reservation_table() -> None:
    rows = table_rows(section("Reservation guard"))
    fields = {f.name for f in dataclasses.fields(ReservePolicy)}
    assert fields <= set(rows), fields - set(rows)


def test_every_header_and_label_is_in_the_reference_and_every_named_one_exists() -> None:
    headers = {
        value
        for name, value in vars(messages).items()
        if name.endswith(("_HEADER", "_OPTION")) and isinstance(value, str)
    }
    labels = {
        value
        for name, value in vars(taskiq_options).items()
        if name.endswith("_LABEL") and isinstance(value, str) and value.startswith("taskdedup_")
    }
    carried = {
        value
        for name, value in vars(envelope).items()
        if name.isupper() and isinstance(value, str) and value.startswith("taskdedup_")
    }
    rows = table_rows(section("Message headers and labels"))
    assert headers | labels | carried == set(rows), "headers/labels table vs the code"
    celery_settings = {f"taskdedup_{f.name}" for f in dataclasses.fields(Settings)}
    named = set(re.findall(r"`(taskdedup_[a-z_]+)`", README))
    unknown = named - set(rows) - celery_settings - set(registered_metrics()) - plugin_fixtures()
    assert not unknown, f"the docs name what the code does not have: {sorted(unknown)}"


def registered_metrics() -> list[str]:
    prometheus_client = pytest.importorskip("prometheus_client")
    from taskdedup.metrics import Metrics

    registry = prometheus_client.CollectorRegistry()
    Metrics(registry)
    return [
        family.name + ("_total" if family.type == "counter" else "")
        for family in registry.collect()
    ]


def test_every_metric_is_in_the_metrics_table_and_no_other() -> None:
    rows = table_rows(section("Metrics and events"))
    metrics = {name for name in rows if name.startswith("taskdedup_")}
    assert metrics == set(registered_metrics())


def plugin_fixtures() -> set[str]:
    from taskdedup.testing import plugin

    return {name for name in vars(plugin) if name.startswith("taskdedup_")}


def test_every_fixture_of_the_plugin_is_in_the_testing_table_and_no_other() -> None:
    rows = table_rows(section("Testing your tasks"))
    assert {name for name in rows if name.startswith("taskdedup_")} == plugin_fixtures()
