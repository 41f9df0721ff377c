"""What a metric may do before ``zerobench compare`` calls it a regression: the rules.

A :class:`Rule` is parsed from ``NAME:+TOL[%][,k=K]`` (``--fail-on``); every metric
without one gets :func:`default_rule`, chosen by the metric's kind in
:mod:`zerobench.schema`. See [Note: compare rules] in compare.py.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Sequence

from zerobench.schema import METRIC_BY_NAME, METRICS

DEFAULT_TIME_REL = 0.10
DEFAULT_TIME_K = 3.0
DEFAULT_DET_REL = 1e-6
DEFAULT_LOSS_ABS = 1e-6


def metric_info(name: str) -> tuple[str, str, str]:
    """(kind, better, unit) of a metric column; extra engine metrics are context."""
    m = METRIC_BY_NAME.get(name)
    if m is not None:
        return m.kind, m.better, m.unit
    return "context", "lower", "s" if name.endswith("_s") else ""


def is_timelike(name: str) -> bool:
    """Time metrics and other metrics in seconds: the ones a spread (MAD) applies to."""
    kind, _, unit = metric_info(name)
    return kind == "time" or unit == "s"


_RULE_RE = re.compile(r"^\s*(?P<name>[A-Za-z0-9_*?\[\]]+)\s*:\s*\+?(?P<value>[0-9.eE+-]+)\s*(?P<pct>%)?"
                      r"\s*(?:,\s*k\s*=\s*(?P<k>[0-9.eE+-]+))?\s*$")


@dataclass(frozen=True)
class Rule:
    """How much worse a metric may get before it is a regression.

    Parsed from ``NAME:+TOL[%][,k=K]``: ``peak_mem:+2%``, ``comm_total_bytes:+0``,
    ``loss_last:+1e-6`` (absolute, in the metric's unit), ``step_time:+15%,k=3``. NAME is
    a metric column, a prefix naming one (``peak_mem`` -> peak_mem_bytes, ``step_time``
    -> step_time_median_s), or a glob naming several (``comm_*``).
    """

    metrics: tuple[str, ...]
    """The metric columns this rule applies to."""
    rel: float = 0.0
    """Allowed worsening as a fraction of the baseline (0.02 for +2%)."""
    abs: float = 0.0
    """Allowed worsening in the metric's unit."""
    k: float | None = None
    """Time metrics: also require a worsening beyond k x the baseline's spread (MAD)."""
    text: str = ""
    """The rule as written, for reports."""

    @classmethod
    def parse(cls, text: str, metrics: Sequence[str] | None = None) -> "Rule":
        """Parse one rule; ``metrics`` are the allowed names (default: the schema's)."""
        allowed = list(metrics) if metrics is not None else [m.name for m in METRICS]
        m = _RULE_RE.match(text)
        if m is None:
            raise ValueError(f"rule {text!r}: expected NAME:+TOL[%][,k=K], e.g. 'peak_mem:+2%', "
                             f"'comm_total_bytes:+0', 'step_time:+15%,k=3'")
        try:
            value = float(m["value"])
            k = float(m["k"]) if m["k"] is not None else None
        except ValueError:
            raise ValueError(f"rule {text!r}: tolerance {m['value']!r} or k is not a number") from None
        if not math.isfinite(value) or value < 0 or (k is not None and (not math.isfinite(k) or k < 0)):
            raise ValueError(f"rule {text!r}: tolerance and k must be finite and >= 0 (a rule allows a worsening)")
        names = resolve_metric(m["name"], allowed, rule=text)
        if k is not None:
            not_time = [n for n in names if not is_timelike(n)]
            if not_time:
                raise ValueError(f"rule {text!r}: k= applies to time metrics only, not {', '.join(not_time)}")
        elif any(metric_info(n)[0] == "time" for n in names):
            k = DEFAULT_TIME_K  # time stays spread-aware unless the rule says k=0
        rel, abs_ = (value / 100, 0.0) if m["pct"] else (0.0, value)
        shown = text.strip() + (f" (k={k:g})" if k is not None and m["k"] is None else "")
        return cls(tuple(names), rel, abs_, k, shown)

    def allowed(self, baseline: float, spread: float = float("nan")) -> float:
        """The allowed worsening, in the metric's unit, for this baseline value and spread."""
        tol = max(self.rel * abs(baseline), self.abs)
        if self.k is not None and not math.isnan(spread):
            tol = max(tol, self.k * spread)
        return tol


def resolve_metric(name: str, allowed: Sequence[str], rule: str = "") -> list[str]:
    """Metric columns that NAME means: exact, glob, canonical unit suffix, unique prefix."""
    where = f"rule {rule!r}: " if rule else ""
    if name in allowed:
        return [name]
    if any(ch in name for ch in "*?["):
        hits = fnmatch.filter(allowed, name)
        if hits:
            return hits
    else:
        for suffix in ("_bytes", "_median_s", "_s"):
            if name + suffix in allowed:
                return [name + suffix]
        hits = [a for a in allowed if a.startswith(name)]
        if len(hits) == 1:
            return hits
        if hits:
            raise ValueError(f"{where}{name!r} is ambiguous: it matches {', '.join(hits)}; "
                             f"use a full name or a glob such as '{name}*'")
    raise ValueError(f"{where}unknown metric {name!r} (allowed: {', '.join(allowed)})")


def parse_rules(texts: Sequence[str], metrics: Sequence[str] | None = None) -> list[Rule]:
    return [Rule.parse(t, metrics) for t in texts]


def default_rule(name: str) -> Rule:
    """The rule a metric gets when no ``--fail-on`` names it. See [Note: compare rules]."""
    kind, better, _ = metric_info(name)
    if kind == "time":
        return Rule((name,), rel=DEFAULT_TIME_REL, k=DEFAULT_TIME_K, text="default +10%,k=3")
    if better == "none" and name.startswith("loss"):
        return Rule((name,), abs=DEFAULT_LOSS_ABS, text="default ±1e-6")
    return Rule((name,), rel=DEFAULT_DET_REL, text="default +1e-6 rel")
