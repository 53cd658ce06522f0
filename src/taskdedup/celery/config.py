"""Settings and store for a Celery app: ``app.conf.taskdedup_*``, then ``TASKDEDUP_*``."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..settings import Settings
from ..stores import MemoryStore, RedisStore, Store

REDIS_SCHEMES = ("redis", "rediss", "unix")


def settings_from_app(app: Any, overrides: dict[str, Any]) -> Settings:
    """Settings from the app's ``taskdedup_*`` config and ``install()`` arguments; env wins."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Settings):
        value = app.conf.get(f"taskdedup_{field.name}")
        if value is not None:
            values[field.name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings.load(values)


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
    if url.startswith("memory://"):
        return MemoryStore(prefix=settings.key_prefix)
    return RedisStore.from_url(url, prefix=settings.key_prefix)
