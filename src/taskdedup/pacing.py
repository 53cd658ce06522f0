"""Pacing: the submissions of a scope spread out to a rate, delayed rather than dropped.

``until_expired`` is the drop-style throttle: a second submission within the ttl is answered
with the first job and never runs. Pacing keeps every submission: one over the rate of its
scope is given a start in the future (the next free one), so the work is smoothed, not lost,
and submissions keep their order. The decision is one atomic store call per submission
(:class:`~taskdedup.stores.base.Pace`, a GCRA with ``burst``): at most ``burst`` start at
once, then one every ``1/rate``, across every producer of the scope.

Standalone::

    pacer = Pacer(store)
    reports = PacePolicy("10/s")                  # burst 1: one every 100 ms
    wait = pacer.delay("reports", reports)        # 0.0, then 0.1, 0.2... for the next ones
    send_report(countdown=wait)

``scope`` is as ``@reserve``'s: the name of the task argument whose value names the scope
(``"tenant"`` paces each tenant apart), a callable of the task's arguments, or None for the
task itself.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import ConfigError
from .flow import Flow, adrive, drive
from .reservations import check_scope, scope_of
from .settings import Settings
from .stores.base import Pace, Store, ms

log = logging.getLogger("taskdedup")

#: "<count>/<unit>" or "<count>/<n><unit>": 10/s, 100/m, 5/30s, 2.5/h, 1000/d
RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*$")
UNITS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60}
UNITS |= {"h": 3600, "hour": 3600, "d": 86400, "day": 86400}
RATE_HELP = "write it as '<count>/<unit>' such as '10/s', '100/m', '5/30s' (units s, m, h, d)"


def parse_rate(rate: object) -> float:
    """Seconds between two starts at ``rate`` ("10/m" -> 6.0); a ConfigError otherwise."""
    found = RATE.match(rate.lower()) if isinstance(rate, str) else None
    name = found.group(3) if found else ""
    unit = UNITS.get(name if name in UNITS or len(name) < 3 else name.removesuffix("s"))
    if found is None or unit is None:
        raise ConfigError(f"pace rate {rate!r} does not parse; {RATE_HELP}")
    count, per = float(found.group(1)), float(found.group(2) or 1)
    if count <= 0 or per <= 0:
        raise ConfigError(f"pace rate {rate!r} must be above 0; {RATE_HELP}")
    if per * unit / count < 0.001:
        raise ConfigError(f"pace rate {rate!r} is over 1000/s, the finest pace (1 ms apart)")
    return per * unit / count


@dataclasses.dataclass(frozen=True)
class PacePolicy:
    """A task's pace: ``rate`` submissions per unit of time per scope, ``burst`` of them at
    once (default 1: evenly spaced). ``scope``: None (the task itself), the name of a task
    argument (``"tenant"``: each tenant paced apart) or a callable of the arguments."""

    rate: str
    burst: int = 1
    scope: str | Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ConfigError(f"pace burst must be an int >= 1, not {self.burst!r}")
        if self.scope is not None and not (
            callable(self.scope) or (isinstance(self.scope, str) and self.scope)
        ):
            raise ConfigError(
                f"pace scope must be an argument name, a callable or None (the task itself), "
                f"not {self.scope!r}"
            )

    @property
    def interval_seconds(self) -> float:
        """Seconds between two starts once the burst is spent."""
        return parse_rate(self.rate)

    @classmethod
    def from_options(cls, options: PacePolicy | str | Mapping[str, Any]) -> PacePolicy:
        """A policy from a ``pace=`` task option: a PacePolicy, a rate, or a mapping."""
        if isinstance(options, PacePolicy):
            return options
        if isinstance(options, str):
            return cls(options)
        unknown = set(options) - {"rate", "burst", "scope"}
        if unknown:
            raise ConfigError(
                f"unknown pace option(s) {', '.join(sorted(unknown))}; use rate, burst, scope"
            )
        return cls(**options)

    def check(self, task: str, fn: Callable[..., Any] | None) -> None:
        """A scope argument the task does not take is a ConfigError now, not at enqueue."""
        hint = "name one, pass a callable, or leave it out to pace the task as a whole"
        check_scope(self.scope, fn, "", hint)

    def scope_for(
        self,
        task: str,
        fn: Callable[..., Any] | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> str:
        """The scope of one call: the task's name when no scope is given."""
        if self.scope is None:
            return task
        return scope_of(task, "pace", self.scope, fn, args, kwargs)


class Pacer:
    """Takes the next free start of a paced scope, one atomic store call each.

    ``enabled=False`` (the kill switch, G16): every call starts at once and no store command
    is sent. ``dry_run=True``: the start is taken and logged (``pace would_delay``) but the
    call is not held back."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings()

    def delay(self, scope: str, policy: PacePolicy) -> float:
        """Seconds from now until this submission of ``scope`` may start (0: at once)."""
        return drive(self.delay_flow(scope, policy), self.store)

    async def adelay(self, scope: str, policy: PacePolicy) -> float:
        return await adrive(self.delay_flow(scope, policy), self.store)

    def delay_flow(self, scope: str, policy: PacePolicy) -> Flow[float]:
        """:meth:`delay` as a flow (a submission takes it after its cap)."""
        if not self.settings.enabled:
            return 0.0
        wait_ms: int = yield Pace(scope, ms(policy.interval_seconds), policy.burst)
        if self.settings.dry_run and wait_ms > 0:
            log.info("taskdedup: pace would_delay scope=%s by %.3fs", scope, wait_ms / 1000)
            return 0.0
        return wait_ms / 1000
