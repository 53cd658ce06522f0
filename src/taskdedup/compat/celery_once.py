"""A drop-in for celery-once 3.0.1: ``QueueOnce``, ``AlreadyQueued`` and ``app.conf.ONCE``.

Change one import and keep everything else::

    from taskdedup.compat.celery_once import QueueOnce, AlreadyQueued   # was: from celery_once

    app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                     "settings": {"url": "redis://localhost:6379/0", "default_timeout": 3600}}

    @app.task(base=QueueOnce, once={"graceful": True, "keys": ["order_id"]})
    def ship(order_id, note=""): ...

What stays as celery-once does it: the key ``qo_<task>_<arg>-<value>...`` (all bound arguments,
or the ``keys`` named, without defaults), ``SET key token NX PX timeout`` in the same Redis,
``AlreadyQueued(countdown)`` from the key's remaining ttl (``graceful``: an
``EagerResult(None, None, "REJECTED")``), ``blocking``/``blocking_timeout``, ``timeout`` per
call, ``unlock_before_run``, the lock freed after success or a final failure and kept through
``self.retry()``, eager mode. The original package need not be installed.

What taskdedup adds (see docs/migration.md): taskdedup's lock beside
the peer's key, so a worker killed mid-job frees the key within its lease (not the timeout), a
revoked or expired job frees it, the lock is kept while a job runs longer than ``timeout``, a
publish that fails gives the lock back, the key is freed even when JSON changed the arguments,
and the CLI, ``explain`` and the metrics show every decision.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import os
import tempfile
import time
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlparse

from celery import states
from celery.result import EagerResult

from ..celery.messages import header
from ..errors import ConfigError
from .base import CompatTask, freeze
from .mirror import PEER_KEY_HEADER, RedisMirror

__all__ = [
    "AlreadyQueued",
    "File",
    "QueueOnce",
    "Redis",
    "force_string",
    "import_backend",
    "kwargs_to_list",
    "parse_url",
    "queue_once_key",
]

DEFAULT_TIMEOUT = 3600


class AlreadyQueued(Exception):
    """The task is already queued or running; ``countdown`` is the lock's remaining seconds."""

    def __init__(self, countdown: float) -> None:
        self.message = f"Expires in {countdown} seconds"
        self.countdown = countdown
        self.args = (countdown,)


# ------------------------------------------------------------------ celery-once's key


def force_string(kwargs: Any) -> Any:
    """celery-once's rendering of a value in a key: dicts as text with sorted keys, lists
    element by element, everything else as it is (``str()`` is applied by the caller)."""
    if isinstance(kwargs, dict):
        return "{" + ", ".join(str({k: force_string(v)}).strip("{}") for k, v in
                               sorted(kwargs.items())) + "}"  # fmt: skip
    if isinstance(kwargs, list):
        return [force_string(v) for v in kwargs]
    return kwargs


def kwargs_to_list(kwargs: dict[str, Any]) -> list[str]:
    """``["name-value", ...]`` sorted by name, as celery-once writes its key."""
    return [f"{k}-{force_string(v)!s}" for k, v in sorted(kwargs.items())]


def queue_once_key(name: str, kwargs: dict[str, Any], restrict_to: Any = None) -> str:
    """``qo_<name>[_<arg>-<value>]*``: celery-once's lock key, byte for byte."""
    keys = ["qo", str(force_string(name))]
    if restrict_to is not None:
        kwargs = {key: kwargs[key] for key in restrict_to}
    keys += kwargs_to_list(kwargs)
    return "_".join(keys)


def import_backend(config: dict[str, Any]) -> Any:
    """The backend named by ``config["backend"]``, built with ``config["settings"]``.

    celery-once's own paths (``celery_once.backends.Redis``, ``...File`` and their module
    forms) mean the classes of this module, so the original package need not be installed;
    any other dotted path is imported as celery-once imports a custom backend.
    """
    path = config["backend"]
    builtin = BUILTIN_BACKENDS.get(path)
    if builtin is not None:
        return builtin(config["settings"])
    module_name, _, class_name = path.rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(config["settings"])


# ------------------------------------------------------------------ its backends


def parse_url(url: str) -> dict[str, Any]:
    """celery-once's reading of a ``redis://``, ``rediss://`` or ``redis+socket://`` URL into
    StrictRedis arguments (query parameters passed on, ``db`` an int, ``socket_timeout`` a
    float)."""
    parsed = urlparse(url)
    kwargs: dict[str, Any] = dict(parse_qsl(parsed.query))
    if parsed.scheme in ("redis", "rediss"):
        details: dict[str, Any] = {"host": parsed.hostname}
        if parsed.port:
            details["port"] = parsed.port
        if parsed.password:
            details["password"] = parsed.password
        db = parsed.path.lstrip("/")
        if db and db.isdigit():
            details["db"] = int(db)
        if parsed.scheme == "rediss":
            details["ssl"] = True
    elif parsed.scheme == "redis+socket":
        details = {"unix_socket_path": parsed.path}
    else:
        raise ValueError(f"Unsupported protocol {parsed.scheme}")
    details.update(kwargs)
    if "db" in details:
        details["db"] = int(details["db"])
    if "socket_timeout" in details:
        details["socket_timeout"] = float(details["socket_timeout"])
    return details


_CLIENTS: dict[str, Any] = {}


class Redis:
    """celery-once's Redis backend: ``SET key token NX PX``, ``PTTL`` for the countdown,
    ``DEL`` to clear. One client per URL per process."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import redis

        self.url = settings["url"]
        client = _CLIENTS.get(self.url)
        if client is None:
            client = _CLIENTS[self.url] = redis.StrictRedis(**parse_url(self.url))
        self.redis = client
        self.mirror = RedisMirror(client)
        self.blocking_timeout = settings.get("blocking_timeout", 1)
        self.blocking = settings.get("blocking", False)

    def raise_or_lock(self, key: str, timeout: float | None, value: str | None = None) -> None:
        """Take the lock or raise AlreadyQueued; ``blocking`` retries every 0.1 s."""
        ttl_ms = int(timeout * 1000) if timeout else None
        value = value or os.urandom(16).hex()
        deadline = None
        if self.blocking and self.blocking_timeout is not None:
            deadline = time.monotonic() + self.blocking_timeout
        while True:
            if self.mirror.take(key, value, ttl_ms):
                return
            if not self.blocking:
                break
            if deadline is not None and time.monotonic() + 0.1 > deadline:
                break
            time.sleep(0.1)
        raise AlreadyQueued(self.mirror.pttl(key) / 1000.0)

    def clear_lock(self, key: str) -> int:
        return int(self.redis.delete(key))


def key_to_lock_name(key: str) -> str:
    """celery-once's file name for a key: at most 50 characters, the key's head and md5."""
    return key[:17] + "_" + hashlib.md5(key.encode("latin-1")).hexdigest()


class File:
    """celery-once's File backend: an empty file per lock, expired by its mtime."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.location = settings.get("location") or os.path.join(
            tempfile.gettempdir(), "celery_once"
        )
        os.makedirs(self.location, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.location, key_to_lock_name(key))

    def raise_or_lock(self, key: str, timeout: float, value: str | None = None) -> None:
        path = self._path(key)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            ttl = os.path.getmtime(path) + timeout - time.time()
            if ttl > 0:
                raise AlreadyQueued(ttl) from None
            os.utime(path, None)

    def clear_lock(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # (celery-once raised: a lock gone is free)
            os.remove(self._path(key))


BUILTIN_BACKENDS: dict[str, type] = {
    "celery_once.backends.Redis": Redis,
    "celery_once.backends.redis.Redis": Redis,
    "celery_once.backends.File": File,
    "celery_once.backends.file.File": File,
    f"{__name__}.Redis": Redis,
    f"{__name__}.File": File,
}


# ------------------------------------------------------------------ the task


class QueueOnce(CompatTask):
    """celery-once's ``QueueOnce`` on taskdedup: one queued or running job per key."""

    abstract = True
    once: ClassVar[dict[str, Any]] = {"graceful": False, "unlock_before_run": False}
    peer_options = ("once",)  # read by apply_async, not sent (celery-once sent it on)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the key's signature, taken now as celery-once 3.0.1 takes it: a wrapper put on run
        # later (Sentry's, #105) does not change the key
        with contextlib.suppress(TypeError, ValueError):
            self._signature()

    @property
    def adopts_any_holder(self) -> bool:  # type: ignore[override]
        """A worker adopts the key whatever it names only for a message an old producer sent
        (celery-once writes a meaningless token, and no peer-key header); a drop-in producer's
        key names its job, so a job whose key expired and was taken again leaves the newer
        job's alone, and a local run (``task.apply()``) took no key and adopts none."""
        request = self.request
        return not request.is_eager and not header(request, PEER_KEY_HEADER)

    @property
    def config(self) -> Any:
        return self._get_app().conf

    @property
    def once_config(self) -> dict[str, Any]:
        conf = self.config
        once = conf.get("ONCE") or conf.get("once")
        if not once:
            raise ConfigError(
                f"task {self.name!r}: QueueOnce needs app.conf.ONCE = "
                "{'backend': 'celery_once.backends.Redis', 'settings': {'url': 'redis://...'}}"
            )
        return once  # type: ignore[no-any-return]

    @property
    def once_backend(self) -> Any:
        return self._once_backend()

    @freeze
    def _once_backend(self) -> Any:
        config = self.once_config
        if "backend" not in config or "settings" not in config:
            raise ConfigError(
                f"task {self.name!r}: app.conf.ONCE needs 'backend' and 'settings' "
                f"(it has {sorted(config)})"
            )
        return import_backend(config)

    @property
    def default_timeout(self) -> Any:
        return self.once_config["settings"].get("default_timeout", DEFAULT_TIMEOUT)

    def unlock_before_run(self) -> bool:
        return bool(self.once.get("unlock_before_run", False))

    def unlocks_at_start(self) -> bool:
        return self.unlock_before_run()

    # the key

    @freeze
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    def _get_call_args(self, args: Any, kwargs: Any) -> dict[str, Any]:
        call_args = self._signature().bind(*(args or ()), **(kwargs or {})).arguments
        if "self" in call_args and isinstance(call_args["self"], CompatTask):
            del call_args["self"]
        return dict(call_args)

    def get_key(self, args: Any = None, kwargs: Any = None) -> str:
        restrict_to = self.once.get("keys", None)
        return queue_once_key(self.name, self._get_call_args(args, kwargs), restrict_to)

    def peer_key(self, args: Any, kwargs: Any) -> str:
        return self.get_key(args, kwargs)

    def _timeout(self, options: dict[str, Any]) -> Any:
        """The call's ``once={"timeout": ...}``, else the task's, else ``default_timeout``, as
        celery-once reads it: a timeout given as None is kept (the key then never expires)."""
        once = options.get("once") or {}
        return once.get("timeout", self.once.get("timeout", self.default_timeout))

    def peer_ttl_ms(self, options: dict[str, Any]) -> int | None:
        timeout = self._timeout(options)
        return int(timeout * 1000) if timeout else None

    def peer_policy(self) -> dict[str, Any]:
        timeout = self.once.get("timeout")
        if timeout is None:
            try:
                timeout = self.default_timeout
            except (ConfigError, KeyError, AttributeError):
                timeout = DEFAULT_TIMEOUT
        policy: dict[str, Any] = {
            "strategy": "until_executing" if self.unlock_before_run() else "until_executed",
            "key": lambda *a, **kw: self.get_key(a, kw),
            "on_conflict": "drop",
        }
        if timeout:
            policy["ttl"] = timeout
        return policy

    def peer_mirror(self) -> RedisMirror | None:
        backend = self.once_backend
        return backend.mirror if isinstance(backend, Redis) else None

    def peer_url(self) -> str | None:
        backend = self.once_backend
        return backend.url if isinstance(backend, Redis) else None

    def peer_take(self, key: str, task_id: str, options: dict[str, Any]) -> Any:
        backend = self.once_backend
        timeout = self._timeout(options)  # as configured (an int stays an int, as celery-once
        # passes it: a custom backend's SET ... EX timeout needs one)
        try:
            if isinstance(backend, Redis):
                backend.raise_or_lock(key, timeout, value=task_id)
            elif isinstance(backend, File):
                backend.raise_or_lock(key, timeout or 0, value=task_id)
            else:
                backend.raise_or_lock(key, timeout=timeout)
        except AlreadyQueued:
            if self._graceful(options):
                return EagerResult(None, None, states.REJECTED)
            raise
        return None

    peer_reads = "ttl"  # (AlreadyQueued's countdown)

    def takes_peer_key_as_is(self) -> bool:
        backend = self.once_backend
        return (
            type(backend) is Redis
            and not backend.blocking
            and type(self).peer_take is QueueOnce.peer_take
        )

    def peer_answer(self, key: str, answer: str, options: dict[str, Any]) -> Any:
        if self._graceful(options):
            return EagerResult(None, None, states.REJECTED)
        raise AlreadyQueued(int(answer) / 1000.0)

    def peer_give_back(self, key: str, task_id: str) -> None:
        backend = self.once_backend
        if isinstance(backend, Redis):
            backend.mirror.release(key, task_id)
        else:
            backend.clear_lock(key)

    def _graceful(self, options: dict[str, Any]) -> bool:
        once = options.get("once") or {}
        return bool(once.get("graceful", self.once.get("graceful", False)))

    def peer_duplicate(self, key: str, holder: str | None, options: dict[str, Any]) -> Any:
        if self._graceful(options):
            return EagerResult(None, None, states.REJECTED)
        backend = self.once_backend
        countdown = backend.mirror.pttl(key) / 1000.0 if isinstance(backend, Redis) else 0.0
        raise AlreadyQueued(countdown)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if self.unlock_before_run() and request.id and not request.called_directly:
            backend = self.once_backend
            if not isinstance(backend, Redis):  # (the Redis key is freed by CompatTask)
                key = self._request_peer_key(args, kwargs)
                if key is not None:
                    backend.clear_lock(key)
        return super().__call__(*args, **kwargs)

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        _status, _retval, _task_id, call_args, call_kwargs, _einfo = args[:6]
        backend = self.once_backend
        if not isinstance(backend, Redis) and not self.unlock_before_run():
            backend.clear_lock(self._request_peer_key(call_args, call_kwargs) or "")
        else:
            self.release_peer(call_args, call_kwargs)
        super().after_return(*args, **kwargs)
