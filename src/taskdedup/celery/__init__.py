"""taskdedup for Celery: ``install(app)`` once, then ``@deduplicate(...)`` per task.

from taskdedup.celery import deduplicate, install

install(app)

@deduplicate("until_executed", ttl=600, keys=["user_id"])
@app.task
def rebuild(user_id, force=False): ...
"""

from __future__ import annotations

from .integration import install
from .state import CeleryDedup, integration_for
from .tasks import deduplicate, pace, reserve

__all__ = ["CeleryDedup", "deduplicate", "install", "integration_for", "pace", "reserve"]
