"""The one line an app or broker logs when taskdedup starts working for it in a process: what
store, which switches, which tasks under which strategy. It answers "is it on, and against
what?" from a worker's log without a shell on the host."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .policy import TaskPolicy
from .settings import Settings
from .stores.base import Store

log = logging.getLogger("taskdedup")


def summary(settings: Settings, store: Store, policies: Mapping[str, TaskPolicy]) -> str:
    """``taskdedup 0.1.0 on redis://…/0 (prefix taskdedup): enabled, on_store_error=enqueue,
    3 tasks (until_executed 2, while_executing 1)``."""
    from . import __version__

    strategies = Counter(tp.policy.strategy for tp in policies.values())
    tasks = ", ".join(f"{name} {n}" for name, n in sorted(strategies.items()))
    switches = ["enabled" if settings.enabled else "DISABLED (kill switch)"]
    if settings.dry_run:
        switches.append("DRY RUN (decides and logs, drops nothing)")
    switches.append(f"on_store_error={settings.on_store_error}")
    if settings.disabled_tasks:
        switches.append(f"disabled_tasks={','.join(sorted(settings.disabled_tasks))}")
    if settings.metrics:
        switches.append("metrics on")
    counted = f"{len(policies)} deduplicated task{'' if len(policies) == 1 else 's'}"
    return (
        f"taskdedup {__version__} on {describe(store)} (prefix {settings.key_prefix}): "
        f"{', '.join(switches)}; {counted}{f' ({tasks})' if tasks else ''}"
    )


def describe(store: Store) -> str:
    """The store's URL without its password, or its class for a store made from clients."""
    url: str | None = getattr(store, "url", None)
    if not url:
        return type(store).__name__
    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname or ""
        user = parts.username or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    if parts.query:  # redis-py also takes ?password=...
        query = parse_qsl(parts.query, keep_blank_values=True)
        hidden = [(k, "***" if k.lower() == "password" else v) for k, v in query]
        parts = parts._replace(query=urlencode(hidden, safe="*"))
    return str(urlunsplit(parts))


def announce(settings: Settings, store: Store, policies: Mapping[str, TaskPolicy]) -> None:
    """Log :func:`summary` at INFO on the ``taskdedup`` logger."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", summary(settings, store, policies))
