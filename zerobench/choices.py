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
    lower-case text; none when nothing is close or ``value`` is itself allowed.

    Values that start with what was given come first, in their order ("FULL" finds
    FULL_SHARD; "h100" finds every h100-* part, as many as ``n`` lets through)."""
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
    if starting:
        return [by_text[t] for t in starting[:n]]
    return [by_text[t] for t in difflib.get_close_matches(text, list(by_text), n=n, cutoff=CUTOFF)]


def did_you_mean(value: Any, allowed: Iterable[Any], show=repr) -> str:
    """"; did you mean 'x'?" for the closest allowed value, or "" when none is close.

    When what was given starts several allowed values (``h100`` for ``h100-nvl``,
    ``h100-sxm``, ...), none is likelier than another, so they are named, the shortest
    first: "; did you mean one of 'h100-nvl', 'h100-sxm', ...?"; unless the shortest is
    what was given less its last character or two (``quickstar``: quickstart)."""
    allowed = list(allowed)
    text = str(value).lower()
    starting = sorted((a for a in allowed if len(text) >= 2 and str(a).lower().startswith(text)
                       and str(a).lower() != text), key=lambda a: len(str(a)))
    if len(starting) > 1 and not _one_typed_short(text, starting):
        shown = ", ".join(show(a) for a in starting[:MANY])
        return f"; did you mean one of {shown}{', ...' if len(starting) > MANY else ''}?"
    found = starting[:1] or closest(value, allowed)
    return f"; did you mean {show(found[0])}?" if found else ""


#: How many of the values that start with what was given a suggestion names at most.
MANY = 4


def _one_typed_short(text: str, starting: list) -> bool:
    """Whether the shortest of ``starting`` is what was given with its last one or two
    characters left off, and no other is as short: then it is the one meant."""
    lengths = [len(str(a)) for a in starting]
    return lengths[0] - len(text) <= 2 and lengths.count(lengths[0]) == 1


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
