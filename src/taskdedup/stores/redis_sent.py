"""A script call written now and read later, so a caller can overlap the round trip.

On a RabbitMQ broker, or a Redis broker apart from the store, an enqueue must have the store's
answer before the message leaves, but not before Celery builds it. The publisher writes the
acquire to Redis first, lets Celery build and serialize the message while Redis answers, and
reads the reply just before the publish: the wait on the wire overlaps work that was due anyway.

The call holds one pooled connection between the write and the read. A write or a read that
fails, or a script the server has not loaded, is answered by running the call again the usual
way (with redis-py's retries), as redis-py's own retries would have. ``RedisStore.run`` goes
this way too, writing and reading at once: redis-py's per-command wrappers cost a worker a few
percent per job.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import redis
import redis.cluster
import redis.exceptions

from .. import events
from .redis_calls import SHAS, ScriptCall

_NOT_SENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class SentCall:
    """One script call on its way: :meth:`reply` reads and parses its reply (once)."""

    __slots__ = ("_again", "_answering", "_call", "_client", "_connection", "_error", "_pool")

    def __init__(
        self,
        call: ScriptCall,
        client: Any,
        connection: Any,
        again: Callable[[], Any],
        answering: Callable[[list[str]], AbstractContextManager[None]],
        error: BaseException | None = None,
    ) -> None:
        # the client is kept: collected, it would close its pool's connections, ours too
        self._call, self._client, self._connection = call, client, connection
        self._pool = client.connection_pool
        self._again, self._answering = again, answering
        self._error = error  # no connection could be had: that is the reply

    @property
    def written(self) -> bool:
        """Whether the call went out (else it runs, the usual way, when its reply is read)."""
        return self._connection is not None

    def reply(self) -> Any:
        """The call's parsed reply; a Redis that cannot answer raises StoreUnavailable. The
        wait for it is timed while :data:`taskdedup.events.store_calls` has listeners."""
        return events.timed(self._call.script, self._reply)

    def _reply(self) -> Any:
        with self._answering(self._call.keys):
            raw = self._read()
        return self._call.parse(raw)

    def _read(self) -> Any:
        connection, self._connection = self._connection, None
        if self._error is not None:
            raise self._error
        if connection is None:  # the write failed: ask the usual way
            return self._again()
        try:
            raw = connection.read_response()
        except redis.exceptions.NoScriptError:
            self._pool.release(connection)
            return self._again()  # loads the script, then runs it
        except redis.exceptions.ResponseError:
            self._pool.release(connection)
            raise
        except _NOT_SENT:  # as redis-py's retries would: the call again, on a new connection
            connection.disconnect()
            self._pool.release(connection)
            return self._again()
        except BaseException:
            connection.disconnect()  # a reply may still be on its way: never reuse it
            self._pool.release(connection)
            raise
        self._pool.release(connection)
        return raw


def send(
    client: Any,
    call: ScriptCall,
    again: Callable[[], Any],
    answering: Callable[[list[str]], AbstractContextManager[None]],
) -> SentCall | None:
    """Write ``call`` on a connection of ``client``'s pool; None where that cannot be done
    (a Cluster client, a client on one fixed connection): the caller then runs it as usual."""
    if isinstance(client, redis.cluster.RedisCluster) or getattr(client, "connection", None):
        return None
    pool = client.connection_pool
    try:
        connection = pool.get_connection()
    except _NOT_SENT as exc:  # redis-py tried (and retried) to connect: that is the answer
        return SentCall(call, client, None, again, answering, exc)
    try:
        connection.send_command(
            "EVALSHA", SHAS[call.variant], len(call.keys), *call.keys, *call.args
        )
    except _NOT_SENT:
        connection.disconnect()
        pool.release(connection)
        connection = None  # asked again, with redis-py's retries, when the reply is read
    except BaseException:
        pool.release(connection)
        raise
    return SentCall(call, client, connection, again, answering)
