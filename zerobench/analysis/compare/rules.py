"""What a metric may do before ``zerobench compare`` calls it a regression: the rules.

A :class:`Rule` is parsed from ``NAME:+TOL[%][,k=K]`` (``--fail-on``); every metric
without one gets :func:`default_rule`, chosen by the metric's kind in
:mod:`zerobench.schema.columns`. See [Note: compare rules] in compare.py.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Sequence

from zerobench.choices import did_you_mean
from zerobench.schema.columns import METRIC_BY_NAME, METRICS

DEFAULT_TIME_REL = 0.10
DEFAULT_TIME_K = 3.0
DEFAULT_DET_REL = 1e-6
DEFAULT_LOSS_ABS = 1e-6
#: A what-if figure may move by this fraction of the baseline: none on unchanged code (its
#: figures are identical), and a changed program that only reorders sums moves times by
#: ~1e-13 of themselves (floating-point rounding), which is no regression. The smallest
#: real effect seen (a cast kernel more per all-gather) is ~1e-3. See [Note: comparing
#: what-if folders] in whatif.py.
WHATIF_REL = 1e-9
#: Which default rules gate (``--gate``): here, with no pandas, so ``--help`` lists them cheaply.
GATES: tuple[str, ...] = ("all", "deterministic", "none")


#: What made a folder: a run (``zerobench run``), or a what-if tool whose every figure is
#: deterministic ([Note: comparing what-if folders] in whatif.py).
TOOLS = ("run", "predict", "estimate")


def metric_info(name: str, tool: str = "run") -> tuple[str, str, str]:
    """(kind, better, unit) of a metric column in a folder made by ``tool``; extra engine
    metrics are context. In a predict or estimate folder every metric but the wall time
    of the tool itself is deterministic ([Note: comparing what-if folders])."""
    m = METRIC_BY_NAME.get(name)
    if m is None:
        return "context", "lower", "s" if name.endswith("_s") else ""
    if tool != "run":
        if name.endswith("_wall_s"):
            return "context", "none", m.unit
        return "deterministic", m.better if m.better != "none" else "lower", m.unit
    return m.kind, m.better, m.unit


def is_timelike(name: str, tool: str = "run") -> bool:
    """Time metrics and other metrics in seconds of a run: the ones a spread (MAD) applies to."""
    kind, _, unit = metric_info(name, tool)
    return tool == "run" and (kind == "time" or unit == "s")


_RULE_RE = re.compile(r"^\s*(?P<name>[A-Za-z0-9_*?\[\]]+)\s*:\s*\+?(?P<value>[0-9.eE+-]+)\s*(?P<pct>%)?"
                      r"\s*(?:,\s*k\s*=\s*(?P<k>[0-9.eE+-]+))?\s*$")


@dataclass(frozen=True)
class Rule:
    """How much worse a metric may get before it is a regression.

    Parsed from ``NAME:+TOL[%][,k=K]``: ``peak_mem:+2%``, ``comm_total_bytes:+0``,
    ``loss_last:+1e-6`` (absolute, in the metric's unit), ``step_time:+15%,k=3``. NAME is
    a metric column, a prefix naming one (``peak_mem`` -> peak_mem_bytes, ``step_time``
    -> step_time_s), or a glob naming several (``comm_*``).
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
    ceiling: float | None = None
    """When set, the metric is judged against this absolute value, not against the
    baseline: a new value above it is a regression (see [Note: losses across machines])."""
    gates: bool = True
    """False for a metric that is shown but can never fail the comparison."""

    @classmethod
    def parse(cls, text: str, metrics: Sequence[str] | None = None, tool: str = "run") -> "Rule":
        """Parse one rule; ``metrics`` are the allowed names (default: the schema's), in a
        folder made by ``tool`` (a what-if folder has no spread: no ``k``)."""
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
            not_time = [n for n in names if not is_timelike(n, tool)]
            if not_time:
                raise ValueError(f"rule {text!r}: k= applies to time metrics only (of runs: a prediction has no "
                                 f"spread), not {', '.join(not_time)}")
        elif any(metric_info(n, tool)[0] == "time" for n in names):
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
    raise ValueError(f"{where}unknown metric {name!r}{did_you_mean(name, allowed, show=str)} "
                     f"(allowed: {', '.join(allowed)})")


def parse_rules(texts: Sequence[str], metrics: Sequence[str] | None = None, tool: str = "run") -> list[Rule]:
    return [Rule.parse(t, metrics, tool) for t in texts]


def default_rule(name: str, dtype: str = "fp32", cross_machine: bool = False,
                 loss_scale: float = 1.0, tool: str = "run") -> Rule:
    """The rule a metric gets when no ``--fail-on`` names it. See [Note: compare rules]
    and, for losses, [Note: losses across machines]; a what-if folder's figures gate
    exactly ([Note: comparing what-if folders])."""
    kind, better, _ = metric_info(name, tool)
    if tool != "run" and kind == "deterministic":
        return Rule((name,), rel=WHATIF_REL, text="default exact (1e-9)")
    if name in LOSS_METRICS and (dtype in LOW_PRECISION or cross_machine):
        return loss_rule(name, dtype, loss_scale)
    if kind == "time":
        return Rule((name,), rel=DEFAULT_TIME_REL, k=DEFAULT_TIME_K, text="default +10%,k=3")
    if better == "none" and name.startswith("loss"):
        return Rule((name,), abs=DEFAULT_LOSS_ABS, text="default ±1e-6")
    return Rule((name,), rel=DEFAULT_DET_REL, text="default +1e-6 rel")


# [Note: losses across machines]
# Losses are deterministic on one machine, but not across machines: CPU kernels pick
# their instructions by the processor's features (avx2, avx512, avx512_bf16, amx), and
# a bf16 matmul rounds differently with each. Two 2-core "AMD EPYC" machines gave bf16
# losses 3e-5 apart after 15 steps, while fp32 losses stayed equal. So:
#
# * fp32 cells compared on the same hardware (meta.json's cpu_model, cpu_flags and
#   gpu_model equal) keep the exact rule: the loss must not move (1e-6).
# * bf16 / fp16 cells always, and fp32 cells across machines (or when either run does
#   not record its hardware), do not compare losses with the baseline's. loss_first and
#   loss_last are reported only; what gates is loss_max_abs_diff_ref -- the distance to
#   the *same run's* single-process fp32 reference -- against an absolute ceiling
#   derived from the dtype's precision: LOSS_BOUND_ULPS[dtype] units of roundoff of the
#   loss's magnitude. For bf16 that is 2^-8 * |loss| (3.9e-3 for a loss near 1), an
#   order of magnitude above the 2e-4 an unchanged engine shows, and far below what a
#   wrong reduction or a lost gradient gives. For fp32, 2^10 roundoffs (6e-5 * |loss|)
#   cover the rounding that Adam amplifies over a few steps (docs/zero.md).

#: Unit roundoff (half the machine epsilon) of each training dtype.
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
#: Deviation from the single-process reference allowed, in roundoffs of |loss|.
LOSS_BOUND_ULPS = {"fp32": 2.0 ** 10, "bf16": 1.0, "fp16": 2.0 ** 3}
LOW_PRECISION = ("bf16", "fp16")
LOSS_METRICS = ("loss_first", "loss_last", "loss_max_abs_diff_ref")


def loss_bound(dtype: str, loss_scale: float) -> float:
    """Largest acceptable |loss - reference| for a cell trained in ``dtype``."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype {dtype!r} has no loss bound (allowed: {', '.join(UNIT_ROUNDOFF)})")
    return LOSS_BOUND_ULPS[dtype] * UNIT_ROUNDOFF[dtype] * max(abs(loss_scale), 1.0)


def loss_rule(name: str, dtype: str, loss_scale: float) -> Rule:
    """The cross-machine rule of a loss metric. See [Note: losses across machines]."""
    dtype = dtype if dtype in UNIT_ROUNDOFF else "fp32"
    if name == "loss_max_abs_diff_ref":
        bound = loss_bound(dtype, loss_scale)
        return Rule((name,), ceiling=bound, text=f"{dtype}: <= {bound:.3g} from the reference")
    return Rule((name,), gates=False, text=f"{dtype}: reported, machine-dependent")
