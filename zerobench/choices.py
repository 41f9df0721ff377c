"""One message for a value outside a known set: the name it was given under, the value,
the closest allowed ones ("did you mean") and every allowed one.

Every such refusal of zerobench goes through :func:`not_allowed` (a workload's field,
engine, axis and axis value; a workload name; a cell or configuration id), so a typo reads
the same everywhere::

    matrix.engine: 'impl-fdsp' is not allowed; did you mean 'impl-fsdp'? (allowed: 'ddp', ...)

Ignoring case (``full_shard`` finds ``FULL_SHARD``), the closest is the one allowed
value that starts with what was given (``FULL``), else the nearest by :mod:`difflib`'s
ratio. Standard library only, no zerobench import: every floor may use it
(tests/test_import_graph.py, LEAVES).
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["closest", "did_you_mean", "not_allowed", "unknown_key"]

#: difflib's similarity below which a candidate is no suggestion (its own default).
CUTOFF = 0.6


def closest(value: Any, allowed: Iterable[Any], n: int = 1) -> list[Any]:
    """The allowed values closest to ``value`` (at most ``n``, best first), compared as
    lower-case text; none when nothing is close or ``value`` is itself allowed."""
    allowed = list(allowed)
    if value in allowed and not isinstance(value, bool):
        return []
    by_text: dict[str, Any] = {}
    for choice in allowed:
        by_text.setdefault(str(choice).lower(), choice)
    text = str(value).lower()
    if text in by_text and by_text[text] != value:  # only the case (or the type) differs
        return [by_text[text]]
    starting = [t for t in by_text if t.startswith(text)] if len(text) >= 2 else []
    if len(starting) == 1:  # the start of one of them ("FULL" for FULL_SHARD)
        return [by_text[starting[0]]]
    return [by_text[t] for t in difflib.get_close_matches(text, list(by_text), n=n, cutoff=CUTOFF)]


def did_you_mean(value: Any, allowed: Iterable[Any], show=repr) -> str:
    """"; did you mean 'x'?" for the closest allowed value, or "" when none is close."""
    found = closest(value, allowed)
    return f"; did you mean {show(found[0])}?" if found else ""


def not_allowed(name: str, value: Any, allowed: Iterable[Any], show=repr, what: str = "") -> str:
    """"NAME: 'value' is not allowed; did you mean 'x'? (allowed: 'a', 'b')".

    ``show`` formats the value and each allowed one (``repr`` by default, ``str`` for
    names printed bare); ``what`` replaces "is not allowed" (e.g. "is not a cell of w")."""
    allowed = list(allowed)
    listing = ", ".join(show(a) for a in allowed) or "none"
    return f"{name}: {show(value)} {what or 'is not allowed'}{did_you_mean(value, allowed, show)} (allowed: {listing})"


def unknown_key(key: str, allowed: Iterable[str], where: str, note: str = "") -> str:
    """"unknown key data.stepz; did you mean data.steps? (allowed in data: seed, steps, ...)".

    ``key`` is the full dotted name, ``allowed`` the bare names of the table ``where``;
    ``note`` ends the parenthesis (where to read more)."""
    allowed = sorted(allowed)
    prefix, _, bare = key.rpartition(".")
    found = closest(bare, allowed)
    hint = f"; did you mean {prefix + '.' if prefix else ''}{found[0]}?" if found else ""
    return f"unknown key {key}{hint} (allowed in {where}: {', '.join(allowed)}{'; ' + note if note else ''})"
