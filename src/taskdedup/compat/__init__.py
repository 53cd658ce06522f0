"""Drop-in replacements for the peers Celery users run today, on taskdedup.

- :mod:`taskdedup.compat.celery_once`: ``QueueOnce``, ``AlreadyQueued`` and ``app.conf.ONCE``;
- :mod:`taskdedup.compat.celery_singleton`: ``Singleton``, ``DuplicateTaskError``,
  ``clear_locks`` and the ``singleton_*`` settings.

Each keeps what its peer does that a caller can see (the key, its value and ttl in Redis,
what a duplicate gets, when the lock is freed) and takes the peer's key beside taskdedup's own
lock, so old and new producers deduplicate against each other during a rolling deploy.
"""
