"""The nearest valid name to a misspelled one, for error messages ("did you mean ...?").

A setting, option or label that is misspelled must not be ignored: it is a ConfigError that
names it and the name that was probably meant.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import ConfigError
from .policy import ON_CONFLICT, STRATEGIES, Policy


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The valid name closest to ``name``: by spelling (``dry_rn`` -> ``dry_run``), else by a
    shared word (``lease_secnds`` -> ``default_lease``); None when nothing is close."""
    options = sorted(set(choices))
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if close:
        return close[0]
    words = [word for word in name.lower().split("_") if len(word) > 2]
    best, best_score = None, 0.0
    for option in options:
        parts = option.lower().split("_")
        shared = sum(1 for word in words if difflib.get_close_matches(word, parts, 1, 0.8))
        if shared:
            score = shared + difflib.SequenceMatcher(None, name, option).ratio()
            if score > best_score:
                best, best_score = option, score
    return best


def did_you_mean(name: str, choices: Iterable[str], spell: Callable[[str], str] = str) -> str:
    """``"; did you mean 'x'?"`` for the nearest choice (shown through ``spell``, e.g. with
    the prefix the caller wrote), or the list of valid names when none is near."""
    options = sorted(set(choices))
    best = nearest(name, options)
    if best is not None:
        return f"; did you mean {spell(best)!r}?"
    return "; choose one of " + ", ".join(spell(option) for option in options)


def check_policy_names(options: Any) -> None:
    """Raise ConfigError, with the nearest valid name, for a misspelled strategy, on_conflict
    or option name in a policy declaration (a strategy name or a mapping); the Policy checks
    the rest."""
    if isinstance(options, str):
        options = {"strategy": options}
    if not isinstance(options, Mapping):
        return
    fields = [field.name for field in dataclasses.fields(Policy)]
    for name in options:
        if name not in fields:
            raise ConfigError(f"unknown deduplicate option {name!r}{did_you_mean(name, fields)}")
    for name, valid in (("strategy", STRATEGIES), ("on_conflict", ON_CONFLICT)):
        value = options.get(name)
        if isinstance(value, str) and value not in valid:
            raise ConfigError(f"unknown {name} {value!r}{did_you_mean(value, valid)}")
