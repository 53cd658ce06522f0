"""What both drop-ins share: a Celery Task whose dedup is taskdedup's, plus the peer's key.

A subclass says four things about its peer: the peer's key of a call (:meth:`peer_key`), the
peer's ttl (:meth:`peer_ttl_ms`), taskdedup's policy that matches the peer's options
(:meth:`peer_policy`), and what a duplicate gets (:meth:`peer_duplicate`). Everything else is
here, once:

- taskdedup is installed on the task's app when the task is bound (``install(app)``, with the
  peer's Redis as the store when neither broker nor result backend is Redis);
- ``apply_async`` takes the peer's key (:mod:`.mirror`), then publishes through taskdedup,
  which takes its own lock; a publish that fails gives the peer's key back;
- on the worker, the body runs under taskdedup's claim and lease; the peer's key goes on the
  same lease while it runs, back on the peer's ttl for a retry, and is deleted at the end
  (``release_peer``), and when taskdedup frees the job on revoke, expiry or termination
  (``taskdedup_freed``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast
from urllib.parse import urlsplit

from celery import Task
from kombu.utils.uuid import uuid

from ..celery.messages import header
from ..celery.state import CeleryDedup, integration_for
from ..celery.tasks import task_policy
from ..decide.guards import GuardFree, GuardHeld, guarding
from ..errors import ConfigError
from ..policy import TaskPolicy
from ..stores.base import Guard, Inspect
from .mirror import KEEPER, PEER_KEY_HEADER
from .peer import PeerHooks, guard_for, held_lately, recent_keys

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+socket")
#: This thread's call in progress: a compat publish (eager mode reaches ``apply`` from it) or
#: a direct ``task.apply()`` (its run takes no lock).
_CALL = threading.local()
log = logging.getLogger("taskdedup")
T = TypeVar("T")


def freeze(fn: Callable[[Any], T]) -> Callable[[Any], T]:
    """A method's result cached on the instance (the peer's backend, built once)."""
    name = "_compat_" + fn.__name__

    @functools.wraps(fn)
    def cached(self: Any) -> T:
        try:
            return cast(T, self.__dict__[name])
        except KeyError:
            value = self.__dict__[name] = fn(self)
            return value

    return cached


class CompatTask(PeerHooks, Task):  # type: ignore[misc]
    """The shared base of :class:`~taskdedup.compat.celery_once.QueueOnce` and
    :class:`~taskdedup.compat.celery_singleton.Singleton`: a Celery Task with the peer's
    hooks (:class:`~taskdedup.compat.peer.PeerHooks`)."""

    abstract = True
    #: taskdedup's fast path for keys seen held lately would answer before the peer's rules;
    #: a compat task always takes the full path (a non-None value makes the wrapper skip it).
    _taskdedup_apply_async: ClassVar[Any] = False

    # ------------------------------------------------------------ taskdedup's side

    @property
    def deduplicate(self) -> dict[str, Any]:
        """taskdedup's policy for this task, translated from the peer's options (the peers
        lock a job sent with a countdown or ETA as any other). Made once per task: taskdedup
        binds a policy again whenever it is handed another dict."""
        return self._deduplicate()

    @freeze
    def _deduplicate(self) -> dict[str, Any]:
        return {**self.peer_policy(), "including_scheduled": True}

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        _install(app, cls)

    # ------------------------------------------------------------ the producer

    def apply_async(self, args: Any = None, kwargs: Any = None, **call: Any) -> Any:
        app = self._get_app()
        if not app.finalized:  # (finalizing sets taskdedup's store: the peer's Redis, when
            app.finalize(auto=True)  # the app has none; a first call may come before that)
        options = {k: v for k, v in call.items() if k not in self.peer_options}
        if options.get("retries"):  # Task.retry: this job's own republish keeps its locks
            key = self._request_peer_key(args, kwargs)
            mirror = self.peer_mirror()
            if mirror is not None and key is not None:
                KEEPER.drop(mirror, key)
                mirror.hold(key, str(options.get("task_id")), self.peer_ttl_ms(call))
            return super().apply_async(args, kwargs, **options)
        key = self.peer_key(args, kwargs)
        task_id = options.pop("task_id", None) or uuid()
        taken, guard = False, None
        if held_lately(self, key):  # a likely duplicate: the peer's key alone, one round trip
            taken, read = self.peer_mirror().take_or_read(  # type: ignore[union-attr]
                key, task_id, self.peer_ttl_ms(call), self.peer_reads
            )
            if not taken and read is not None:
                self._note_duplicate(key, read if self.peer_reads == "value" else None)
                return self.peer_answer(key, read, call)
        else:  # a likely new key: both keys in taskdedup's acquire, where they can be
            guard = self._guard(key, task_id, call)
        if guard is not None:
            try:
                return self._publish_guarded(guard, args, kwargs, options, call)
            except GuardFree:  # the peer's side freed its key, not taskdedup's lock: as below
                pass
        try:
            answer = None if taken else self.peer_take(key, task_id, call)
        except Exception as exc:
            if getattr(exc, "countdown", None) is not None or getattr(exc, "task_id", None):
                self._note_duplicate(key, getattr(exc, "task_id", None))  # the peer's error
            raise
        if answer is not None:
            self._note_duplicate(key, getattr(answer, "id", None))
            return answer
        options["headers"] = {**(options.get("headers") or {}), PEER_KEY_HEADER: key}
        result = self._publish(key, task_id, args, kwargs, options)
        if getattr(result, "deduplicated", False) and self._free_stale(args, kwargs, result.id):
            result = self._publish(key, task_id, args, kwargs, options)
        return self._held_by_another(key, task_id, result, call, args, kwargs)

    def _guard(self, key: str, task_id: str, call: dict[str, Any]) -> Guard | None:
        integ, policy = self._native()
        if integ is None or policy is None:
            return None
        return guard_for(self, integ, key, task_id, call)

    def _publish_guarded(
        self, guard: Guard, args: Any, kwargs: Any, options: Any, call: dict[str, Any]
    ) -> Any:
        """Publish with the peer's key taken by taskdedup's acquire; a key another holds
        answers as the peer does; GuardFree: the key is free but taskdedup's lock is held."""
        key, task_id = guard.key, guard.value
        options["headers"] = {**(options.get("headers") or {}), PEER_KEY_HEADER: key}
        try:
            with guarding(guard) as state:
                result = self._publish(key, task_id, args, kwargs, options)
        except GuardHeld as held:
            self._note_duplicate(key, held.answer if self.peer_reads == "value" else None)
            return self.peer_answer(key, held.answer, call)
        mirror = self.peer_mirror()
        if not state.used and mirror is not None:  # (no acquire carried it: taken after)
            mirror.take(key, task_id, guard.ttl_ms)
        return self._held_by_another(key, task_id, result, call, args, kwargs)

    def _held_by_another(
        self, key: str, task_id: str, result: Any, call: dict[str, Any], args: Any, kwargs: Any
    ) -> Any:
        """The publish's answer: ``result``, or the peer's answer for a duplicate of a job
        that taskdedup's lock names and the peer's key did not."""
        recent_keys(self).mark(key)  # (held now: a call of it soon is likely a duplicate)
        if getattr(result, "deduplicated", False) and result.id != task_id:
            # taskdedup's lock has a running holder the peer's key did not name: the key
            # names the holder again, for old producers, for what is left of the lock's
            # life (its worker renews the key with the lease; if that worker died, the key
            # lapses with taskdedup's own lock, not a lease later), and the caller gets the
            # peer's answer
            self.peer_give_back(key, task_id)
            mirror, left_ms = self.peer_mirror(), self._lock_left_ms(args, kwargs, result.id)
            if mirror is not None and left_ms > 0:
                mirror.take(key, result.id, left_ms)
            return self.peer_duplicate(key, result.id, call)
        return result

    def _lock_left_ms(self, args: Any, kwargs: Any, holder: str) -> int:
        """How long taskdedup's lock of this call still lives, while ``holder`` holds it."""
        integ, policy = self._native()
        if integ is None or policy is None:
            return 0
        info = integ.dedup.store.run(Inspect(policy.key_for(args or (), kwargs or {})))
        return info.ttl_ms if info is not None and info.job_id == holder else 0

    def _note_duplicate(self, peer_key: str, holder: str | None) -> None:
        """A duplicate the peer's key answered never reached taskdedup's core: count and log
        it there as the core's own (metrics, the ``taskdedup`` logger, signals)."""
        recent_keys(self).mark(peer_key)
        integ, _ = self._native()
        if integ is not None:
            integ.dedup.note(
                "enqueue", "duplicate", logging.INFO, self.name, holder=holder, peer_key=peer_key
            )

    def _publish(self, key: str, task_id: str, args: Any, kwargs: Any, options: Any) -> Any:
        """Publish through taskdedup; a publish that fails gives the peer's key back."""
        _CALL.publishing = True  # (eager mode: Celery's apply_async calls apply)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except (GuardHeld, GuardFree):  # (the guard was not taken: nothing to give back)
            raise
        except BaseException:
            self.peer_give_back(key, task_id)
            raise
        finally:
            _CALL.publishing = False

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """``task.apply()`` called directly runs the body here and now, taking and freeing
        no lock, as the peers' does (taskdedup's own ``apply()`` would answer a duplicate of a
        queued job without running it). Eager mode's ``apply_async`` comes here with its
        locks already taken, and runs as taskdedup's eager mode does."""
        if getattr(_CALL, "publishing", False) or options.get("retries"):  # (eager retry)
            _CALL.publishing = False
            return super().apply(args, kwargs, **options)
        plain = getattr(Task.apply, "__wrapped__", Task.apply)  # (taskdedup's eager hook)
        _CALL.direct = True
        try:
            return plain(self, args, kwargs, **options)
        finally:
            _CALL.direct = False

    def _free_stale(self, args: Any, kwargs: Any, holder: str) -> bool:
        """The peer's key was free, yet taskdedup's lock has a holder: the peer's side freed
        it (an old worker ran the job and deleted its key, or ``clear_locks``, or its ttl
        ran out). The peer's key decides, as it does for old producers: a holder still
        queued is let go; a running one keeps its lock (no second run beside it)."""
        integ, policy = self._native()
        if integ is None or policy is None:
            return False
        native_key = policy.key_for(args or (), kwargs or {})
        return integ.dedup.release(native_key, holder, task=self.name, queued_only=True)

    # ------------------------------------------------------------ the worker

    def _request_peer_key(self, args: Any, kwargs: Any) -> str | None:
        key = header(self.request, PEER_KEY_HEADER)
        if key:
            return str(key)
        try:
            return self.peer_key(args, kwargs)
        except Exception:  # the worker's arguments do not make a key: nothing to free
            return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or not request.id:  # task(...): no lock, as the peers
            return super().__call__(*args, **kwargs)
        if getattr(_CALL, "direct", False):  # task.apply(): the body alone
            _CALL.direct = False
            return (getattr(self, "_taskdedup_run", None) or self.run)(*args, **kwargs)
        mirror = self.peer_mirror()
        key = self._request_peer_key(args, kwargs) if mirror is not None else None
        if mirror is None or key is None:
            return super().__call__(*args, **kwargs)
        if self.unlocks_at_start():
            mirror.release(key, request.id) or (
                self.adopts_any_holder and mirror.force_release(key)
            )
            return super().__call__(*args, **kwargs)
        _read_late()
        lease_ms = int(self._lease_seconds() * 1000)
        # written now, read when the body ends: the round trip overlaps taskdedup's claim.
        # Renewing a key this job did not adopt does nothing (the renewal names the job).
        adopted = mirror.send_adopt(key, request.id, lease_ms, self.adopts_any_holder)
        KEEPER.keep(mirror, key, request.id, lease_ms)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            KEEPER.drop(mirror, key)
            _quietly(adopted.reply)

    def _lease_seconds(self) -> float:
        _, policy = self._native()
        return policy.policy.lease_seconds if policy is not None else 30.0

    def _native(self) -> tuple[CeleryDedup | None, TaskPolicy | None]:
        """taskdedup's integration of this task's app and the task's bound policy (either
        None before taskdedup is installed)."""
        integ = integration_for(self._get_app())
        return integ, None if integ is None else task_policy(self, integ.settings)

    def taskdedup_freed(self, request: Any, why: str) -> None:
        """taskdedup freed this job's lock on revoke, expiry or termination (on the worker,
        at the revoke command for an ETA job it holds): free the peer's key if it names it."""
        mirror = self.peer_mirror()
        job_id = getattr(request, "id", None)
        if mirror is None or not job_id:
            return
        key = header(request, PEER_KEY_HEADER)
        if not key and getattr(request, "args", None) is not None:
            try:
                key = self.peer_key(request.args, request.kwargs)
            except Exception:  # its arguments make no key: nothing was taken
                return
        if key:
            KEEPER.drop(mirror, str(key))
            mirror.release(str(key), job_id)

    def release_peer(self, args: Any, kwargs: Any) -> None:
        """The job ended (success or final failure): free the peer's key if it names this job."""
        if self.unlocks_at_start():
            return
        mirror = self.peer_mirror()
        key = self._request_peer_key(args, kwargs) if mirror is not None else None
        if mirror is not None and key is not None and self.request.id:
            KEEPER.drop(mirror, key)
            _read_late()
            _CALL.late = mirror.send_release(key, self.request.id)  # read at the next job


def _read_late() -> None:
    """Read the reply of this thread's last release, written when its job ended."""
    late = getattr(_CALL, "late", None)
    if late is not None:
        _CALL.late = None
        _quietly(late.reply)


def _quietly(call: Callable[[], Any]) -> None:
    """A worker's call on the peer's key that failed (its Redis is down) is logged; the job's
    own outcome stands, and the key lapses with its lease."""
    try:
        call()
    except Exception:
        log.warning("taskdedup.compat: the peer's key could not be updated", exc_info=True)


def _install(app: Any, cls: type) -> None:
    """``install(app)`` once per app, and the revoke hook once per process."""
    if getattr(app, "_taskdedup_compat", False):
        return
    app._taskdedup_compat = True
    from ..celery import install

    def default_store(sender: Any = None, **_: Any) -> None:
        _default_store(app)

    # (the store must be set before install's own receivers read the settings; an app that
    # is finalized already, binding its tasks now, has install read them at once)
    app.on_after_finalize.connect(default_store, weak=False)
    if integration_for(app) is None:
        if app.finalized:
            _default_store(app)
        install(app)


def _default_store(app: Any) -> None:
    """With no Redis broker or result backend and no ``taskdedup_url``, taskdedup keeps its
    locks in the peer's Redis (the one the original package was configured with)."""
    conf = app.conf
    if conf.get("taskdedup_url"):
        return
    for candidate in (conf.broker_url, conf.result_backend):
        if isinstance(candidate, str) and urlsplit(candidate).scheme in REDIS_SCHEMES:
            return
    urls = []
    for task in list(app._tasks.values()):  # (app.tasks would finalize: settings read first)
        if isinstance(task, CompatTask):
            try:
                url = task.peer_url()
            except ConfigError:
                continue
            if url:
                urls.append(url)
    if urls:
        conf.taskdedup_url = urls[0]
