"""Settings flags: code values, overridden by TASKDEDUP_* environment variables."""

from __future__ import annotations

import pytest

from taskdedup import ConfigError, Policy, Settings


def test_defaults_are_the_documented_ones() -> None:
    s = Settings()
    assert (s.enabled, s.dry_run, s.on_store_error, s.key_prefix) == (
        True,
        False,
        "enqueue",
        "taskdedup",
    )
    assert (s.default_strategy, s.default_ttl, s.default_lease) == ("until_executing", 21600, 30)
    assert s.disabled_tasks == frozenset()


def test_environment_wins_over_code() -> None:
    env = {
        "TASKDEDUP_ENABLED": "false",
        "TASKDEDUP_DRY_RUN": "yes",
        "TASKDEDUP_DISABLED_TASKS": "a.b, c.d",
        "TASKDEDUP_DEFAULT_TTL": "60",
        "TASKDEDUP_ON_STORE_ERROR": "raise",
        "TASKDEDUP_URL": "redis://example:6379/1",
    }
    s = Settings.load({"enabled": True, "default_ttl": 10, "key_prefix": "app"}, environ=env)
    assert not s.enabled and s.dry_run and s.on_store_error == "raise"
    assert s.disabled_tasks == frozenset({"a.b", "c.d"})
    assert s.default_ttl == 60 and s.key_prefix == "app" and s.url == "redis://example:6379/1"


def test_task_policies_take_the_process_defaults() -> None:
    s = Settings(default_strategy="until_executed", default_ttl=120, default_lease=9)
    p = s.policy({"keys": ["x"]})
    assert (p.strategy, p.ttl, p.lease, p.keys) == ("until_executed", 120, 9, ("x",))
    assert s.policy("until_expired").strategy == "until_expired"
    explicit = Policy("while_executing")
    assert s.policy(explicit) is explicit


@pytest.mark.parametrize(
    ("values", "env", "words"),
    [
        ({"on_store_error": "ignore"}, {}, "on_store_error"),
        ({"default_strategy": "once"}, {}, "default_strategy"),
        ({"default_ttl": 0}, {}, "default_ttl"),
        ({"bogus": 1}, {}, "bogus"),
        ({}, {"TASKDEDUP_ENABLED": "maybe"}, "TASKDEDUP_ENABLED"),
        ({}, {"TASKDEDUP_DEFAULT_LEASE": "soon"}, "TASKDEDUP_DEFAULT_LEASE"),
    ],
)
def test_bad_settings_say_which_and_what(values: dict, env: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=words):
        Settings.load(values, environ=env)


def test_policy_options_from_a_mapping_reject_unknown_names() -> None:
    with pytest.raises(ConfigError, match="stratgy"):
        Policy.from_options({"stratgy": "until_executed"})
