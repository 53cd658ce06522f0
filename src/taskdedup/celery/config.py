"""Settings and store for a Celery app: ``app.conf.taskdedup_*``, then ``TASKDEDUP_*``."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..settings import Settings
from ..stores import Store, from_url
from ..suggest import did_you_mean

REDIS_SCHEMES = ("redis", "rediss", "unix")
PREFIX = "taskdedup_"


def settings_from_app(app: Any, overrides: dict[str, Any]) -> Settings:
    """Settings from the app's ``taskdedup_*`` config and ``install()`` arguments; env wins."""
    values = app_values(app)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings.load(values)


def app_values(app: Any) -> dict[str, Any]:
    """Every ``taskdedup_<name>`` key of ``app.conf``, in any case, and under the namespace of
    ``config_from_object(obj, namespace="CELERY")`` as ``CELERY_TASKDEDUP_<NAME>`` (Django's
    settings). A name that is no setting is a ConfigError naming the nearest one: a
    misspelled setting must not be silently ignored."""
    conf = app.conf
    namespace = (getattr(conf, "prefix", None) or "").lower()
    fields = {field.name for field in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key in list(conf.keys()):
        if not isinstance(key, str):
            continue
        lowered = key.lower()
        if namespace and lowered.startswith(namespace):
            lowered = lowered[len(namespace) :]
        if not lowered.startswith(PREFIX):
            continue
        name = lowered[len(PREFIX) :]
        if name not in fields:
            raise _unknown(key, name, fields)
        value = conf.get(key)
        if name in given and value is not None and values.get(name) != value:
            raise ConfigError(
                f"Celery settings {given[name]!r} and {key!r} set {name} to different values"
            )
        if value is not None:
            values[name], given[name] = value, key
    return values


def _unknown(key: str, name: str, fields: set[str]) -> ConfigError:
    """The error for a misspelled setting, suggesting the nearest one spelled as ``key`` is."""
    head = key[: len(key) - len(name)]  # e.g. "CELERY_TASKDEDUP_"
    upper = key.isupper()
    hint = did_you_mean(name, fields, lambda n: head + (n.upper() if upper else n))
    return ConfigError(f"unknown Celery setting {key!r}{hint}")


def store_for_app(app: Any, settings: Settings) -> Store:
    """The store: ``settings.url``, else the broker, else the result backend, when Redis."""
    url = settings.url
    if url is None:
        for candidate in (app.conf.broker_url, app.conf.result_backend):
            if isinstance(candidate, str) and urlsplit(candidate).scheme in REDIS_SCHEMES:
                url = candidate
                break
    if url is None:
        raise ConfigError(
            "taskdedup needs a Redis store and neither the broker "
            f"({app.conf.broker_url!r}) nor the result backend ({app.conf.result_backend!r}) "
            "is Redis: set app.conf.taskdedup_url or TASKDEDUP_URL to a redis:// URL "
            "(or memory:// for a single process)"
        )
    return from_url(url, **settings.store_options())
