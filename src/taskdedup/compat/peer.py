"""What a drop-in says about its peer (celery-once, celery-singleton): the hooks a subclass of
:class:`~taskdedup.compat.base.CompatTask` fills in, and when taskdedup's acquire may take the
peer's key in its own step (:func:`guard_for`)."""

from __future__ import annotations

from typing import Any, ClassVar

from ..celery.state import CeleryDedup
from ..decide.step import active
from ..recent import RecentKeys
from ..stores.base import Guard, TakesGuards
from .mirror import RedisMirror


class PeerHooks:
    """The peer's key, ttl, policy and answers, as each drop-in defines them."""

    #: celery-once's producers write a meaningless token, so its worker adopts any holder.
    adopts_any_holder: ClassVar[bool] = False
    #: options of ``apply_async`` that the peer reads and taskdedup does not send
    peer_options: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------ what a peer says

    def peer_key(self, args: Any, kwargs: Any) -> str:
        raise NotImplementedError

    def peer_ttl_ms(self, options: dict[str, Any]) -> int | None:
        raise NotImplementedError

    def peer_policy(self) -> dict[str, Any]:
        raise NotImplementedError

    def peer_mirror(self) -> RedisMirror | None:
        """The peer's key store, or None when the peer's backend is not Redis."""
        raise NotImplementedError

    def peer_url(self) -> str | None:
        """The peer's Redis URL, the store's default when the app has no Redis."""
        return None

    def peer_duplicate(self, key: str, holder: str | None, options: dict[str, Any]) -> Any:
        raise NotImplementedError

    def peer_take(self, key: str, task_id: str, options: dict[str, Any]) -> Any:
        """Take the peer's key for ``task_id``; None if taken, else the duplicate's answer."""
        mirror = self.peer_mirror()
        if mirror is None or mirror.take(key, task_id, self.peer_ttl_ms(options)):
            return None
        return self.peer_duplicate(key, None, options)

    def peer_give_back(self, key: str, task_id: str) -> None:
        mirror = self.peer_mirror()
        if mirror is not None:
            mirror.release(key, task_id)

    #: what the peer reads of a key it finds held: its remaining life, or the holder it names
    peer_reads: ClassVar[Any] = "value"

    def takes_peer_key_as_is(self) -> bool:
        """Whether the peer's key is taken exactly as :class:`RedisMirror` takes it (``SET NX
        [PX]``), so taskdedup's acquire may take it in the same step: False for a backend or
        a method of the user's, and a wait for the key (celery-once's ``blocking``)."""
        return False

    def peer_answer(self, key: str, answer: str, options: dict[str, Any]) -> Any:
        """A duplicate's answer from what the held key said (:attr:`peer_reads`)."""
        return self.peer_duplicate(key, answer or None, options)

    def unlocks_at_start(self) -> bool:
        """Whether the peer's key is freed when the job starts (celery-once's option)."""
        return False


def guard_for(
    task: Any, integ: CeleryDedup, key: str, task_id: str, call: dict[str, Any]
) -> Guard | None:
    """The peer's key as a guard of taskdedup's acquire (both taken in one round trip), or
    None where it is taken apart, first (see :meth:`PeerHooks.takes_peer_key_as_is`):
    taskdedup off for the task, eager mode, a store on another server than the peer's key."""
    if not task.takes_peer_key_as_is():
        return None
    if not active(integ.settings, task.name) or integ.settings.dry_run:
        return None
    if integ.app.conf.task_always_eager:
        return None
    mirror, store = task.peer_mirror(), integ.dedup.store
    if mirror is None or not isinstance(store, TakesGuards):
        return None
    shared = task.__dict__.get("_compat_guards_on")
    if shared is None or shared[0] is not store:  # (asked once per store)
        kwargs = mirror.client.connection_pool.connection_kwargs
        shared = task.__dict__["_compat_guards_on"] = (store, store.takes_guards_on(kwargs))
    if not shared[1]:
        return None
    return Guard(key, task_id, task.peer_ttl_ms(call), task.peer_reads)


def recent_keys(task: Any) -> RecentKeys:
    """The peer keys ``task`` found held lately in this process."""
    found = task.__dict__.get("_compat_recent")
    if found is None:
        found = task.__dict__["_compat_recent"] = RecentKeys()
    return found  # type: ignore[no-any-return]


def held_lately(task: Any, key: str) -> bool:
    """Whether a call of ``key`` is likely a duplicate (the key was found held a moment ago)
    and the peer's key can be asked alone, ``SET NX`` and its read in one round trip: a
    duplicate then costs the peer's two commands, not a script (a likely new key goes to
    taskdedup's acquire as a guard instead: one round trip for both keys)."""
    return bool(task.takes_peer_key_as_is() and recent_keys(task).seen(key))
