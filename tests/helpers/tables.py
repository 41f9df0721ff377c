"""Reading a printed table back (tests/test_render.py, tests/test_show.py): is every name
whole, wrapped only after one of its parts, and every line within the width?"""

from __future__ import annotations

import re


def _lead(line: str) -> str:
    """The first field of a line: columns are two spaces or more apart."""
    return re.split(r"\s{2,}", line.strip())[0] if line.strip() else ""


def legend(out: str) -> dict[str, str]:
    """key -> abbreviation, from the "abbreviated: ss = sharding_strategy, ..." lines."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("abbreviated: ")), None)
    if start is None:
        return {}
    words = " ".join(lines[start:start + 4])
    return {key: short for short, key in re.findall(r"(\w+) = (\w+)", words)}


def abbreviated(name: str, keys: dict[str, str]) -> str:
    return re.sub(r"(?<![\w=])(\w+)=", lambda m: f"{keys.get(m[1], m[1])}=", name)


def whole(out: str, name: str, breaks: str = "-") -> bool:
    """Whether ``name`` (abbreviated as the legend says) stands in ``out`` as the first
    field of one line, or of consecutive lines each ending after one of ``breaks``."""
    target = abbreviated(name, legend(out))
    leads = [_lead(line) for line in out.splitlines()]
    for i in range(len(leads)):
        joined = ""
        for k in range(i, min(i + 8, len(leads))):
            joined += leads[k]
            if joined == target:
                return True
            if not target.startswith(joined) or not joined.endswith(tuple(breaks)):
                break
    return False


def check_reads(out: str, width: int, names: list[str], headers: list[str], soft: tuple[str, ...] = ()) -> None:
    """Every line within ``width`` (but lines starting with ``soft``: commands printed
    whole for copying), every name whole, every header word whole on a line of its own
    header block."""
    for line in out.splitlines():
        assert len(line) <= width or line.startswith(soft), f"{len(line)} > {width}: {line!r}"
    for name in names:
        assert whole(out, name), f"{name!r} is not whole at {width} columns:\n{out}"
    words = set(re.findall(r"\S+", out))
    for header in headers:
        for word in header.split():
            assert word in words, f"header word {word!r} broken at {width} columns:\n{out}"
