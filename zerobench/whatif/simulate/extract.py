"""A profiled cell's trace in, a :class:`~.schedule.Schedule` out.

Per traced step, on one rank's main thread (times from :mod:`zerobench.analysis.profiling`):

* **unit order and sizes**: the all-gathers issued in the forward phase, in issue
  order, one per unit (the root first), with their nccl-tests bytes (the gathered
  output = the unit's unsharded parameters);
* **forward compute per unit**: the rank's busy time (:func:`busy_intervals`: on CPU
  the main thread outside waits on collectives, on GPU compute kernels) between consecutive ``impl::fsdp::pre_forward`` labels
  (impl engines), else between consecutive forward all-gather issues;
* **backward compute per unit**: with impl labels, between consecutive
  ``impl::fsdp::pre_backward`` labels (the root's first, then the units in reverse);
  otherwise the backward phase's compute split in proportion to forward compute;
* **optimizer step**: compute inside ``zerobench::optimizer``.

Each number is the median over traced steps, then the mean over ranks. DDP and ZeRO
have no per-unit collectives in forward: their backward phase is split into
``DEFAULT_UNITS`` equal units over the gradient bytes reduced per step.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pandas as pd

from zerobench.analysis.figures import flag
from zerobench.analysis.profiling import intervals as iv
from zerobench.analysis.profiling.analyze import find_traces
from zerobench.analysis.profiling.collective_table import collectives
from zerobench.analysis.profiling.overlap import compute_intervals, is_gpu_trace, step_windows
from zerobench.analysis.profiling.trace import Trace, load_trace
from zerobench.engines.options import axes_with_role, axis_named
from zerobench.runs.files import write_atomic
from zerobench.runs.folder import RunFolder

from .schedule import ENGINES, Knobs, Schedule, Unit

DEFAULT_UNITS = 8
_KNOB_AXES = axes_with_role("sharding", "schedule")  # the engines' knobs a schedule re-times


def _covered_s(comp: np.ndarray, start: float, end: float) -> float:
    """Seconds of merged compute intervals (microseconds) inside ``[start, end)``."""
    return float((iv.clip(comp, start, end)[:, 1] - iv.clip(comp, start, end)[:, 0]).sum()) * 1e-6


def _phase(trace: Trace, name: str, w) -> tuple[float, float] | None:
    ph = trace.named(name, main_only=True)
    ph = ph[(ph["ts"] >= w.ts) & (ph["end"] <= w.end)]
    return None if len(ph) == 0 else (float(ph["ts"].iloc[0]), float(ph["end"].iloc[-1]))


def _starts(trace: Trace, label: str, a: float, b: float) -> list[float]:
    ev = trace.named(label, main_only=True)
    return sorted(ev.loc[(ev["ts"] >= a) & (ev["ts"] < b), "ts"].tolist())


def _segments(comp, bounds: list[float], end: float) -> list[float]:
    edges = list(bounds) + [end]
    return [_covered_s(comp, edges[k], edges[k + 1]) for k in range(len(bounds))]


# Where the main thread is blocked on communication rather than busy (see busy_intervals).
WAIT_NAMES = (r"^impl::wait_|^zerobench::wait_|^impl::rate_limiter_wait$|^FullyShardedDataParallel\.rate_limiter"
              r"|wait_tensor|^c10d::wait")


def wait_intervals(trace: Trace, blocking: pd.DataFrame | None = None) -> np.ndarray:
    """Merged spans (microseconds) where the main thread is blocked on communication:
    waits on a collective (impl's, the emulation's, c10d's) and rate-limiter stalls.
    ``blocking``: for an engine whose collectives are synchronous
    (``Knobs.blocking_collectives``), its collectives (:func:`collectives`): the thread
    is also blocked from each one's issue to its end, a wait no label marks."""
    main = trace.main
    spans = [main[main["name"].str.contains(WAIT_NAMES, regex=True)][["ts", "end"]].to_numpy(dtype=float)]
    if blocking is not None:
        spans.append((blocking[["issue_s", "end_s"]].dropna().to_numpy(dtype=float) * 1e6).reshape(-1, 2))
    return iv.merge(np.concatenate(spans))


def busy_intervals(trace: Trace, waits: np.ndarray | None = None) -> np.ndarray:
    """What occupies the rank's compute stream. On GPU, compute kernels. On CPU, the
    main thread's whole time except where it waits on a collective (``waits``, default
    :func:`wait_intervals`): the aten ops *and* the Python and framework time between
    them (hooks, autograd, the harness), which take the main thread as much as the ops
    do (``zerobench analyze`` counts the latter as idle)."""
    if is_gpu_trace(trace):
        return compute_intervals(trace)
    steps = step_windows(trace)[["ts", "end"]].to_numpy(dtype=float)
    return iv.subtract(steps, wait_intervals(trace) if waits is None else waits)


def trace_steps(trace: Trace, blocking: bool = False, coll: pd.DataFrame | None = None) -> list[dict]:
    """Per traced step: unit bytes, forward/backward busy time per unit, optimizer
    seconds; and, to validate against, the step's length and the time the main thread
    was blocked on communication (``blocked``, see :func:`wait_intervals`).
    ``blocking``: the engine's collectives are synchronous; ``coll``: the trace's
    :func:`collectives`, when the caller has them."""
    coll = collectives(trace) if coll is None else coll
    waits = wait_intervals(trace, coll if blocking else None)
    comp = busy_intervals(trace, waits)
    coll_issue = coll["issue_s"].fillna(coll["start_s"]) * 1e6
    out = []
    for w in step_windows(trace).itertuples():
        fwd, bwd, opt = (_phase(trace, f"zerobench::{p}", w) for p in ("forward", "backward", "optimizer"))
        if fwd is None or bwd is None:
            continue
        in_fwd = coll[(coll_issue >= fwd[0]) & (coll_issue < fwd[1])]
        ags = in_fwd[in_fwd["kind"] == "all_gather"]
        in_step = coll[(coll_issue >= w.ts) & (coll_issue <= w.end)]
        pre_fwd = _starts(trace, "impl::fsdp::pre_forward", *fwd)
        if len(ags):
            nbytes = [int(b) for b in ags["bytes"]]
            bounds = pre_fwd if len(pre_fwd) == len(ags) else sorted((ags["issue_s"].fillna(ags["start_s"]) * 1e6))
        else:  # DDP / ZeRO: equal units over the reduced gradient bytes
            grad = in_step[in_step["kind"].isin(["all_reduce", "reduce_scatter"])]["bytes"].sum()
            nbytes = [int(grad // DEFAULT_UNITS)] * DEFAULT_UNITS
            bounds = list(np.linspace(fwd[0], fwd[1], DEFAULT_UNITS + 1)[:-1])
        bounds = [fwd[0]] + list(bounds[1:])
        forward = _segments(comp, bounds, fwd[1])
        n = len(forward)
        pre_bwd = _starts(trace, "impl::fsdp::pre_backward", *bwd)
        if len(pre_bwd) == n:
            seg = _segments(comp, [bwd[0]] + pre_bwd[1:], bwd[1])
            backward = [seg[0]] + [seg[n - i] for i in range(1, n)]  # root first, then n-1 .. 1
        else:
            total = _covered_s(comp, *bwd)
            fsum = sum(forward) or 1.0
            backward = [total * f / fsum if sum(forward) else total / n for f in forward]
        out.append({"bytes": nbytes, "forward": forward, "backward": backward,
                    "optimizer": _covered_s(comp, *opt) if opt else 0.0,
                    "step": (w.end - w.ts) * 1e-6, "blocked": _covered_s(waits, w.ts, w.end)})
    return out


def transport_s(trace: Trace, coll: pd.DataFrame | None = None) -> dict[str, float]:
    """Kind -> median seconds a collective of the traced steps ran on the transport
    itself (gloo's worker thread or the NCCL kernel, from start to end), whatever link
    the harness emulated on top. The emulated link can only slow a collective down to
    its model, never speed it up: where the transport alone takes about as long as the
    emulated link, the link model is not what the cell ran on, and the validation says
    so (:func:`~.validate.emulation_margin`)."""
    coll = collectives(trace) if coll is None else coll
    w = step_windows(trace)
    inside = np.zeros(len(coll), dtype=bool)
    for lo, hi in zip(w["ts"] * 1e-6, w["end"] * 1e-6):
        inside |= (coll["start_s"] >= lo).to_numpy() & (coll["end_s"] <= hi).to_numpy()
    coll = coll[inside & coll["end_s"].notna().to_numpy()]
    return {k: float((g["end_s"] - g["start_s"]).median()) for k, g in coll.groupby("kind")}


def _median_steps(steps: list[dict]) -> dict:
    n = statistics.mode(len(s["forward"]) for s in steps)
    steps = [s for s in steps if len(s["forward"]) == n]
    med = lambda key, i: statistics.median(s[key][i] for s in steps)  # noqa: E731
    return {"bytes": steps[0]["bytes"], "forward": [med("forward", i) for i in range(n)],
            "backward": [med("backward", i) for i in range(n)],
            "optimizer": statistics.median(s["optimizer"] for s in steps),
            "step": statistics.median(s["step"] for s in steps),
            "blocked": statistics.median(s["blocked"] for s in steps)}


def _blocking(config: dict, on_gpu: bool) -> bool:
    """PyTorch's FSDPs call their collectives with async_op=False: on CPU that blocks."""
    return not on_gpu and config.get("engine") in ("torch-fsdp1", "torch-fsdp2")


def _knobs(config: dict, on_gpu: bool) -> Knobs:
    k = Knobs()
    k.blocking_collectives = _blocking(config, on_gpu)
    for axis in _KNOB_AXES:
        v = config.get(axis)
        if v is None or (isinstance(v, float) and v != v) or v == "":
            continue
        if axis == "backward_prefetch":
            v = {"backward_pre": "pre", "backward_post": "post"}.get(str(v).lower(), str(v).lower())
        elif axis_named(axis).is_flag:
            v = flag(v)  # the cell record's boolean
        elif axis_named(axis).type is int:
            v = int(v)
        setattr(k, axis, v)
    if config.get("bucket_cap_mb") not in (None, ""):
        k.bucket_mb = float(config["bucket_cap_mb"])
    if config.get("engine") in ("torch-fsdp2",) and k.reshard_after_forward is None:
        k.reshard_after_forward = True
    return k


def _measured(run_dir: Path, cell_id: str) -> dict:
    out = {}
    folder = RunFolder(run_dir)
    if folder.results_path.exists():
        df = folder.results()  # old folders' column names read as today's
        df = df[df["cell_id"] == cell_id]
        for col, key in (("step_time_s", "step_time_s"), ("exposed_comm_s", "exposed_comm_s"),
                         ("step_trace_s", "step_trace_s"), ("compute_s", "compute_s"), ("idle_s", "idle_s"),
                         ("overlap_ratio", "overlap_ratio")):
            if col in df.columns and df[col].notna().any():
                out[key] = float(df[col].mean())
    return out


def extract_cell(run_dir, cell_id: str) -> Schedule:
    """The schedule of one profiled cell (every rank's trace, averaged)."""
    run_dir = Path(run_dir)
    paths = [p for c, _, p in find_traces(run_dir) if c == cell_id]
    if not paths:
        raise FileNotFoundError(f"{run_dir}: no traces for cell {cell_id!r} (run it with --profile)")
    config = RunFolder(run_dir).cell_config(cell_id)
    per_rank, transports = [], []
    on_gpu = False
    for p in paths:
        trace = load_trace(p)
        on_gpu = on_gpu or is_gpu_trace(trace)
        coll = collectives(trace)
        steps = trace_steps(trace, blocking=_blocking(config, on_gpu), coll=coll)
        transports.append(transport_s(trace, coll))
        if steps:
            per_rank.append(_median_steps(steps))
    if not per_rank:
        raise ValueError(f"{cell_id}: no traced step with zerobench::forward/backward labels")
    n = min(len(r["forward"]) for r in per_rank)
    per_rank = [r for r in per_rank if len(r["forward"]) == n]
    mean = lambda key, i: sum(r[key][i] for r in per_rank) / len(per_rank)  # noqa: E731
    units = [Unit(f"unit{i}", int(per_rank[0]["bytes"][i]), mean("forward", i), mean("backward", i)) for i in range(n)]
    engine = config.get("engine", "impl-fsdp")
    if engine not in ENGINES:
        raise ValueError(f"{cell_id}: engine {engine!r} cannot be simulated (allowed: {', '.join(ENGINES)})")
    measured = _measured(run_dir, cell_id)
    # Traced steps, medians, mean over ranks: the step and the blocked time (on CPU the
    # like-for-like measure of the model's exposed communication: docs/simulate.md).
    # On GPU the host blocking is not the device's exposure: the HTA column stands.
    measured["traced_step_s"] = sum(r["step"] for r in per_rank) / len(per_rank)
    if not on_gpu:
        measured["blocked_comm_s"] = sum(r["blocked"] for r in per_rank) / len(per_rank)
    kinds = {k for t in transports for k in t}
    measured["transport_s"] = {k: statistics.mean(t[k] for t in transports if k in t) for k in sorted(kinds)}
    s = Schedule(engine=engine, world_size=int(config.get("world_size", len(paths))), units=units,
                 optimizer_s=sum(r["optimizer"] for r in per_rank) / len(per_rank), knobs=_knobs(config, on_gpu),
                 cell_id=cell_id, measured=measured,
                 source={"run": str(run_dir), "traces": [p.name for p in paths],
                         "emulate_gbps": config.get("emulate_gbps"),
                         "emulate_latency_us": config.get("emulate_latency_us"),
                         "device": "cuda" if on_gpu else "cpu"})
    s.validate()
    return s


def extract_run(run_dir, cells: list[str] | None = None) -> dict[str, Path]:
    """Write ``schedules/<cell_id>.json`` for each profiled cell; returns cell_id -> path."""
    run_dir = Path(run_dir)
    ids = sorted({c for c, _, _ in find_traces(run_dir)})
    if cells:
        missing = [c for c in cells if c not in ids]
        if missing:
            raise ValueError(f"--cell: no traces for {missing} (profiled cells: {', '.join(ids) or 'none'})")
        ids = [c for c in ids if c in cells]
    written = {}
    for cell_id in ids:
        try:
            s = extract_cell(run_dir, cell_id)
        except ValueError as e:
            print(f"zerobench simulate: skipping {cell_id}: {e}")
            continue
        path = RunFolder(run_dir).schedule_path(cell_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = s.to_json()
        write_atomic(path, lambda f: f.write(text))
        written[cell_id] = path
    return written


def load_schedules(run_dir, cells: list[str] | None = None) -> dict[str, Schedule]:
    """The run's schedules, extracted from its traces where not stored yet."""
    run_dir = Path(run_dir)
    stored = RunFolder(run_dir).schedules_dir
    have = {p.name[:-5]: p for p in sorted(stored.glob("*.json"))} if stored.exists() else {}
    if cells:
        known = sorted(set(have) | {c for c, _, _ in find_traces(run_dir)})
        unknown = [c for c in cells if c not in known]
        if unknown:
            from zerobench.choices import not_allowed

            raise ValueError(not_allowed("--cell", unknown[0], known, show=str,
                                         what=f"is not a profiled cell of {run_dir}"))
    if not have or (cells and not set(cells) <= set(have)):
        have.update(extract_run(run_dir, cells))
    if cells:
        have = {c: p for c, p in have.items() if c in cells}
    out = {}
    for c, p in have.items():
        out[c] = Schedule.load(p)
        out[c].measured.update(_measured(run_dir, c))  # the analysis may have run since
    return out

