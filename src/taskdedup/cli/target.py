"""What the CLI works on: a store, the settings, and the policies of the app's tasks.

Found from a Celery app (``-A proj.celery_app``, as ``celery -A`` takes it), a taskiq broker
(``--broker-module proj.tasks:broker``) or a bare store (``--url`` and ``--prefix``). An app or
broker gives the policies too, which ``doctor`` and ``explain`` need.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

import click

from ..policy import TaskPolicy
from ..settings import Settings
from ..stores.base import Store


@dataclasses.dataclass
class Target:
    store: Store
    settings: Settings
    policies: dict[str, TaskPolicy]  # task name -> its bound policy
    app: Any = None  # the Celery app, when the CLI was given one
    broker: Any = None  # the taskiq broker, when given one
    dedup: Any = None  # the app's or broker's Deduplicator, when given one


def resolve(app: str | None, broker_module: str | None, url: str | None, prefix: str) -> Target:
    """The target the options name; a click.UsageError naming what to pass when none does. A
    module is looked for in the current directory too, as ``celery -A`` and ``taskiq worker``
    look for it."""
    if (app or broker_module) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if app is not None:
        return _celery(app)
    if broker_module is not None:
        return _taskiq(broker_module)
    if url is not None:
        from ..stores import from_url

        return Target(from_url(url, key_prefix=prefix), Settings(), {})
    raise click.UsageError(
        "say where the locks are: -A proj.celery_app (a Celery app that calls "
        "taskdedup.celery.install), --broker-module proj.tasks:broker (a taskiq broker with "
        "DedupMiddleware), or --url redis://host:6379/0 [--prefix taskdedup]"
    )


def _celery(name: str) -> Target:
    from celery.app.utils import find_app

    try:
        app = find_app(name)
    except Exception as exc:
        raise click.UsageError(f"-A {name}: could not load a Celery app ({exc})") from None
    try:
        return for_app(app)
    except LookupError as exc:
        raise click.UsageError(f"-A {name}: {exc}") from None


def for_app(app: Any) -> Target:
    """The target of a Celery app object (LookupError when taskdedup is not installed), its
    task modules imported as a worker imports them (``include``, ``imports``, Django's
    ``autodiscover_tasks``), so every task's policy is there."""
    from ..celery import integration_for

    app.loader.import_default_modules()
    app.finalize(auto=True)
    integ = integration_for(app)
    if integ is None:
        raise LookupError(
            "taskdedup is not installed on this app; call taskdedup.celery.install(app) where "
            "the app is made"
        )
    policies = integ.bound_policies(strict=True)
    return Target(integ.dedup.store, integ.settings, policies, app=app, dedup=integ.dedup)


def _taskiq(spec: str) -> Target:
    module_name, _, attr = spec.partition(":")
    try:
        broker = getattr(importlib.import_module(module_name), attr or "broker")
    except Exception as exc:
        raise click.UsageError(f"--broker-module {spec}: could not load it ({exc})") from None
    try:
        return for_broker(broker)
    except LookupError as exc:
        raise click.UsageError(f"--broker-module {spec}: {exc}") from None


def for_broker(broker: Any) -> Target:
    """The target of a taskiq broker object (LookupError when it has no DedupMiddleware)."""
    from ..taskiq import DedupMiddleware

    found = [m for m in getattr(broker, "middlewares", []) if isinstance(m, DedupMiddleware)]
    if not found:
        raise LookupError(
            "this broker has no DedupMiddleware; add it with "
            "broker.with_middlewares(DedupMiddleware(...))"
        )
    mw = found[0]
    policies = mw.bound_policies(strict=True)  # a bad declaration fails here, as at definition
    return Target(mw.dedup.store, mw.settings, policies, broker=broker, dedup=mw.dedup)
