"""Communication / computation overlap, as Holistic Trace Analysis defines it.

HTA (``TraceAnalysis.get_comm_comp_overlap``, docs "Communication Computation
Overlap"): the overlap of a rank is the time it spends computing *while*
communicating, divided by the time it spends communicating, each side first merged
into disjoint intervals::

    overlap_ratio  = |merge(comm) ∩ merge(compute)| / |merge(comm)|
    exposed_comm   = |merge(comm) \\ merge(compute)|        (communication nothing hides)

and a step (``zerobench::step`` span) breaks down into ``compute`` + ``exposed_comm``
+ ``idle`` (neither: framework and Python overhead, waiting on the host, gaps).

What counts as what (see docs/profiling.md for the caveats):

* communication -- on GPU, NCCL kernels. On CPU, gloo's worker-thread events
  (``gloo:*``, their own thread ids), falling back to the main thread's ``c10d::*``
  spans where there are none; plus the main thread's ``impl::wait_*`` spans and the
  emulation's ``zerobench::wait_*`` spans, where the rank is blocked on a collective
  (with interconnect emulation on, that is where the emulated wire time is slept), and,
  given the emulated link, each collective's modelled interval on it: served one at a
  time in issue order, ``[max(issue, previous end), start + duration]``
  (zerobench/instruments/link.py, [Note: link model]; one link per group size, since traces do not
  name the process group).
* computation -- on GPU, kernels that are neither communication nor memcpy/memset. On
  CPU, ``aten::*`` ops on the main thread, except those inside ``c10d::*`` ops and
  inside wait or rate-limiter spans (``LIMITER_LABELS``).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import intervals as iv
from .collective_table import collectives
from .trace import PHASE_LABELS, STEP_LABEL, Trace

WAIT_PREFIX = "impl::wait_"
#: Spans where the rank waits on a collective: impl's, and the emulation's (every engine).
WAIT_PREFIXES = (WAIT_PREFIX, "zerobench::wait_")
# Where a rate limiter blocks: impl's, and FSDP1's ``limit_all_gathers``.
LIMITER_LABELS = ("impl::rate_limiter_wait", "FullyShardedDataParallel.rate_limiter")


def _spans(df: pd.DataFrame) -> np.ndarray:
    return df[["ts", "end"]].to_numpy(dtype=float).reshape(-1, 2)


def is_gpu_trace(trace: Trace) -> bool:
    return bool((trace.events["cat"] == "kernel").any())


def comm_intervals(trace: Trace, emulation=None) -> np.ndarray:
    """Merged communication intervals of the rank (microseconds).

    ``emulation``: the ``zerobench.instruments.link.Link`` emulated when the trace was taken."""
    ev = trace.events
    if is_gpu_trace(trace):
        comm = ev[(ev["cat"] == "kernel") & ev["name"].str.contains("nccl", case=False)]
    else:
        comm = ev[ev["name"].str.startswith("gloo:") & (ev["tid"] != trace.main_tid)]
        if len(comm) == 0:
            comm = trace.named("c10d::", main_only=True)
    parts = [_spans(comm), *(_spans(trace.named(p, main_only=True)) for p in WAIT_PREFIXES)]
    if emulation is not None:
        m = modelled_intervals(trace, emulation)
        parts.append(m[["start_s", "end_s"]].to_numpy(dtype=float).reshape(-1, 2) * 1e6)
    return iv.merge(np.concatenate(parts))


def modelled_intervals(trace: Trace, link) -> pd.DataFrame:
    """Each issued collective's interval on the emulated ``link`` (a zerobench.instruments.link.Link),
    served one at a time in issue order, one link per group size. Columns: kind, bytes,
    group_size, issue_s, start_s, end_s (seconds, the trace's clock)."""
    from zerobench.instruments.link import KINDS, SerialLink

    coll = collectives(trace)
    coll = coll[coll["issue_s"].notna()].sort_values("issue_s")
    links: dict[int, SerialLink] = {}
    rows = []
    for k, b, n, t in zip(coll["kind"], coll["bytes"], coll["group_size"], coll["issue_s"]):
        nbytes = int(b) if np.isfinite(b) else 0
        start, end = links.setdefault(int(n), SerialLink(link)).reserve(t, k if k in KINDS else "other", nbytes, int(n))
        rows.append((k, nbytes, int(n), t, start, end))
    return pd.DataFrame(rows, columns=["kind", "bytes", "group_size", "issue_s", "start_s", "end_s"])


def compute_intervals(trace: Trace) -> np.ndarray:
    """Merged computation intervals of the rank (microseconds)."""
    ev = trace.events
    if is_gpu_trace(trace):
        k = ev[ev["cat"] == "kernel"]
        name = k["name"].str
        k = k[~name.contains("nccl", case=False) & ~name.contains("memcpy|memset", case=False)]
        return iv.merge(_spans(k))
    main = trace.main
    ops = main[(main["cat"] == "cpu_op") & main["name"].str.startswith("aten::")]
    excluded = main[main["name"].str.startswith(("c10d::", *WAIT_PREFIXES, *LIMITER_LABELS))]
    return iv.subtract(_spans(ops), _spans(excluded))


def step_windows(trace: Trace) -> pd.DataFrame:
    """The steps of the trace: ``zerobench::step`` spans; else one step per
    ``zerobench::forward`` up to the end of the phases before the next forward; else
    the whole main thread as one step. Columns: step, ts, end (microseconds)."""
    main = trace.main
    steps = main[main["name"] == STEP_LABEL]
    if len(steps):
        w = steps[["ts", "end"]]
    else:
        phases = main[main["name"].isin(PHASE_LABELS)].sort_values("ts")
        if len(phases):
            group = (phases["name"] == PHASE_LABELS[0]).cumsum()
            w = phases.groupby(group).agg(ts=("ts", "min"), end=("end", "max"))
        else:
            w = pd.DataFrame({"ts": [main["ts"].min()], "end": [main["end"].max()]})
    w = w.sort_values("ts").reset_index(drop=True)
    w.insert(0, "step", range(len(w)))
    return w


def _has_impl_labels(trace: Trace) -> bool:
    return bool(trace.named("impl::", main_only=True).shape[0])


def step_breakdown(trace: Trace, emulation=None) -> pd.DataFrame:
    """One row per step: step_time_s, compute_s, comm_s, overlapped_s, exposed_comm_s,
    idle_s (= step - compute - exposed comm), overlap_ratio, limiter_wait_s (time in
    ``impl::rate_limiter_wait`` or FSDP1's ``FullyShardedDataParallel.rate_limiter``)
    and collective_wait_s (time in ``impl::wait_*``); NaN for engines that write no
    such labels."""
    comm = comm_intervals(trace, emulation)
    comp = compute_intervals(trace)
    overlapped = iv.intersect(comm, comp)
    exposed = iv.subtract(comm, comp)
    labelled = _has_impl_labels(trace)
    waits = iv.merge(_spans(trace.named(WAIT_PREFIX, main_only=True)))
    limiter_spans = trace.main[trace.main["name"].isin(LIMITER_LABELS)]
    limiter = iv.merge(_spans(limiter_spans))
    has_limiter = labelled or len(limiter_spans) > 0
    rows = []
    for w in step_windows(trace).itertuples():
        clipped = lambda a: iv.total(iv.clip(a, w.ts, w.end)) * 1e-6  # noqa: E731
        step_time_s = (w.end - w.ts) * 1e-6
        comm_s, comp_s, ov_s, exp_s = clipped(comm), clipped(comp), clipped(overlapped), clipped(exposed)
        rows.append({
            "rank": trace.rank,
            "step": w.step,
            "start_s": w.ts * 1e-6,
            "step_time_s": step_time_s,
            "compute_s": comp_s,
            "comm_s": comm_s,
            "overlapped_s": ov_s,
            "exposed_comm_s": exp_s,
            "idle_s": max(step_time_s - comp_s - exp_s, 0.0),
            "overlap_ratio": ov_s / comm_s if comm_s > 0 else math.nan,
            "limiter_wait_s": clipped(limiter) if has_limiter else math.nan,
            "collective_wait_s": clipped(waits) if labelled else math.nan,
        })
    return pd.DataFrame(rows)


def comm_comp_overlap(trace: Trace, emulation=None) -> pd.DataFrame:
    """HTA's table: one row for this rank, with the overlap over all its steps
    (overlapped time / communication time, summed over steps)."""
    b = step_breakdown(trace, emulation)
    comm, ov = b["comm_s"].sum(), b["overlapped_s"].sum()
    return pd.DataFrame([{
        "rank": trace.rank,
        "comm_s": comm,
        "overlapped_s": ov,
        "exposed_comm_s": b["exposed_comm_s"].sum(),
        "overlap_ratio": ov / comm if comm > 0 else math.nan,
    }])


def overlap_summary(trace: Trace, emulation=None) -> dict:
    """The per-rank columns for the results table: overlap_ratio over all steps, and
    the per-step means of exposed_comm_s, comm_s, compute_s, idle_s, step_trace_s,
    limiter_wait_s and collective_wait_s; trace_steps."""
    b = step_breakdown(trace, emulation)
    comm, ov = b["comm_s"].sum(), b["overlapped_s"].sum()
    out = {
        "trace_steps": len(b),
        "overlap_ratio": ov / comm if comm > 0 else math.nan,
        "step_trace_s": b["step_time_s"].mean(),
    }
    for c in ("exposed_comm_s", "comm_s", "compute_s", "idle_s", "limiter_wait_s", "collective_wait_s"):
        out[c] = b[c].mean()
    return out
