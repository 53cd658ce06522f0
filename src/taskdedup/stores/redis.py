"""RedisStore: the store protocol on Redis or Valkey (standalone, Sentinel, Cluster).

Each primitive is one Lua script (``lua/*.lua`` beside this file, with ``lib.lua`` prepended),
run with EVALSHA and loaded on the first NOSCRIPT (after a restart or a ``SCRIPT FLUSH``). One
operation is one round trip; batches (heartbeats, confirmations) go out as one
pipeline. All records of one dedup key share a Cluster hash tag, so every script touches a
single slot. Time is read from the Redis server inside the scripts.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions

from ..errors import ConfigError, StoreUnavailable

if sys.version_info >= (3, 11, 3):  # the same cut-over redis-py makes (earlier 3.11s had bugs)
    from asyncio import timeout as _deadline  # type: ignore[attr-defined,unused-ignore]
else:  # redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline  # type: ignore[import-not-found,unused-ignore]
from .base import (
    Acquire,
    AcquireReply,
    Claim,
    ClaimReply,
    Confirm,
    Consume,
    Finish,
    FinishReply,
    ForceUnlock,
    Handoff,
    Heartbeat,
    Inspect,
    Lease,
    ListScopes,
    ListSlots,
    LockInfo,
    LockState,
    Op,
    Peek,
    R,
    Release,
    Remember,
    RememberReply,
    Reserve,
    ReserveReply,
    Retry,
    Scan,
    Slot,
    Store,
    Unreserve,
    scope_key,
)

SCRIPTS = (
    "acquire",
    "claim",
    "heartbeat",
    "retry",
    "finish",
    "release",
    "confirm",
    "inspect",
    "remember",
    "reserve",
    "consume",
    "unreserve",
    "renew_slot",
    "list_slots",
    "peek",
)
#: redis-py's default socket timeout: how long an asyncio operation may wait for Redis.
DEFAULT_TIMEOUT = 5.0
_STATES: dict[str, LockState] = {"q": "queued", "r": "running", "t": "throttled"}
#: Errors that mean "the store cannot answer now" (G5), as opposed to a bug in a request.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # also BusyLoading, MasterNotFound (Sentinel)
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica after failover
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    OSError,
)


def _load_scripts() -> dict[str, str]:
    folder = resources.files(__package__).joinpath("lua")
    lib = folder.joinpath("lib.lua").read_text()
    return {name: lib + "\n" + folder.joinpath(f"{name}.lua").read_text() for name in SCRIPTS}


_SOURCES = _load_scripts()
_SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in _SOURCES.items()}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _opt(value: Any) -> str:
    return "" if value is None else str(value)


class _Call:
    """One script invocation: which script, its keys and arguments, and how to read the reply."""

    __slots__ = ("args", "keys", "parse", "script")

    def __init__(
        self, script: str, keys: list[str], args: list[Any], parse: Callable[[Any], Any]
    ) -> None:
        self.script, self.keys, self.args, self.parse = script, keys, args, parse


class RedisStore(Store):
    """A store on a redis-py client (sync) and/or a ``redis.asyncio`` client.

    Build it with :meth:`from_url`, or from clients you already have: ``RedisStore(client)``,
    ``RedisStore(async_client=...)`` or both. A ``redis.cluster.RedisCluster`` client works
    unchanged, as does a client from ``Sentinel.master_for``.

    ``socket_timeout`` (redis-py's default, 5 s) bounds each operation: after it, Redis counts
    as unavailable (G5). The asyncio clients the store makes apply it per operation rather
    than per socket write; a client you pass in keeps its own settings.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        async_client: Any = None,
        prefix: str = "taskdedup",
        url: str | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if client is None and async_client is None and url is None:
            raise ConfigError("RedisStore needs a client, an async_client or a url")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ConfigError(f"key_prefix must be non-empty and free of braces, not {prefix!r}")
        self.prefix = prefix
        self.url = url
        self._options = client_options or {}
        self._client = client
        self._async_client = async_client
        #: Deadline of each asyncio operation, for the asyncio clients this store makes itself.
        self._async_timeout: float | None = None
        self._builders: dict[type[Any], Callable[[Any], _Call]] = {
            Acquire: self._acquire,
            Peek: self._peek,
            Claim: self._claim,
            Retry: self._retry,
            Finish: self._finish,
            Release: self._release,
            Inspect: self._inspect,
            Remember: self._remember,
            Reserve: self._reserve,
            Consume: self._consume,
            Unreserve: self._unreserve,
            ListSlots: self._list_slots,
        }

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "taskdedup", **options: Any) -> RedisStore:
        """A store for ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://host:port``
        or ``redis+sentinel://host:port[,host:port]/master_name[/db]`` (clients made lazily)."""
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel"):
            raise ConfigError(
                f"unsupported store url {url!r}: use redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel://"
            )
        return cls(url=url, prefix=prefix, client_options=options)

    # -- clients

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._make_client(asynchronous=False)
        return self._client

    @property
    def async_client(self) -> Any:
        if self._async_client is None:
            self._async_client = self._make_client(asynchronous=True)
        return self._async_client

    def _make_client(self, *, asynchronous: bool) -> Any:
        lib: Any = redis.asyncio if asynchronous else redis
        url = self.url
        options = dict(self._options)
        if url is None:  # derive one side from the other client's connection settings
            other = self._async_client if self._client is None else self._client
            options = dict(other.connection_pool.connection_kwargs)
        if asynchronous:
            # redis-py's asyncio client bounds each write with asyncio.wait_for, which costs a
            # Task per command before Python 3.12 (a third of a round trip on loopback). The
            # store bounds each whole operation with one deadline instead: the same limit for
            # a Redis that stops answering (G5), without the Task.
            self._async_timeout = options.pop("socket_timeout", DEFAULT_TIMEOUT)
            options["socket_timeout"] = None
        if url is None:
            return lib.Redis(**options)
        parts = urlsplit(url)
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
        return lib.Redis.from_url(url, **options)

    def _eval(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA the script, loading it once on NOSCRIPT (cheaper than redis-py's Script)."""
        try:
            return self.client.evalsha(_SHAS[name], len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(_SOURCES[name])
            return self.client.evalsha(_SHAS[name], len(keys), *keys, *args)

    async def _aeval(self, name: str, keys: list[str], args: list[Any]) -> Any:
        client = self.async_client
        try:
            async with _deadline(self._async_timeout):
                try:
                    return await client.evalsha(_SHAS[name], len(keys), *keys, *args)
                except redis.exceptions.NoScriptError:
                    await client.script_load(_SOURCES[name])
                    return await client.evalsha(_SHAS[name], len(keys), *keys, *args)
        except asyncio.TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> redis.exceptions.TimeoutError:
        return redis.exceptions.TimeoutError(f"no answer within {self._async_timeout} s")

    # -- the protocol

    def run(self, op: Op[R]) -> R:
        try:
            builder = self._builders.get(type(op))
            if builder is not None:
                call = builder(op)
                raw = self._eval(call.script, call.keys, call.args)
                return cast(R, call.parse(raw))
            return cast(R, self._run_special(op))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}") from exc

    async def arun(self, op: Op[R]) -> R:
        try:
            builder = self._builders.get(type(op))
            if builder is not None:
                call = builder(op)
                raw = await self._aeval(call.script, call.keys, call.args)
                return cast(R, call.parse(raw))
            if self._async_client is None and self.url is None:
                return cast(R, await asyncio.to_thread(self._run_special, op))
            return cast(R, await self._arun_special(op))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}") from exc

    # -- a broker on this same server: lock and message in one step

    def shares_server(self, connection_kwargs: dict[str, Any]) -> bool:
        """True when a client with these connection settings talks to our standalone server
        and database, so a script of ours may also write that client's keys."""
        if isinstance(self.client, redis.cluster.RedisCluster):
            return False
        ours = self.client.connection_pool.connection_kwargs
        fields = ("host", "port", "db", "path", "username")
        return all(_same(ours.get(name), connection_kwargs.get(name), name) for name in fields)

    def acquire_and_push(self, op: Acquire, queue: str, message: str | bytes) -> AcquireReply:
        """:class:`Acquire`, and when the lock is ours LPUSH ``message`` onto the list ``queue``
        in the same script: one round trip, and no window where one exists without the other
        (so the lock needs no confirmation, G11). ``queue`` must live on this server."""
        call = self._acquire(op)
        try:
            raw = self._eval("acquire", [*call.keys, queue], [*call.args, message])
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}") from exc
        return _parse_acquire(raw)

    async def aacquire_and_push(
        self, op: Acquire, queue: str, message: str | bytes
    ) -> AcquireReply:
        """The asyncio twin of :meth:`acquire_and_push`."""
        call = self._acquire(op)
        try:
            raw = await self._aeval("acquire", [*call.keys, queue], [*call.args, message])
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}") from exc
        return _parse_acquire(raw)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def aclose(self) -> None:
        self.close()
        if self._async_client is not None:
            await self._async_client.aclose()

    # -- names

    def _names(self, key: str, *parts: str) -> list[str]:
        base = f"{self.prefix}:{{{key}}}:"
        return [base + part for part in parts]

    # -- single-script operations

    def _acquire(self, op: Acquire) -> _Call:
        return _Call(
            "acquire",
            self._names(op.key, "lock", "fence"),
            [op.job_id, op.ttl_ms, op.grace_ms, 1 if op.record_duplicate else 0]
            + ([] if op.payload is None else [op.payload]),
            _parse_acquire,
        )

    def _peek(self, op: Peek) -> _Call:
        return _Call(
            "peek", self._names(op.key, "lock"), [1 if op.record_duplicate else 0], _parse_peek
        )

    def _claim(self, op: Claim) -> _Call:
        return _Call(
            "claim",
            self._names(op.key, "lock", "run", "job:" + op.job_id, "fence"),
            [
                op.job_id,
                op.owner,
                op.lease_ms,
                op.ttl_ms,
                op.lock,
                1 if op.run_lock else 0,
                op.memory_ms,
                _opt(op.attempt),
                op.max_attempts or 0,
                op.handoff_job_id or "",
                op.grace_ms,
            ],
            _parse_claim,
        )

    def _retry(self, op: Retry) -> _Call:
        return _Call(
            "retry",
            self._names(op.key, "lock", "run", "job:" + op.job_id),
            [op.job_id, op.ttl_ms, _opt(op.attempt)],
            lambda r: bool(int(r)),
        )

    def _finish(self, op: Finish) -> _Call:
        return _Call(
            "finish",
            self._names(op.key, "lock", "run", "job:" + op.job_id, "fence"),
            [
                op.job_id,
                1 if op.throttle else 0,
                op.memory_ms,
                op.handoff_job_id or "",
                _opt(op.attempt),
                op.grace_ms,
                op.ttl_ms,
            ],
            _parse_finish,
        )

    def _release(self, op: Release) -> _Call:
        return _Call(
            "release", self._names(op.key, "lock", "run"), [op.job_id], lambda r: int(r) > 0
        )

    def _inspect(self, op: Inspect) -> _Call:
        return _Call(
            "inspect",
            self._names(op.key, "lock", "run"),
            [],
            lambda r: _parse_info(op.key, r),
        )

    def _remember(self, op: Remember) -> _Call:
        return _Call(
            "remember",
            self._names(op.key, "lock"),
            [op.job_id, op.fingerprint, op.ttl_ms, op.grace_ms, op.replaces or ""],
            _parse_remember,
        )

    def _scope_names(self, scope: str) -> list[str]:
        return self._names(scope_key(scope), "slots", "scope")

    def _reserve(self, op: Reserve) -> _Call:
        return _Call(
            "reserve",
            self._scope_names(op.scope),
            [op.member, op.limit, op.ttl_ms, op.scope],
            lambda r: ReserveReply(bool(int(r[0])), int(r[1])),
        )

    def _consume(self, op: Consume) -> _Call:
        return _Call(
            "consume",
            self._scope_names(op.scope),
            [op.member, op.job_id, op.ttl_ms, op.scope],
            lambda r: bool(int(r)),
        )

    def _unreserve(self, op: Unreserve) -> _Call:
        return _Call(
            "unreserve",
            self._scope_names(op.scope),
            [op.member, op.scope],
            lambda r: bool(int(r)),
        )

    def _list_slots(self, op: ListSlots) -> _Call:
        return _Call(
            "list_slots",
            self._scope_names(op.scope)[:1],
            [],
            lambda r: [Slot(_s(r[i]), int(r[i + 1])) for i in range(0, len(r), 2)],
        )

    # -- batches and tools: pipelines (one round trip; Cluster pipelines split by node)

    def _heartbeat_calls(self, op: Heartbeat) -> list[_Call]:
        return [self._lease_call(lease) for lease in op.leases]

    def _lease_call(self, lease: Lease) -> _Call:
        if lease.slot:
            return _Call(
                "renew_slot",
                self._scope_names(lease.key),
                [lease.job_id, lease.lease_ms, lease.key],
                lambda r: bool(int(r)),
            )
        return _Call(
            "heartbeat",
            self._names(lease.key, "lock", "run", "job:" + lease.job_id),
            [lease.job_id, lease.lease_ms],
            lambda r: bool(int(r)),
        )

    def _confirm_calls(self, op: Confirm) -> list[_Call]:
        return [
            _Call("confirm", self._names(key, "lock"), [job_id], lambda r: int(r))
            for key, job_id in op.items
        ]

    def _batch(self, op: Op[Any]) -> tuple[list[_Call], Callable[[list[Any]], Any]]:
        if isinstance(op, Heartbeat):
            return self._heartbeat_calls(op), tuple
        if isinstance(op, Confirm):
            return self._confirm_calls(op), sum
        raise TypeError(f"RedisStore cannot run {type(op).__name__}")

    def _run_special(self, op: Op[Any]) -> Any:
        if isinstance(op, Scan):
            return self._scan(op)
        if isinstance(op, ListScopes):
            return self._list_scopes(op)
        if isinstance(op, ForceUnlock):
            return bool(self.client.delete(*self._names(op.key, "lock", "run")))
        calls, combine = self._batch(op)
        results: list[Any] = [None] * len(calls)
        for client, indexes in self._by_node(calls):
            for i, raw in zip(indexes, self._pipeline(client, calls, indexes), strict=True):
                results[i] = calls[i].parse(raw)
        return combine(results)

    def _pipeline(self, client: Any, calls: list[_Call], indexes: list[int]) -> list[Any]:
        """EVALSHA each call in one pipeline; load the scripts and resend once on NOSCRIPT
        (redis-py's own script pipelining asks SCRIPT EXISTS first, every time)."""
        for attempt in (1, 2):
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                call = calls[i]
                pipe.evalsha(_SHAS[call.script], len(call.keys), *call.keys, *call.args)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                for name in {calls[i].script for i in indexes}:
                    client.script_load(_SOURCES[name])
        raise AssertionError("unreachable")

    def _by_node(self, calls: list[_Call]) -> list[tuple[Any, list[int]]]:
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
        if isinstance(op, Scan | ForceUnlock | ListScopes) or cluster:
            return await asyncio.to_thread(self._run_special, op)
        calls, combine = self._batch(op)
        if not calls:
            return combine([])
        client = self.async_client
        try:
            async with _deadline(self._async_timeout):
                for attempt in (1, 2):
                    pipe = client.pipeline(transaction=False)
                    for call in calls:
                        pipe.evalsha(_SHAS[call.script], len(call.keys), *call.keys, *call.args)
                    try:
                        raws = await pipe.execute()
                        break
                    except redis.exceptions.NoScriptError:
                        if attempt == 2:
                            raise
                        for name in {call.script for call in calls}:
                            await client.script_load(_SOURCES[name])
        except asyncio.TimeoutError:
            raise self._timed_out() from None
        return combine([call.parse(raw) for call, raw in zip(calls, raws, strict=True)])

    def _list_scopes(self, op: ListScopes) -> list[str]:
        found: list[str] = []
        for raw in self.client.scan_iter(match=f"{self.prefix}:{{res:*}}:scope", count=500):
            name = self.client.get(raw)
            if name is not None:
                found.append(_s(name))
                if len(found) >= op.limit:
                    break
        return found

    def _scan(self, op: Scan) -> list[LockInfo]:
        found: list[LockInfo] = []
        seen: set[str] = set()
        head = self.prefix + ":{"
        for raw in self.client.scan_iter(match=f"{self.prefix}:{{*}}:*", count=500):
            name = _s(raw)
            if not name.endswith(("}:lock", "}:run")):
                continue
            key = name[len(head) : name.rindex("}")]
            if key in seen:
                continue
            seen.add(key)
            info = self.run(Inspect(key))
            if info is not None:
                found.append(info)
                if len(found) >= op.limit:
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


def _parse_remember(r: Any) -> RememberReply:
    state, fingerprint, job = _s(r).split(" ", 2)
    return RememberReply(state == "1", job, fingerprint, pending=state == "p")


def _parse_peek(r: Any) -> AcquireReply | None:
    if r is None:
        return None
    fence, dups, holder = _s(r).split(" ", 2)
    return AcquireReply(False, holder, int(fence), int(dups))


def _parse_acquire(r: Any) -> AcquireReply:
    acquired, fence, dups, holder = _s(r).split(" ", 3)
    return AcquireReply(acquired == "1", holder, int(fence), int(dups))


def _parse_claim(r: Sequence[Any]) -> ClaimReply:
    handoff = None
    if len(r) > 4 and r[4]:
        handoff = Handoff(_s(r[4]), None if len(r) < 6 or r[5] is None else _s(r[5]))
    outcome = cast(Any, _s(r[0]))
    return ClaimReply(outcome, int(r[1] or 0), int(r[2] or 0), _s(r[3] or ""), handoff)


def _parse_finish(r: Sequence[Any]) -> FinishReply:
    outcome = _s(r[0])
    if outcome == "stale":
        return FinishReply(False, None, stale=True)
    handoff = None
    if r[1]:
        handoff = Handoff(_s(r[1]), None if len(r) < 3 or r[2] is None else _s(r[2]))
    return FinishReply(outcome == "released", handoff)


def _parse_info(key: str, r: Sequence[Any]) -> LockInfo | None:
    job, state, fence, dups, confirmed, pttl, run_job, run_pttl = r
    run_holder = _s(run_job) if run_job else None
    if not job:
        if run_holder is None:
            return None
        return LockInfo(key, run_holder, "running", 0, 0, int(run_pttl), True, run_holder)
    return LockInfo(
        key,
        _s(job),
        _STATES[_s(state)],
        int(fence),
        int(dups),
        int(pttl),
        _s(confirmed) == "1",
        run_holder,
    )
