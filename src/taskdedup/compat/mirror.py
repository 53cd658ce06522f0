"""The peer's lock key, kept beside taskdedup's own lock during a migration.

A compat task (:mod:`taskdedup.compat.celery_once`, :mod:`taskdedup.compat.celery_singleton`)
takes taskdedup's lock, which decides among compat producers and workers, and also the key the
original package would have taken, in the form it takes it (``SET key value NX PX|EX``). An old
producer still running the original package then finds that key held and deduplicates against
the new code, and the new code finds the old producer's key held and does the same: a rolling
deploy keeps deduplicating in both directions.

The mirror follows the life taskdedup gives the lock, not the peer's: while a job runs, its
mirror is held on the job's lease and renewed by a thread of the worker process (:class:`Keeper`),
so a worker killed with kill -9 frees it within the lease, as it frees taskdedup's own lock;
a retry puts it back on the peer's ttl; the end of the job deletes it, but only if it still
names this job (compare-and-delete: a later job's key is never taken away).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The message header that carries the peer key from a compat producer to the worker, so the
#: worker frees the key the producer took even when a JSON round trip changed the arguments
#: (a tuple became a list), which left celery-once's lock stuck until its timeout.
PEER_KEY_HEADER = "taskdedup_peer_key"

_ADOPT = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if v == ARGV[1] or ARGV[3] == '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_HOLD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('PERSIST', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Sent:
    """A script call written now and read later (:meth:`reply`), so that a worker does not
    wait for the round trip: the server runs it as soon as it arrives, in order with the
    worker's other commands. A call that could not be written runs the usual way when its
    reply is read."""

    __slots__ = ("_again", "_connection", "_pool")

    def __init__(self, script: Any, keys: list[str], args: list[Any]) -> None:
        self._again: Callable[[], Any] = lambda: script(keys=keys, args=args)
        self._pool = script.registered_client.connection_pool
        self._connection: Any = None
        try:
            connection = self._pool.get_connection()
        except Exception:
            return
        try:
            connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except Exception:
            self._pool.release(connection)
            return
        self._connection = connection

    def reply(self) -> Any:
        connection, self._connection = self._connection, None
        if connection is None:
            return self._again()
        try:
            return connection.read_response()
        except Exception:  # (NOSCRIPT after a server restart, a broken connection)
            connection.disconnect()
            return self._again()
        finally:
            self._pool.release(connection)


class RedisMirror:
    """The peer's key on the peer's Redis, with the few atomic operations a migration needs."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._adopt = client.register_script(_ADOPT)
        self._renew = client.register_script(_RENEW)
        self._hold = client.register_script(_HOLD)
        self._release = client.register_script(_RELEASE)
        self._loaded = False

    def _send(self, script: Any, keys: list[str], args: list[Any]) -> Sent:
        if not self._loaded:  # (EVALSHA needs the scripts on the server: load them once)
            for loaded in (self._adopt, self._release):
                self.client.script_load(loaded.script)
            self._loaded = True
        return Sent(script, keys, args)

    def send_adopt(self, key: str, value: str, lease_ms: int, any_holder: bool) -> Sent:
        """:meth:`adopt`, written now and read later."""
        return self._send(self._adopt, [key], [value, lease_ms, "1" if any_holder else "0"])

    def send_release(self, key: str, value: str) -> Sent:
        """:meth:`release`, written now and read later."""
        return self._send(self._release, [key], [value])

    def take(self, key: str, value: str, ttl_ms: int | None) -> bool:
        """``SET key value NX [PX ttl]``, as the peer takes it: True if this call took it."""
        return bool(self.client.set(key, value, nx=True, px=ttl_ms or None))

    def take_or_read(
        self, key: str, value: str, ttl_ms: int | None, read: str
    ) -> tuple[bool, str | None]:
        """``SET key value NX [PX ttl]`` and, in the same round trip, what a duplicate is
        answered with (``read``: "ttl", its PTTL; "value", its value): (taken, that answer)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, value, nx=True, px=ttl_ms or None)
        pipe.pttl(key) if read == "ttl" else pipe.get(key)
        taken, answer = pipe.execute()
        if isinstance(answer, bytes):
            answer = answer.decode()
        return bool(taken), None if answer is None else str(answer)

    def holder(self, key: str) -> str | None:
        """The value the key holds (the holder's task id, for celery-singleton), or None."""
        value = self.client.get(key)
        return value.decode() if isinstance(value, bytes) else value

    def pttl(self, key: str) -> int:
        """The key's remaining life in ms (-1: no expiry, -2: gone), as celery-once reads it."""
        return int(self.client.pttl(key))

    def adopt(self, key: str, value: str, lease_ms: int, any_holder: bool) -> bool:
        """A worker starts the job: put the key on the job's lease, named for the job. Only
        a key that exists and names this job is adopted (``any_holder``: whatever it names,
        for celery-once, whose producers write a meaningless token)."""
        return bool(self._adopt(keys=[key], args=[value, lease_ms, "1" if any_holder else "0"]))

    def renew(self, key: str, value: str, lease_ms: int) -> bool:
        """Renew the lease of a key this job holds."""
        return bool(self._renew(keys=[key], args=[value, lease_ms]))

    def hold(self, key: str, value: str, ttl_ms: int | None) -> bool:
        """A retry goes back to the queue: the key keeps the peer's ttl (None: no expiry)."""
        return bool(self._hold(keys=[key], args=[value, ttl_ms or ""]))

    def release(self, key: str, value: str) -> bool:
        """Delete the key if it still names ``value`` (never a later holder's)."""
        return bool(self._release(keys=[key], args=[value]))

    def force_release(self, key: str) -> bool:
        """Delete the key whoever holds it, as the peer's own release does."""
        return bool(self.client.delete(key))


@dataclass
class _Held:
    mirror: RedisMirror
    key: str
    value: str
    lease_ms: int


class Keeper:
    """Renews the mirrors of the jobs running in this process, every third of their lease.

    One daemon thread per process, started on first use (after a fork, the child starts its
    own). It dies with the process: a killed worker's mirrors lapse within their lease.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, str], _Held] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pid = 0
        self._lease_ms = 60_000  # the shortest lease held when the thread last looked

    def keep(self, mirror: RedisMirror, key: str, value: str, lease_ms: int) -> None:
        with self._lock:
            self._held[(id(mirror), key)] = _Held(mirror, key, value, lease_ms)
            wake = lease_ms < self._lease_ms  # (a shorter lease than the thread waits for)
            if self._pid != os.getpid():
                self._pid, wake = os.getpid(), False
                threading.Thread(target=self._run, name="taskdedup-mirror", daemon=True).start()
        if wake:
            self._wake.set()

    def drop(self, mirror: RedisMirror, key: str) -> None:
        """Stop renewing (the job ended or went back to the queue)."""
        with self._lock:
            self._held.pop((id(mirror), key), None)

    def _run(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            with self._lock:
                held = list(self._held.values())
                self._lease_ms = min((h.lease_ms for h in held), default=60_000)
            wait = self._lease_ms / 3000
            if self._wake.wait(wait):
                self._wake.clear()
                continue
            for h in held:
                with self._lock:  # a job that ended meanwhile is not renewed again
                    if (id(h.mirror), h.key) not in self._held:
                        continue
                    try:
                        h.mirror.renew(h.key, h.value, h.lease_ms)
                    except Exception:  # the store is down: its lease lapses, as ours does
                        time.sleep(0)


KEEPER = Keeper()
