"""``install(app)``: one call that wires taskdedup into a Celery app, idempotently.

The settings are read when the app finalizes, as Celery reads its own (a ``config_from_object``
after ``install()`` counts), and every task's declaration is checked then: ``app.finalize`` is
wrapped, so an error reaches whoever finalized the app (a worker refuses to start) instead of
being logged and dropped by Celery's signal dispatch.
"""

from __future__ import annotations

import functools
from typing import Any

from celery import signals

from ..errors import ConfigError
from ..stores import Store
from .beat import hook_scheduler
from .eager import hook_apply
from .publish import Publisher
from .revoke import install_revoke_command, on_received, on_revoked
from .state import CeleryDedup, _installed, integration_for
from .tasks import DECLARED
from .worker import Worker, wrap_task

__all__ = ["CeleryDedup", "install", "integration_for"]


def install(app: Any, store: Store | None = None, **settings: Any) -> CeleryDedup:
    """Wire taskdedup into ``app``: every publish path and every end of a job on the worker.

    ``settings`` override ``app.conf.taskdedup_*`` (``TASKDEDUP_*`` variables override both);
    the configuration is read when the app finalizes. Calling it again without arguments or
    with the same ones returns the same integration; with other arguments it is a ConfigError.
    """
    integ = _installed.get(app)
    if integ is not None:
        if integ.same_install(store, settings):
            return integ
        raise ConfigError(
            f"install() was already called for app {app.main!r} with other arguments; "
            "call it once per app, with all of its settings (or set app.conf.taskdedup_*)"
        )
    integ = CeleryDedup(app, store, settings)
    _installed[app] = integ
    hook_scheduler()
    worker = Worker(integ)
    publisher = Publisher(integ, app.send_task)
    integ.publisher = publisher
    integ.preparers = [functools.partial(wrap_task, worker), publisher.wrap_apply_async]
    app.send_task = publisher
    _hook_finalize(app, integ)
    if app.finalized:
        integ.finalized()

    def revoked(sender: Any = None, request: Any = None, **told: Any) -> None:
        """``task_revoked``: a discarded, expired or terminated job frees its key and slot."""
        if request is not None:
            why = next((w for w in ("terminated", "expired") if told.get(w)), "revoked")
            on_revoked(integ, sender, request, why)

    def received(sender: Any = None, request: Any = None, **_: Any) -> None:
        """``task_received``: a job that expires before its ETA frees its key and slot now."""
        if request is not None:
            on_received(integ, sender, request)

    for ready in (signals.worker_init, signals.worker_process_init, signals.celeryd_after_setup):
        ready.connect(integ.wrap_tasks, weak=False)  # tasks registered after finalize
    signals.task_revoked.connect(revoked, weak=False)
    signals.task_received.connect(received, weak=False)
    install_revoke_command()  # an ETA job a worker holds frees its key when it is revoked
    hook_apply()  # eager mode (task_always_eager, task.apply()) deduplicates as production
    if prepare_declared not in DECLARED:
        DECLARED.append(prepare_declared)
    return integ


def prepare_declared(task: Any) -> None:
    """A policy declared on a task object: prepare it now if its app has taskdedup."""
    app = getattr(task, "_app", None)
    integ = None if app is None else integration_for(app)
    if integ is not None:
        integ.prepare(task)


def _hook_finalize(app: Any, integ: CeleryDedup) -> None:
    """Run ``integ.finalized()`` at the end of every ``app.finalize()``, outside Celery's
    signal dispatch (which would log a ConfigError and carry on); prepare a class-based task
    as ``app.register_task`` (which finalizes first) registers it, so its bad declaration
    raises there too."""
    original, register = app.finalize, app.register_task

    @functools.wraps(original)
    def finalize(auto: bool = False) -> None:
        original(auto)
        integ.finalized()

    def register_task(task: Any, **options: Any) -> Any:
        integ.prepare(registered := register(task, **options))
        return registered

    app.finalize, app.register_task = finalize, register_task
