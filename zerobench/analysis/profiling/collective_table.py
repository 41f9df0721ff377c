"""Per-collective table: kind, bytes, duration, algorithm and bus bandwidth.

Each collective is seen twice in a trace:

* where it is *issued*, on the rank's main thread: a ``c10d::*`` op (``record_shapes``
  gives its tensors' dims and dtypes), inside the ``impl::<kind>`` label when an impl
  engine issued it. torch 2.13 writes no ``record_param_comms`` events for gloo; on
  GPU, where they exist, their "In/Out msg nelems", "dtype" and "Group size" are used;
* where it *runs*: a ``gloo:*`` event on one of gloo's worker threads on CPU (gloo runs
  reduce-scatter as ``gloo:all_reduce``), an NCCL kernel on GPU.

The two are paired in issue order: each issued op takes the first unpaired run event
of a compatible kind that starts after it (gloo and NCCL run the work of one process
group in the order it was issued).

Sizes and bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): ``bytes`` is the
size of the whole buffer -- the gathered output for all-gather, the full input for
reduce-scatter, the buffer for all-reduce and broadcast; ``algbw = bytes / time``;
``busbw = algbw * (n-1)/n`` for all-gather and reduce-scatter, ``algbw * 2(n-1)/n``
for all-reduce, ``= algbw`` for broadcast. Bandwidths are in GB/s (10^9 B/s).

On CPU the run interval of a gloo collective starts when a worker thread picks it up
and ends when the peers have all taken part, so it includes waiting for the slowest
peer: bandwidths from gloo traces are lower bounds, not link measurements.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from zerobench.instruments.link import KINDS, bus_factor  # noqa: F401 (the one vocabulary; re-exported)

from .trace import Trace

_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2,
    "int": 4, "long int": 8, "long": 8, "short int": 2, "short": 2, "signed char": 1,
    "unsigned char": 1, "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
    "float32": 4, "float64": 8, "float16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1,
}


def dtype_bytes(name) -> float:
    """Bytes per element of a dtype as the profiler spells it (``float``, ``c10::BFloat16``,
    ``Float``...); NaN when unknown (``TensorList``)."""
    if not isinstance(name, str):
        return math.nan
    return float(_DTYPE_BYTES.get(name.strip().lower(), math.nan))


def kind_of(name: str) -> str:
    """Collective kind from an op, label, gloo event or NCCL kernel name."""
    n = name.lower().replace("_", "")
    if "reducescatter" in n:
        return "reduce_scatter"
    if "allgather" in n:
        return "all_gather"
    if "allreduce" in n:
        return "all_reduce"
    if "broadcast" in n:
        return "broadcast"
    return "other"


def algbw_gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def busbw_gbps(kind: str, nbytes: float, seconds: float, n: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(kind, n)


def _numel(dims) -> int:
    return int(np.prod(dims)) if len(dims) else 1


def _tensor_bytes(dims, type_name, fallback_elem=math.nan) -> float:
    """Bytes of one op argument: a tensor (``[d0, d1]``) or a tensor list (``[[..], [..]]``)."""
    if not isinstance(dims, list) or len(dims) == 0:
        return 0.0
    elem = dtype_bytes(type_name)
    if math.isnan(elem):
        elem = fallback_elem
    if isinstance(dims[0], list):  # TensorList
        return sum(_numel(d) for d in dims) * elem
    return _numel(dims) * elem


def _op_bytes(args: dict, fallback_elem=math.nan, kind: str = "other", n: int = 1) -> float:
    """nccl-tests size of a c10d op: its largest tensor argument (the gathered output,
    the full reduce-scatter input, the all-reduced buffer). For all-gather and
    reduce-scatter, also ``n`` times the smallest one: the list-based ops
    (``c10d::allgather_``, which gloo and FSDP1 use) record their list-of-lists side
    without dims, leaving only the per-rank tensor."""
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    sizes = [_tensor_bytes(d, types[i] if i < len(types) else None, fallback_elem) for i, d in enumerate(dims)]
    sizes = [s for s in sizes if s == s and s > 0]  # drop NaN and non-tensors
    if not sizes:
        return math.nan
    if kind in ("all_gather", "reduce_scatter"):
        return max(max(sizes), n * min(sizes))
    return max(sizes)


def _run_events(trace: Trace) -> pd.DataFrame:
    """Where collectives run: NCCL kernels on GPU, else gloo worker-thread events."""
    ev = trace.events
    nccl = ev[(ev["cat"] == "kernel") & ev["name"].str.contains("nccl", case=False)]
    if len(nccl):
        return nccl
    return ev[ev["name"].str.startswith("gloo:") & (ev["tid"] != trace.main_tid)]


def issue_events(trace: Trace) -> pd.DataFrame:
    """``c10d::*`` collective ops on the main thread (barriers excluded)."""
    main = trace.main
    ops = main[main["name"].str.startswith("c10d::") & ~main["name"].str.contains("barrier")]
    return ops


def _enclosing(spans: pd.DataFrame, ts: float, end: float):
    """The innermost row of ``spans`` containing ``[ts, end]``, or None."""
    inside = spans[(spans["ts"] <= ts) & (spans["end"] >= end)]
    return None if len(inside) == 0 else inside.iloc[-1]


def collectives(trace: Trace, group_size: int | None = None) -> pd.DataFrame:
    """One row per collective instance on this rank.

    Columns: rank, kind, op (the c10d op, or the run event's name when no issue op is
    in the trace), issue_s (when the main thread issued it: the start of its
    ``impl::<kind>`` label, else of the c10d op), start_s / end_s /
    duration_s (when it ran: gloo worker or NCCL kernel; the issue op's own span when
    nothing ran elsewhere), bytes, group_size, algbw_gbps, busbw_gbps.
    Times are seconds from the start of the trace."""
    n_default = group_size or trace.world_size or 1
    runs = _run_events(trace).sort_values("ts")
    run_taken = np.zeros(len(runs), dtype=bool)
    run_kind = [kind_of(nm) for nm in runs["name"]]
    issues = issue_events(trace).sort_values("ts")
    main = trace.main
    labels = main[main["name"].str.match(r"impl::(all_gather|reduce_scatter|all_reduce|broadcast)$")]
    params = trace.events[trace.events["name"] == "record_param_comms"]

    rows = []
    for op in issues.itertuples():
        label = _enclosing(labels, op.ts, op.end) if len(labels) else None
        kind = kind_of(label["name"]) if label is not None else kind_of(op.name)
        n = n_default
        nbytes = math.nan
        pc = _enclosing_child(params, op.ts, op.end)
        if pc is not None:
            a = pc["args"]
            elem = dtype_bytes(a.get("dtype"))
            nelems = max(a.get("In msg nelems", 0) or 0, a.get("Out msg nelems", 0) or 0)
            nbytes = nelems * elem
            n = a.get("Group size") or n
        # Pair with the first unpaired compatible run event that starts after the issue.
        run = None
        for j in np.flatnonzero(~run_taken):
            rk = run_kind[j]
            if runs["ts"].iloc[j] + 1e-3 < op.ts:
                continue
            if rk == kind or (rk == "all_reduce" and kind == "reduce_scatter"):
                run_taken[j] = True
                run = runs.iloc[j]
                break
        if nbytes != nbytes:
            fallback = math.nan
            if run is not None:
                rtypes = run["args"].get("Input type") or []
                fallback = dtype_bytes(rtypes[0]) if rtypes else math.nan
            nbytes = _op_bytes(op.args, fallback, kind, n)
        start, end = (run["ts"], run["end"]) if run is not None else (op.ts, op.end)
        issue = label["ts"] if label is not None else op.ts
        rows.append((trace.rank, kind, op.name, issue, start, end, nbytes, n))

    # Run events with no issue op in the trace (e.g. issued before profiling started).
    for j in np.flatnonzero(~run_taken):
        run = runs.iloc[j]
        kind = run_kind[j]
        dims = run["args"].get("Input Dims") or []
        types = run["args"].get("Input type") or []
        nbytes = _tensor_bytes(dims[0], types[0] if types else None) if dims else math.nan
        if kind == "all_gather" and run["name"].startswith("gloo:"):
            nbytes *= n_default  # gloo's input is the shard; the size is the gathered output
        rows.append((trace.rank, kind, run["name"], math.nan, run["ts"], run["end"], nbytes, n_default))

    df = pd.DataFrame(rows, columns=["rank", "kind", "op", "issue_s", "start_s", "end_s", "bytes", "group_size"])
    for c in ("issue_s", "start_s", "end_s"):
        df[c] = df[c] * 1e-6
    df["duration_s"] = df["end_s"] - df["start_s"]
    df["algbw_gbps"] = [algbw_gbps(b, d) for b, d in zip(df["bytes"], df["duration_s"])]
    df["busbw_gbps"] = [a * bus_factor(k, n) for a, k, n in zip(df["algbw_gbps"], df["kind"], df["group_size"])]
    return df.sort_values("start_s", kind="stable").reset_index(drop=True)


def _enclosing_child(events: pd.DataFrame, ts: float, end: float):
    """First row of ``events`` lying inside ``[ts, end]``, or None."""
    if len(events) == 0:
        return None
    inside = events[(events["ts"] >= ts) & (events["end"] <= end)]
    return None if len(inside) == 0 else inside.iloc[0]


def bandwidth_summary(coll: pd.DataFrame, n_steps: int = 1) -> dict:
    """Per kind present: calls per step, bytes per step, and median algbw / busbw."""
    out = {}
    for kind, g in coll.groupby("kind"):
        out[f"{kind}_calls_trace"] = len(g) / max(n_steps, 1)
        out[f"{kind}_bytes_trace"] = float(g["bytes"].sum()) / max(n_steps, 1)
        out[f"{kind}_algbw_median_gbps"] = float(g["algbw_gbps"].median())
        out[f"{kind}_busbw_median_gbps"] = float(g["busbw_gbps"].median())
    return out
