"""The exceptions taskdedup raises.

Every error derives from :class:`DedupError`, so one ``except DedupError`` catches them all;
the ones a caller is likely to handle on their own also derive from the matching built-in.
"""

from __future__ import annotations


class DedupError(Exception):
    """Base class of every taskdedup error."""


class ConfigError(DedupError, ValueError):
    """A policy or setting is invalid; raised when the task is defined, not when it runs."""


class KeyEncodingError(DedupError, TypeError):
    """A task argument cannot be turned into a deduplication key (or does not bind)."""

    def __init__(self, task: str, argument: str, reason: str) -> None:
        self.task = task
        self.argument = argument
        self.reason = reason
        super().__init__(f"task {task!r}: argument {argument!r} {reason}")


class DuplicateJob(DedupError):
    """An equal job is already queued or running, and the policy says ``on_conflict="raise"``."""

    def __init__(self, job_id: str, key: str, task: str | None = None) -> None:
        self.job_id = job_id
        self.key = key
        self.task = task
        where = f" of task {task!r}" if task else ""
        super().__init__(f"duplicate job{where}: job {job_id} already holds key {key}")


class Superseded(DedupError):
    """Raised by :func:`taskdedup.raise_if_superseded` in a job a newer submission asked to
    stop (``on_conflict="supersede", running="cancel"``); the newer run follows it."""

    def __init__(self, job_id: str | None = None) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} was superseded by a newer submission; it stops here")


class QuotaExceeded(DedupError):
    """A reservation scope already has its maximum number of jobs in flight."""

    def __init__(self, scope: str, limit: int) -> None:
        self.scope = scope
        self.limit = limit
        super().__init__(f"Quota exceeded: maximum {limit} concurrent jobs for scope {scope}")


class IdempotencyKeyMismatch(DedupError):
    """An idempotency key was reused with another task or other arguments."""

    def __init__(self, key: str, job_id: str) -> None:
        self.key = key
        self.job_id = job_id
        super().__init__(
            f"idempotency key {key!r} was first used for job {job_id} with another task "
            "or other arguments; use a new key for new work"
        )


class IdempotencyKeyInProgress(DedupError):
    """Another submission with this idempotency key is still being published.

    Its job may yet fail to publish (and the key be freed), so answering with its id could
    hand the caller a job that never exists. Retry the submission in a moment.
    """

    def __init__(self, key: str, job_id: str, waited: float) -> None:
        self.key = key
        self.job_id = job_id
        super().__init__(
            f"idempotency key {key!r}: the submission of job {job_id} with this key was still "
            f"being published after {waited:g} s; retry this submission later"
        )


class InvalidIdempotencyKey(DedupError, ValueError):
    """An idempotency key is not 1 to 256 printable ASCII characters without spaces."""

    def __init__(self, key: object) -> None:
        self.key = key
        shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        super().__init__(
            f"invalid idempotency key {shown}: use 1 to 256 printable ASCII characters "
            "without spaces, e.g. 'ci-build-4f2a9c1' or 'gh-org/repo-<commit sha>'"
        )


class CorruptRecord(DedupError):
    """A record under taskdedup's key prefix is not one taskdedup wrote (another type, a
    garbled counter): another program shares the prefix, or a hand edit went wrong."""

    def __init__(self, keys: list[str], reply: str) -> None:
        self.keys = keys
        reply = reply.split(" script:")[0]
        super().__init__(
            f"a Redis key is not what taskdedup expects there ({reply}); it is one of "
            f"{', '.join(keys)}: delete it (taskdedup writes its own again) or give taskdedup "
            "a key_prefix of its own"
        )


class PayloadTooLarge(DedupError, ValueError):
    """A reschedule_once call's arguments are larger than ``reschedule_payload_limit``.

    The arguments of the latest duplicate are stored with the lock, so that the one more run
    owed after the current one uses them; an unbounded payload would be written again for
    every duplicate. Nothing was written and nothing published."""

    def __init__(self, task: str, size: int, limit: int) -> None:
        self.task, self.size, self.limit = task, size, limit
        super().__init__(
            f"task {task!r}: its arguments take {size} bytes, more than "
            f"reschedule_payload_limit ({limit} bytes), which reschedule_once stores with the "
            "lock; pass a reference (an id, a URL) instead of the data, or raise the setting "
            "(0: no limit)"
        )


class StoreUnavailable(DedupError, ConnectionError):
    """The lock store could not be reached or did not answer."""
