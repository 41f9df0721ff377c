"""The best achievable exposed all-gather time of a schedule, under an emulated link.

[Note: best achievable exposed comm]
Prefetching hides an all-gather behind the compute that runs before its result is
needed. With one all-gather prefetched ahead (what backward/forward prefetch do), the
most compute that can hide all-gather ``i`` is the compute between the use of
all-gather ``i-1`` and the use of all-gather ``i``: the previous unit's compute. So
the part of all-gather ``i`` that *no* such prefetch could hide is

    best_exposed_i = max(0, d_i - C_i)

where ``d_i`` is its modelled duration on the emulated link (zerobench/instruments/link.py) and
``C_i`` the rank's compute time (overlap.compute_intervals) between the end of the
wait for all-gather ``i-1`` (the step's start for the first) and the start of the
wait for all-gather ``i``. A *use* is the start of the wait span: the emulation's
``zerobench::wait_all_gather`` (every engine), else impl's ``impl::wait_all_gather``.
All-gathers are paired with waits in order within a step.

The measured counterpart is ``exposed_all_gather_s``: the time the rank spent in those
wait spans. ``best_exposed_all_gather_s`` is a lower bound for one-ahead prefetch: it
ignores the link time the reduce-scatters of backward take from the all-gathers (they
share the link) and the compute a deeper prefetch could borrow from earlier units,
and it uses the compute measured in this run (compute slowed by a busy core counts).
"""

from __future__ import annotations

import math

import pandas as pd

from zerobench.instruments.link import link_from_config  # noqa: F401  (re-exported: callers of best)

from . import intervals as iv
from .overlap import compute_intervals, modelled_intervals, step_windows
from .trace import Trace

WAIT_LABELS = ("zerobench::wait_all_gather", "impl::wait_all_gather")


def _all_gather_waits(trace: Trace) -> pd.DataFrame:
    for label in WAIT_LABELS:
        spans = trace.main[trace.main["name"] == label]
        if len(spans):
            return spans.sort_values("ts")
    return trace.main.iloc[0:0]


def best_exposed_by_step(trace: Trace, link) -> pd.DataFrame:
    """Per step: all_gathers, exposed_all_gather_s (measured), best_exposed_all_gather_s.
    See [Note: best achievable exposed comm]."""
    comp = compute_intervals(trace)
    waits = _all_gather_waits(trace)
    gathers = modelled_intervals(trace, link)
    gathers = gathers[gathers["kind"] == "all_gather"]
    rows = []
    for w in step_windows(trace).itertuples():
        ws = waits[(waits["ts"] >= w.ts) & (waits["ts"] <= w.end)]
        issued = gathers[(gathers["issue_s"] * 1e6 >= w.ts) & (gathers["issue_s"] * 1e6 <= w.end)]
        # The first gather of a step may be a prefetch issued in the previous one: pair
        # the last len(ws) gathers issued up to this step's end with the waits.
        upto = gathers[gathers["issue_s"] * 1e6 <= w.end]
        n = min(len(ws), len(upto))
        durations = [link.duration_s("all_gather", b, g) for b, g in zip(upto["bytes"], upto["group_size"])][-n:] if n else []
        best, prev_end = 0.0, w.ts
        for d, span in zip(durations, ws.iloc[len(ws) - n:].itertuples()):
            hidden = iv.total(iv.clip(comp, prev_end, span.ts)) * 1e-6
            best += max(0.0, d - hidden)
            prev_end = span.end
        exposed = iv.total(iv.clip(iv.merge(ws[["ts", "end"]].to_numpy(dtype=float).reshape(-1, 2)), w.ts, w.end)) * 1e-6
        rows.append({"step": w.step, "all_gathers": len(issued), "exposed_all_gather_s": exposed,
                     "best_exposed_all_gather_s": best})
    return pd.DataFrame(rows)


def best_exposed_summary(trace: Trace, link) -> dict:
    """Per-step means of exposed_all_gather_s and best_exposed_all_gather_s, and their
    ratio (measured / best; 1 is the best this schedule's compute allows)."""
    b = best_exposed_by_step(trace, link)
    if len(b) == 0:
        return {"exposed_all_gather_s": math.nan, "best_exposed_all_gather_s": math.nan}
    exposed, best = b["exposed_all_gather_s"].mean(), b["best_exposed_all_gather_s"].mean()
    return {"exposed_all_gather_s": exposed, "best_exposed_all_gather_s": best,
            "exposed_vs_best": exposed / best if best > 0 else math.nan}
