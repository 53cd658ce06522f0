"""The redis-py clients of a RedisStore: made lazily from a URL (standalone, Cluster,
Sentinel) or derived from the client given, one set of asyncio clients per event loop."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import weakref
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio

from ..errors import ConfigError
from ..suggest import did_you_mean


def _new_lock_after_fork(clients: RedisClients) -> None:
    """A forked child (Celery's prefork pool) gets a fresh lock: one held by another thread of
    the parent at the fork would never be released in the child, whose first store call would
    then wait for ever. (A weak reference: registering must not keep the clients alive.)"""
    ref = weakref.ref(clients)

    def fresh() -> None:
        found = ref()
        if found is not None:
            found._making = threading.Lock()

    os.register_at_fork(after_in_child=fresh)


#: redis-py's default socket timeout: how long an asyncio operation may wait for Redis.
DEFAULT_TIMEOUT = 5.0
_STANDALONE = ("redis", "rediss", "unix")  # URL schemes of a single server


class _LoopClients:
    """One event loop's asyncio clients: the pooled one, and a one-connection twin used for
    one call at a time whenever it is free (redis-py 8's pool checkout costs about 25 us)."""

    __slots__ = ("busy", "pool", "quick")

    def __init__(self, pool: Any, quick: Any) -> None:
        self.pool, self.quick, self.busy = pool, quick, False


class _OneConnection(redis.asyncio.Redis):
    """redis-py's asyncio client on one connection of its own. Collected after its event
    loop has closed, redis-py's would close that connection on the closed loop and raise; the
    connection closes itself safely when it is collected."""

    def __del__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _client_parameters(scheme: str) -> set[str]:
    """The keyword arguments redis-py's clients take for ``scheme`` (sync and asyncio)."""
    names: set[str] = set()
    for lib in (redis, redis.asyncio):
        made: list[Any] = [lib.Redis, lib.ConnectionPool]
        made += [lib.connection.AbstractConnection, lib.connection.Connection]
        made += [lib.connection.SSLConnection, lib.connection.UnixDomainSocketConnection]
        if scheme == "redis+cluster":
            made.append(lib.RedisCluster)
        if scheme == "redis+sentinel":
            made.append(lib.Sentinel)
        for kind in made:
            for param in inspect.signature(kind.__init__).parameters.values():
                if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                    names.add(param.name)
    names.discard("self")
    return names


def check_options(scheme: str, options: dict[str, Any]) -> None:
    """A keyword redis-py's client does not take fails now, not at the first operation."""
    if not options:
        return
    accepted = _client_parameters(scheme)
    for name in options:
        if name not in accepted:
            raise ConfigError(
                f"RedisStore.from_url: redis-py's client takes no keyword {name!r}"
                f"{did_you_mean(name, accepted)}"
            )


class RedisClients:
    """The clients of one store: the sync client, and the asyncio clients of each loop."""

    def __init__(
        self, client: Any, async_client: Any, url: str | None, options: dict[str, Any]
    ) -> None:
        self.url = url
        self._options = options
        self._client = client
        self._making = threading.Lock()
        _new_lock_after_fork(self)
        self._async_client = async_client  # given: used as it is, whatever the loop
        self._given = None if async_client is None else _LoopClients(async_client, None)
        #: The asyncio clients made here, per event loop (redis-py's are bound to the loop
        #: they first ran on): a second ``asyncio.run``, or a thread with a loop of its own,
        #: gets clients of its own.
        self._per_loop: dict[asyncio.AbstractEventLoop, _LoopClients] = {}
        #: Deadline of each asyncio operation, for the asyncio clients made here.
        self.async_timeout: float | None = None
        self._threaded = False  # no asyncio client could be derived from the sync one

    def timed_out(self) -> Exception:
        """What an asyncio operation past :attr:`async_timeout` raises."""
        return redis.exceptions.TimeoutError(f"no answer within {self.async_timeout} s")

    @property
    def client(self) -> Any:
        """The sync client, made once: threads racing to make it would each make one, and a
        discarded client closes its pool's connections, in use or not, when it is collected."""
        if self._client is None:
            with self._making:
                if self._client is None:
                    self._client = self._make_client(asynchronous=False)
        return self._client

    def for_loop(self) -> _LoopClients | None:
        if self._given is not None:
            return self._given
        if self._threaded:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # read outside a loop: no client belongs to it yet
            return None
        clients = self._per_loop.get(loop)
        if clients is None:
            for old in [old for old in self._per_loop if old.is_closed()]:
                del self._per_loop[old]  # its sockets close when collected
            made = self._make_async_clients()
            if made is None:
                self._threaded = True
                return None
            clients = self._per_loop[loop] = made
        return clients

    def _make_async_clients(self) -> _LoopClients | None:
        """Asyncio clients for the running loop: on a standalone server a pooled client and
        its one-connection twin, both under the store's own deadline; elsewhere redis-py's
        client alone; None when none can be derived from the given sync client."""
        url = self.url
        if url is not None and urlsplit(url).scheme in _STANDALONE:
            options = dict(self._options)
            url = self._own_deadline(url, options)
            return _LoopClients(
                redis.asyncio.Redis.from_url(url, **options),
                _OneConnection.from_url(url, single_connection_client=True, **options),
            )
        pool = self._make_client(asynchronous=True)
        return None if pool is None else _LoopClients(pool, None)

    def _make_client(self, *, asynchronous: bool) -> Any:
        """A client for ``url``; None for an asyncio client that cannot be derived from the
        given sync one (asyncio calls then run the sync client in a thread)."""
        lib: Any = redis.asyncio if asynchronous else redis
        url = self.url
        if url is None:
            return self._derived_client(lib, asynchronous)
        options = dict(self._options)
        parts = urlsplit(url)
        if parts.scheme in _STANDALONE:
            return lib.Redis.from_url(url, **options)
        # Cluster and Sentinel clients keep redis-py's socket timeouts: they react to a
        # node's timeout (try the next sentinel, refresh the slot map), not to a cancellation.
        if parts.scheme == "redis+cluster":
            plain = url.replace("redis+cluster://", "redis://", 1)
            return lib.RedisCluster.from_url(plain, **options)
        if parts.scheme == "redis+sentinel":
            hosts = [h.rsplit(":", 1) for h in parts.netloc.split("@")[-1].split(",")]
            path = [p for p in parts.path.split("/") if p]
            if not path:
                raise ConfigError(f"{url!r}: name the Sentinel master: redis+sentinel://h:p/name")
            db = int(path[1]) if len(path) > 1 else 0
            auth = {}
            if parts.password:
                auth["password"] = unquote(parts.password)
            sentinel = lib.Sentinel(
                [(h, int(p)) for h, p in hosts], sentinel_kwargs=None, **auth, **options
            )
            return sentinel.master_for(path[0], db=db, **auth)
        raise ConfigError(f"unsupported store url {url!r}")

    def _own_deadline(self, url: str, options: dict[str, Any]) -> str:
        """Take ``socket_timeout`` (argument, URL query or redis-py's default) as the store's
        deadline per asyncio operation, and give the client none.

        redis-py's asyncio client bounds each write with asyncio.wait_for, which costs a Task
        per command before Python 3.12 (a third of a round trip on loopback). One deadline per
        operation sets the same limit for a Redis that stops answering (G5) without the Task.
        """
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        given = [value for name, value in query if name == "socket_timeout"]
        timeout = options.pop("socket_timeout", DEFAULT_TIMEOUT)
        if given:  # redis-py lets the URL's options win over arguments: so do we
            try:
                timeout = float(given[-1])
            except ValueError:
                raise ConfigError(f"socket_timeout in {url!r} must be seconds") from None
        self.async_timeout = timeout
        options["socket_timeout"] = None
        rest = urlencode([(name, value) for name, value in query if name != "socket_timeout"])
        return urlunsplit(parts._replace(query=rest))

    def _derived_client(self, lib: Any, asynchronous: bool) -> Any:
        """A client of the other kind for the server of the one given, or None when that
        server cannot be read off it (Cluster, Sentinel): the caller then uses a thread."""
        other = self._async_client if self._client is None else self._client
        pool = getattr(other, "connection_pool", None)
        if pool is None or "Sentinel" in type(pool).__name__:
            return None
        given = dict(pool.connection_kwargs)
        if "path" in given:  # a unix socket
            given["unix_socket_path"] = given.pop("path")
        if "SSL" in pool.connection_class.__name__:
            given["ssl"] = True
        accepted = inspect.signature(lib.Redis.__init__).parameters
        options = {name: value for name, value in given.items() if name in accepted}
        if asynchronous:
            self.async_timeout = options.pop("socket_timeout", DEFAULT_TIMEOUT)
            options["socket_timeout"] = None
        return lib.Redis(**options)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        """Close the asyncio clients given or made for the running loop."""
        if self._async_client is not None:
            await self._async_client.aclose()
        clients = self._per_loop.pop(asyncio.get_running_loop(), None)
        if clients is not None:  # this loop's; those of other loops are closed by theirs
            await clients.pool.aclose()
            if clients.quick is not None:
                await clients.quick.aclose()
