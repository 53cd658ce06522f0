"""A drop-in for celery-singleton: ``Singleton``, ``DuplicateTaskError``, ``clear_locks``.

Change one import and keep everything else::

    from taskdedup.compat.celery_singleton import Singleton, DuplicateTaskError, clear_locks

    @app.task(base=Singleton, unique_on=["username"], raise_on_duplicate=False, lock_expiry=600)
    def sync_user(username, full=False): ...

What stays as celery-singleton does it: the key ``<singleton_key_prefix><md5 of the task name
and the JSON of the arguments>`` and its value (the holder's task id) in the same Redis
(``singleton_backend_url``, else a ``redis://`` result backend, else the broker), ``SET NX EX``
with ``lock_expiry``/``singleton_lock_expiry``, a duplicate answered with the holder's
``AsyncResult`` or ``DuplicateTaskError`` (``raise_on_duplicate``), ``clear_locks(app)``, the
``singleton_*`` settings (Celery's ``CELERY_`` namespace too), eager mode. From the unreleased
master: ``unique_on=[]`` (the task name only), defaults bound for ``unique_on`` arguments and
``singleton_json_encoder_class``. The original package need not be installed.

What taskdedup adds (see docs/migration.md): ``self.retry()``
works (the original's retry met its own lock and never ran again), a worker killed mid-job or a
revoked job frees the key within its lease instead of never, a lock whose expiry passes while
the job runs stays held until it ends (no second run beside it), and the CLI, ``explain`` and
the metrics show every decision.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import inspect
import json
from typing import Any, ClassVar

from kombu.utils.uuid import uuid

from ..errors import ConfigError
from .base import CompatTask, freeze
from .mirror import RedisMirror

__all__ = [
    "BaseBackend",
    "CelerySingletonException",
    "Config",
    "DuplicateTaskError",
    "RedisBackend",
    "Singleton",
    "clear_locks",
    "generate_lock",
    "get_backend",
]

DEFAULT_BACKEND = "celery_singleton.backends.redis.RedisBackend"


class CelerySingletonException(Exception):
    """The base of celery-singleton's errors."""


class DuplicateTaskError(CelerySingletonException):
    """A duplicate was submitted with ``raise_on_duplicate``; ``task_id`` is the holder's."""

    def __init__(self, message: str, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(message)

    def __reduce__(self) -> Any:  # (the original could not be unpickled)
        return (type(self), (self.args[0], self.task_id))


def generate_lock(
    task_name: str,
    task_args: Any = None,
    task_kwargs: Any = None,
    key_prefix: str = "SINGLETONLOCK_",
    json_encoder_class: Any = None,
) -> str:
    """``key_prefix + md5(name + json(args) + json(kwargs))``: celery-singleton's key."""
    str_args = json.dumps(task_args or [], cls=json_encoder_class, sort_keys=True)
    str_kwargs = json.dumps(task_kwargs or {}, cls=json_encoder_class, sort_keys=True)
    digest = hashlib.md5((task_name + str_args + str_kwargs).encode()).hexdigest()
    return key_prefix + digest


def _resolve(value: Any) -> Any:
    """A class given as a class or as a dotted path."""
    if isinstance(value, str):
        if value == DEFAULT_BACKEND or value == "celery_singleton.backends.RedisBackend":
            return RedisBackend
        module_name, _, name = value.rpartition(".")
        return getattr(importlib.import_module(module_name), name)
    return value


class Config:
    """celery-singleton's settings, read from ``app.conf`` on every use (``singleton_*``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def _get(self, name: str, default: Any = None) -> Any:
        return self.app.conf.get("singleton_" + name, default)

    @property
    def backend_url(self) -> Any:
        url = self._get("backend_url")
        if url is not None:
            return url
        backend = self.app.conf.get("result_backend")
        if backend and str(backend).startswith("redis://"):
            return backend
        return self.app.conf.get("broker_url")

    @property
    def backend_class(self) -> Any:
        return _resolve(self._get("backend_class") or DEFAULT_BACKEND)

    @property
    def backend_kwargs(self) -> dict[str, Any]:
        return self._get("backend_kwargs") or {}

    @property
    def key_prefix(self) -> str:
        return str(self._get("key_prefix", "SINGLETONLOCK_"))  # ("" is a prefix, as there)

    @property
    def raise_on_duplicate(self) -> Any:
        return self._get("raise_on_duplicate")

    @property
    def lock_expiry(self) -> Any:
        return self._get("lock_expiry")

    @property
    def json_encoder_class(self) -> Any:
        return _resolve(self._get("json_encoder_class"))


class BaseBackend(abc.ABC):
    """What a custom ``singleton_backend_class`` implements (celery-singleton's interface)."""

    @abc.abstractmethod
    def lock(self, lock: str, task_id: str, expiry: Any = None) -> bool: ...

    @abc.abstractmethod
    def unlock(self, lock: str) -> None: ...

    @abc.abstractmethod
    def get(self, lock: str) -> Any: ...

    @abc.abstractmethod
    def clear(self, key_prefix: str) -> None: ...


class RedisBackend(BaseBackend):
    """celery-singleton's Redis backend: ``SET NX EX``, ``GET``, ``DEL``, ``SCAN`` + ``DEL``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import redis

        self.url = args[0] if args else kwargs.get("url")
        self.redis = redis.Redis.from_url(*args, decode_responses=True, **kwargs)
        self.mirror = RedisMirror(self.redis)

    def lock(self, lock: str, task_id: str, expiry: Any = None) -> bool:
        return bool(self.redis.set(lock, task_id, nx=True, ex=expiry))

    def unlock(self, lock: str) -> None:
        self.redis.delete(lock)

    def get(self, lock: str) -> Any:
        return self.redis.get(lock)

    def clear(self, key_prefix: str) -> None:
        for key in self.redis.scan_iter(match=key_prefix + "*"):
            self.redis.delete(key)


_BACKENDS: dict[tuple[Any, ...], Any] = {}


def get_backend(config: Config) -> Any:
    """The backend for these settings, built once per process and settings."""
    kwargs = config.backend_kwargs
    ident = (config.backend_class, config.backend_url, repr(sorted(kwargs.items())))
    backend = _BACKENDS.get(ident)
    if backend is None:
        backend = _BACKENDS[ident] = config.backend_class(config.backend_url, **kwargs)
    return backend


def clear_locks(app: Any) -> None:
    """Delete every celery-singleton key of ``app`` (its ``singleton_key_prefix``), as the
    original does; taskdedup's own locks are left to their leases (``taskdedup locks`` and
    ``taskdedup unlock`` manage them)."""
    config = Config(app)
    get_backend(config).clear(config.key_prefix)


class Singleton(CompatTask):
    """celery-singleton's ``Singleton`` on taskdedup: one queued or running job per key."""

    abstract = True
    unique_on: ClassVar[Any] = None
    raise_on_duplicate: ClassVar[Any] = None
    lock_expiry: ClassVar[Any] = None

    @property
    def singleton_config(self) -> Config:
        return Config(self._get_app())

    @property
    def singleton_backend(self) -> Any:
        """The backend, looked up once per task (its URL, class and arguments are read once,
        as the original reads them once per process; the prefix, expiry, raise flag and
        encoder are read on every use)."""
        return self._peer_backend()

    @freeze
    def _peer_backend(self) -> Any:
        return get_backend(self.singleton_config)

    @property
    def _raise_on_duplicate(self) -> bool:
        if self.raise_on_duplicate is not None:
            return bool(self.raise_on_duplicate)
        return bool(self.singleton_config.raise_on_duplicate or False)

    def _expiry(self) -> Any:
        return (
            self.lock_expiry if self.lock_expiry is not None else self.singleton_config.lock_expiry
        )

    # the key

    @freeze
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    def generate_lock(self, task_name: str, task_args: Any = None, task_kwargs: Any = None) -> str:
        unique_on = self.unique_on
        task_args, task_kwargs = task_args or [], task_kwargs or {}
        if unique_on is not None:
            if isinstance(unique_on, str):
                unique_on = [unique_on]
            if not any(unique_on):
                task_args, task_kwargs = [], {}
            else:
                bound = self._signature().bind(*task_args, **task_kwargs)
                bound.apply_defaults()
                task_args, task_kwargs = [], {k: bound.arguments[k] for k in unique_on}
        config = self.singleton_config
        return generate_lock(
            task_name,
            task_args,
            task_kwargs,
            key_prefix=config.key_prefix,
            json_encoder_class=config.json_encoder_class,
        )

    def peer_key(self, args: Any, kwargs: Any) -> str:
        return self.generate_lock(self.name, args, kwargs)

    def peer_ttl_ms(self, options: dict[str, Any]) -> int | None:
        expiry = self._expiry()
        if expiry is not None and expiry <= 0:
            raise ConfigError(
                f"task {self.name!r}: lock_expiry must be a number of seconds above 0, or None "
                f"for no expiry, not {expiry!r}"
            )
        return None if expiry is None else int(expiry * 1000)

    def peer_policy(self) -> dict[str, Any]:
        policy: dict[str, Any] = {
            "strategy": "until_executed",
            "key": lambda *a, **kw: self.generate_lock(self.name, list(a), kw),
            "on_conflict": "drop",
        }
        expiry = self.lock_expiry
        if expiry is not None and expiry > 0:
            policy["ttl"] = expiry
        return policy

    @freeze
    def _mirror(self) -> RedisMirror | None:
        mirror = getattr(self.singleton_backend, "mirror", None)  # (None: a custom backend)
        return mirror if isinstance(mirror, RedisMirror) else None

    def peer_mirror(self) -> RedisMirror | None:
        return self._mirror()

    def peer_url(self) -> str | None:
        url = self.singleton_config.backend_url
        return url if isinstance(url, str) and url.startswith(("redis", "unix")) else None

    # the peer's methods, kept for code that calls or overrides them

    def aquire_lock(self, lock: str, task_id: str) -> bool:
        return bool(self.singleton_backend.lock(lock, task_id, expiry=self._expiry()))

    def get_existing_task_id(self, lock: str) -> Any:
        return self.singleton_backend.get(lock)

    def unlock(self, lock: str) -> None:
        self.singleton_backend.unlock(lock)

    def release_lock(self, task_args: Any = None, task_kwargs: Any = None) -> None:
        if self.peer_mirror() is not None:
            self.release_peer(task_args, task_kwargs)
            return
        lock = self.generate_lock(self.name, task_args, task_kwargs)  # a custom backend
        if self.request.id and self.get_existing_task_id(lock) == self.request.id:
            self.unlock(lock)

    def on_duplicate(self, existing_task_id: str) -> Any:
        if self._raise_on_duplicate:
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {existing_task_id}",
                task_id=existing_task_id,
            )
        return self.AsyncResult(existing_task_id)

    def peer_take(self, key: str, task_id: str, options: dict[str, Any]) -> Any:
        self.peer_ttl_ms(options)  # (a bad lock_expiry is refused before anything is taken)
        while not self.aquire_lock(key, task_id):
            existing = self.get_existing_task_id(key)
            if existing:
                return self.on_duplicate(existing)
        return None

    def takes_peer_key_as_is(self) -> bool:
        cls = type(self)
        return (
            type(self.singleton_backend) is RedisBackend
            and cls.aquire_lock is Singleton.aquire_lock
            and cls.get_existing_task_id is Singleton.get_existing_task_id
            and cls.peer_take is Singleton.peer_take
        )

    def peer_give_back(self, key: str, task_id: str) -> None:
        mirror = self.peer_mirror()
        if mirror is not None:
            mirror.release(key, task_id)
        elif self.get_existing_task_id(key) == task_id:
            self.unlock(key)

    def peer_duplicate(self, key: str, holder: str | None, options: dict[str, Any]) -> Any:
        return self.on_duplicate(holder or self.get_existing_task_id(key) or uuid())

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        self.release_lock(task_args=args, task_kwargs=kwargs)

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        self.release_lock(task_args=args, task_kwargs=kwargs)
