"""RedisStore: the store protocol on Redis or Valkey (standalone, Sentinel, Cluster).

Each primitive is one Lua script (``lua/*.lua``; ``redis_calls`` says how each operation calls
its script), run with EVALSHA and loaded on the first NOSCRIPT (after a restart or a ``SCRIPT
FLUSH``). One operation is one round trip; batches (heartbeats, confirmations) go out as one
pipeline. All records of one dedup key share a Cluster hash tag, so every script touches a
single slot. Time is read from the Redis server inside the scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from .. import events
from ..errors import ConfigError, CorruptRecord, StoreUnavailable
from .base import (
    IDEMPOTENCY_KEY,
    Acquire,
    AcquireReply,
    Event,
    History,
    Inspect,
    ListScopes,
    LockInfo,
    Op,
    R,
    Scan,
    Sent,
    Store,
)
from .redis_calls import SHAS, SOURCES, ScriptCall, ScriptCalls, as_text, parse_acquire
from .redis_clients import RedisClients, check_options
from .redis_sent import SentCall, send

if sys.version_info >= (3, 11, 3):  # the same cut-over redis-py makes (earlier 3.11s had bugs)
    from asyncio import timeout as _deadline  # type: ignore[attr-defined,unused-ignore]
else:  # redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]

#: Errors that mean "the store cannot answer now" (G5), as opposed to a bug in a request.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # also BusyLoading, MasterNotFound (Sentinel)
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica after failover
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.OutOfMemoryError,  # maxmemory reached with noeviction: writes refused
    redis.exceptions.MasterDownError,
    OSError,
)
#: Error replies that also mean "not now": a server that cannot persist and so refuses writes,
#: one busy with a long script, one without enough replicas.
_UNAVAILABLE_REPLIES = ("MISCONF", "BUSY ", "NOREPLICAS", "LOADING")


#: Error replies that mean a record under our prefix is not what we wrote.
_CORRUPT_REPLIES = ("WRONGTYPE", "ERR value is not an integer")


@contextlib.contextmanager
def _answering(keys: list[str] | None = None) -> Iterator[None]:
    """Raise StoreUnavailable for a Redis that cannot answer now (G5, G13): an accepted job is
    then sent back and claimed again later, never failed (G14); CorruptRecord, naming the keys,
    for a record that is not ours; a bug raises as it is."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(f"Redis did not answer: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith(_CORRUPT_REPLIES):
            raise CorruptRecord(list(keys or []), str(exc)) from exc
        if not str(exc).startswith(_UNAVAILABLE_REPLIES):
            raise
        raise StoreUnavailable(f"Redis cannot answer now: {exc}") from exc


def _key_prefix(key_prefix: str, prefix: str | None) -> str:
    """``key_prefix``, or the deprecated ``prefix=`` (the setting has always been key_prefix),
    checked: non-empty and free of braces (they would break the Cluster hash tags)."""
    if prefix is not None:
        warnings.warn(
            "RedisStore(prefix=...) is deprecated: use key_prefix=, as in the key_prefix setting",
            DeprecationWarning,
            stacklevel=3,
        )
        key_prefix = prefix
    if not key_prefix or "{" in key_prefix or "}" in key_prefix:
        raise ConfigError(f"key_prefix must be non-empty and free of braces, not {key_prefix!r}")
    return key_prefix


class RedisStore(Store):
    """A store on a redis-py client (sync) and/or a ``redis.asyncio`` client.

    Build it with :meth:`from_url`, or from clients you already have: ``RedisStore(client)``,
    ``RedisStore(async_client=...)`` or both. A ``redis.cluster.RedisCluster`` client works
    unchanged, as does a client from ``Sentinel.master_for``.

    ``socket_timeout`` (redis-py's default, 5 s) bounds each operation: after it, Redis counts
    as unavailable (G5). The asyncio clients the store makes apply it per operation rather
    than per socket write; a client you pass in keeps its own settings. ``key_prefix`` starts
    every key the store writes (``prefix=`` is its deprecated spelling); ``history=False``
    writes no decision history for ``taskdedup explain`` (the ``history`` setting)."""

    def __init__(
        self,
        client: Any = None,
        *,
        async_client: Any = None,
        key_prefix: str = "taskdedup",
        url: str | None = None,
        client_options: dict[str, Any] | None = None,
        history: bool = True,
        prefix: str | None = None,
    ) -> None:
        if client is None and async_client is None and url is None:
            raise ConfigError("RedisStore needs a client, an async_client or a url")
        self.prefix, self.url = _key_prefix(key_prefix, prefix), url
        self.clients = RedisClients(client, async_client, url, client_options or {})
        self.calls = ScriptCalls(self.prefix, history)
        self.sharded = False  # keys of one script call may live apart (a sharding proxy)

    @property
    def scopes_together(self) -> bool:
        """One script may reach several scopes (not on a Cluster or behind a sharding proxy)."""
        return not self.sharded and not isinstance(self.client, redis.cluster.RedisCluster)

    @classmethod
    def from_url(
        cls, url: str, *, key_prefix: str = "taskdedup", history: bool = True, **options: Any
    ) -> RedisStore:
        """A store for ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://host:port``
        or ``redis+sentinel://host:port[,host:port]/master_name[/db]`` (clients made lazily).
        ``options`` go to redis-py's client; one it does not take is a ConfigError here."""
        prefix = options.pop("prefix", None)  # (the deprecated spelling of key_prefix)
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel"):
            raise ConfigError(
                f"unsupported store url {url!r}: use redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel://"
            )
        check_options(scheme, options)
        key_prefix = _key_prefix(key_prefix, prefix)
        return cls(url=url, key_prefix=key_prefix, client_options=options, history=history)

    @property
    def client(self) -> Any:
        return self.clients.client

    @property
    def async_client(self) -> Any:
        """The asyncio client of the running event loop, or None when asyncio calls run the
        sync client in a thread."""
        clients = self.clients.for_loop()
        return None if clients is None else clients.pool

    def _eval(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA the script, loading it once on NOSCRIPT (cheaper than redis-py's Script)."""
        try:
            return self.client.evalsha(SHAS[name], len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(SOURCES[name])
            return self.client.evalsha(SHAS[name], len(keys), *keys, *args)

    async def _aeval(self, name: str, keys: list[str], args: list[Any]) -> Any:
        clients = self.clients.for_loop()
        assert clients is not None  # the callers checked
        if clients.quick is None or clients.busy:
            return await self._aeval_on(clients.pool, name, keys, args)
        clients.busy = True  # no await between the test and this: one call at a time
        try:
            return await self._aeval_on(clients.quick, name, keys, args)
        finally:
            clients.busy = False

    async def _aeval_on(self, client: Any, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            async with _deadline(self.clients.async_timeout):
                try:
                    return await client.evalsha(SHAS[name], len(keys), *keys, *args)
                except redis.exceptions.NoScriptError:
                    await client.script_load(SOURCES[name])
                    return await client.evalsha(SHAS[name], len(keys), *keys, *args)
        except asyncio.TimeoutError:
            raise self.clients.timed_out() from None

    # -- the protocol

    def run(self, op: Op[R]) -> R:
        builder = self.calls.single.get(type(op))
        if builder is not None:
            call = builder(op)
            sent = self._send(call)  # redis-py's connection, without its per-command wrappers
            if sent is not None:
                return cast(R, sent.reply())  # (timed there)
            return cast(R, events.timed(call.script, self._run_call, call))
        with _answering():  # (a batch of background work: not a decision's wait, not timed)
            return cast(R, self._run_special(op))

    def _run_call(self, call: ScriptCall) -> Any:
        with _answering(call.keys):
            raw = self._eval(call.variant, call.keys, call.args)
        return call.parse(raw)

    def send(self, op: Op[R]) -> Sent[R] | None:
        """Write ``op`` now and read its reply later with ``.reply()`` (see redis_sent), so
        the caller's own work overlaps the round trip; None when ``op`` cannot go that way."""
        builder = self.calls.single.get(type(op))
        return None if builder is None else self._send(builder(op))

    def _send(self, call: ScriptCall) -> SentCall | None:
        again = functools.partial(self._eval, call.variant, call.keys, call.args)
        with _answering(call.keys):
            return send(self.client, call, again, _answering)

    async def arun(self, op: Op[R]) -> R:
        if self.async_client is None:
            return await asyncio.to_thread(self.run, op)
        builder = self.calls.single.get(type(op))
        if builder is not None:
            call = builder(op)
            return cast(R, await events.atimed(call.script, self._arun_call, call))
        with _answering():
            return cast(R, await self._arun_special(op))

    async def _arun_call(self, call: ScriptCall) -> Any:
        with _answering(call.keys):
            raw = await self._aeval(call.variant, call.keys, call.args)
        return call.parse(raw)

    # -- a broker on this same server: lock and message in one step

    def shares_server(self, connection_kwargs: dict[str, Any]) -> bool:
        """True when a client with these connection settings talks to our standalone server
        and database, so a script of ours may also write that client's keys."""
        if isinstance(self.client, redis.cluster.RedisCluster):
            return False
        ours = self.client.connection_pool.connection_kwargs
        fields = ("host", "port", "db", "path", "username")
        return all(_same(ours.get(name), connection_kwargs.get(name), name) for name in fields)

    takes_guards_on = shares_server  # (TakesGuards: a guard key on this same server)

    @events.timed_as("acquire_and_push")
    def acquire_and_push(self, op: Acquire, queue: str, message: str | bytes) -> AcquireReply:
        """:class:`Acquire`, and when the lock is ours LPUSH ``message`` onto the list ``queue``
        in the same script: one round trip, and no window where one exists without the other
        (so the lock needs no confirmation, G11). ``queue`` must live on this server."""
        call = self.calls.acquire(op, queue, message)
        with _answering(call.keys):
            return parse_acquire(self._eval(call.variant, call.keys, call.args))

    async def aacquire_and_push(
        self, op: Acquire, queue: str, message: str | bytes
    ) -> AcquireReply:
        """The asyncio twin of :meth:`acquire_and_push`."""
        if self.async_client is None:
            return await asyncio.to_thread(self.acquire_and_push, op, queue, message)
        return await events.atimed("acquire_and_push", self._apush, op, queue, message)

    async def _apush(self, op: Acquire, queue: str, message: str | bytes) -> AcquireReply:
        call = self.calls.acquire(op, queue, message)
        with _answering():
            return parse_acquire(await self._aeval(call.variant, call.keys, call.args))

    def close(self) -> None:
        self.clients.close()

    async def aclose(self) -> None:
        self.clients.close()
        await self.clients.aclose()

    def _run_special(self, op: Op[Any]) -> Any:
        if isinstance(op, Scan):
            return _scan(self, op)
        if isinstance(op, ListScopes):
            return _list_scopes(self.client, self.prefix, op.limit)
        if isinstance(op, History):
            entries = self.client.lrange(self.calls.names(op.key, "log")[0], 0, -1)
            return [Event.parse(as_text(entry)) for entry in entries]
        return _run_batch(self, op)

    def _pipeline(self, client: Any, calls: list[ScriptCall], indexes: list[int]) -> list[Any]:
        """EVALSHA each call in one pipeline; load the scripts and resend once on NOSCRIPT
        (redis-py's own script pipelining asks SCRIPT EXISTS first, every time)."""
        for attempt in (1, 2):
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                call = calls[i]
                pipe.evalsha(SHAS[call.variant], len(call.keys), *call.keys, *call.args)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                for name in {calls[i].variant for i in indexes}:
                    client.script_load(SOURCES[name])
        raise AssertionError("unreachable")

    def _by_node(self, calls: list[ScriptCall]) -> list[tuple[Any, list[int]]]:
        """Group a batch by the server that owns each key: one pipeline per Cluster node
        (a cluster pipeline refuses scripts), a single pipeline elsewhere."""
        if not calls:
            return []
        if not isinstance(self.client, redis.cluster.RedisCluster):
            return [(self.client, list(range(len(calls))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, call in enumerate(calls):
            node = self.client.get_node_from_key(call.keys[0])  # type: ignore[no-untyped-call]
            groups.setdefault(node.name, (node.redis_connection, []))[1].append(i)
        return list(groups.values())

    async def _arun_special(self, op: Op[Any]) -> Any:
        cluster = isinstance(self.async_client, redis.asyncio.cluster.RedisCluster)
        if isinstance(op, Scan | History | ListScopes) or cluster or self.sharded:
            return await asyncio.to_thread(self._run_special, op)  # (and a CROSSSLOT there)
        calls, combine = self.calls.batch(op)
        if not calls:
            return combine([])
        client = self.async_client
        try:
            async with _deadline(self.clients.async_timeout):
                for attempt in (1, 2):
                    pipe = client.pipeline(transaction=False)
                    for call in calls:
                        pipe.evalsha(SHAS[call.variant], len(call.keys), *call.keys, *call.args)
                    try:
                        raws = await pipe.execute()
                        break
                    except redis.exceptions.ResponseError as exc:  # (NoScriptError is one)
                        if "CROSSSLOT" in str(exc):
                            return await asyncio.to_thread(self._run_special, op)
                        if not isinstance(exc, redis.exceptions.NoScriptError):
                            raise
                        if attempt == 2:
                            raise
                        for name in {call.variant for call in calls}:
                            await client.script_load(SOURCES[name])
        except asyncio.TimeoutError:
            raise self.clients.timed_out() from None
        return combine([call.parse(raw) for call, raw in zip(calls, raws, strict=True)])


def _run_batch(store: RedisStore, op: Op[Any]) -> Any:
    """A batch as one pipeline per server. A confirmation batch is one script call per chunk
    of jobs where one server owns every key; on a Cluster, or behind a proxy that shards keys
    (it answers CROSSSLOT, and then keeps being asked one call per job), one call per job."""
    together = not isinstance(store.client, redis.cluster.RedisCluster) and not store.sharded
    try:
        return _pipelined(store, *store.calls.batch(op, together))
    except redis.exceptions.ResponseError as exc:
        if not together or "CROSSSLOT" not in str(exc):
            raise
        store.sharded = True
        return _pipelined(store, *store.calls.batch(op, False))


def _pipelined(store: RedisStore, calls: list[ScriptCall], combine: Any) -> Any:
    results: list[Any] = [None] * len(calls)
    for client, indexes in store._by_node(calls):
        for i, raw in zip(indexes, store._pipeline(client, calls, indexes), strict=True):
            results[i] = calls[i].parse(raw)
    return combine(results)


def _scan(store: RedisStore, op: Scan) -> list[LockInfo]:
    """Every lock under the store's prefix, read one key at a time (an operator's call)."""
    found: list[LockInfo] = []
    seen: set[str] = set()
    head = store.prefix + ":{"
    for raw in store.client.scan_iter(match=f"{store.prefix}:{{*}}:*", count=500):
        name = as_text(raw)
        if not name.endswith(("}:lock", "}:run")):
            continue
        key = name[len(head) : name.rindex("}")]
        if key in seen or key.startswith(IDEMPOTENCY_KEY):
            continue
        seen.add(key)
        info = store.run(Inspect(key))
        if info is not None:
            found.append(info)
            if len(found) >= op.limit:
                break
    return found


def _list_scopes(client: Any, prefix: str, limit: int) -> list[str]:
    found: list[str] = []
    for raw in client.scan_iter(match=f"{prefix}:{{res:*}}:scope", count=500):
        name = client.get(raw)
        if name is not None:
            found.append(as_text(name))
            if len(found) >= limit:
                break
    return found


def _same(a: Any, b: Any, name: str) -> bool:
    if name == "host":
        a, b = a or "localhost", b or "localhost"
    elif name == "port":
        a, b = int(a or 6379), int(b or 6379)
    elif name == "db":
        a, b = int(a or 0), int(b or 0)
    return bool(a == b)
