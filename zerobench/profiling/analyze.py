"""``zerobench analyze RUN``: every trace of a run in, per cell x rank columns out.

For each ``traces/<cell_id>.rank<r>.json.gz`` of the run folder this computes the
summary of :func:`analyze_trace` and writes

* ``analysis/summary.csv``     one row per cell x rank (the columns below);
* ``analysis/steps.csv``       the step breakdown, one row per cell x rank x traced step;
* ``analysis/collectives.csv`` one row per collective instance: cell_id, rank, kind,
  bytes, issue_s, start_s, duration_s, algbw_gbps, busbw_gbps, ...;
* ``analysis/inflight.csv``    all-gathers in flight over time, per cell x rank;
* the same summary columns merged into ``results.csv`` (matched on cell_id and rank,
  replacing earlier analysis columns), written atomically;
* plots under ``plots/`` (:mod:`.plots`).

Summary columns: overlap_ratio, exposed_comm_s, comm_s, compute_s, idle_s,
step_trace_s (per traced step, means over the traced steps), trace_steps,
max_inflight_all_gathers_trace, limiter_wait_s, collective_wait_s, and per collective
kind ``<kind>_calls_trace`` / ``<kind>_bytes_trace`` (per step) and
``<kind>_algbw_median_gbps`` / ``<kind>_busbw_median_gbps``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

from zerobench.files import write_csv_atomic
from zerobench.results import matrix_order

from .collectives import bandwidth_summary, collectives
from .inflight import all_gathers_in_flight, max_all_gathers_in_flight
from .overlap import overlap_summary, step_breakdown, step_windows
from .trace import Trace, load_trace

TRACE_NAME = re.compile(r"^(?P<cell>.+)\.rank(?P<rank>\d+)\.json(\.gz)?$")


def _emulation_from(config: dict):
    """The zerobench.link.Link a cell emulated, from its config (None when off)."""
    from .best import link_from_config

    return link_from_config(config)


def _in_steps(coll: pd.DataFrame, trace: Trace) -> pd.DataFrame:
    """Collectives issued (or, without an issue op, started) inside a traced step."""
    w = step_windows(trace)
    t = coll["issue_s"].fillna(coll["start_s"]) * 1e6
    inside = pd.Series(False, index=coll.index)
    for s in w.itertuples():
        inside |= (t >= s.ts) & (t <= s.end)
    return coll[inside]


def analyze_trace(source, emulation=None) -> dict:
    """Summary columns of one rank's trace (a path or a :class:`Trace`)."""
    trace = source if isinstance(source, Trace) else load_trace(source)
    summary = {"rank": trace.rank, **overlap_summary(trace, emulation)}
    summary["max_inflight_all_gathers_trace"] = max_all_gathers_in_flight(trace)
    coll = _in_steps(collectives(trace), trace)
    summary.update(bandwidth_summary(coll, summary["trace_steps"]))
    if emulation is not None:
        from .best import best_exposed_summary

        summary.update(best_exposed_summary(trace, emulation))
    return summary


def find_traces(run_dir) -> list[tuple[str, int, Path]]:
    """(cell_id, rank, path) of every trace in ``run_dir/traces``, sorted."""
    found = []
    for p in sorted(Path(run_dir, "traces").glob("*.json*")):
        m = TRACE_NAME.match(p.name)
        if m:
            found.append((m.group("cell"), int(m.group("rank")), p))
    return found


def _cell_config(run_dir: Path, cell_id: str) -> dict:
    path = run_dir / "cells" / f"{cell_id}.json"
    if path.exists():
        try:
            return json.loads(path.read_text()).get("config", {})
        except (OSError, json.JSONDecodeError):
            pass
    return {}


def analyze_run(run_dir, plots: bool = True) -> pd.DataFrame:
    """Analyse every trace of a run folder, write the outputs listed in the module
    docstring, and return the summary (one row per cell x rank)."""
    run_dir = Path(run_dir)
    traces = find_traces(run_dir)
    if not traces:
        raise FileNotFoundError(f"{run_dir}: no traces under traces/ (run with `zerobench run --profile`)")
    summaries, steps, colls, inflight = [], [], [], []
    for cell_id, rank, path in traces:
        trace = load_trace(path, rank=rank)
        trace.rank = rank  # the file name is authoritative: it is what results.csv is keyed on
        emulation = _emulation_from(_cell_config(run_dir, cell_id))
        summaries.append({"cell_id": cell_id, **analyze_trace(trace, emulation)})
        steps.append(step_breakdown(trace, emulation).assign(cell_id=cell_id))
        colls.append(collectives(trace).assign(cell_id=cell_id))
        inflight.append(all_gathers_in_flight(trace).assign(cell_id=cell_id))

    summary = _cell_first(pd.DataFrame(summaries))
    order = matrix_order(run_dir)
    summary = summary.sort_values(["cell_id", "rank"], key=lambda c: c.map(lambda cid: order.get(cid, len(order))) if c.name == "cell_id" else c,
                                  kind="stable").reset_index(drop=True)
    out = run_dir / "analysis"
    write_csv_atomic(out / "summary.csv", summary)
    write_csv_atomic(out / "steps.csv", _cell_first(pd.concat(steps, ignore_index=True)))
    write_csv_atomic(out / "collectives.csv", _cell_first(pd.concat(colls, ignore_index=True)))
    write_csv_atomic(out / "inflight.csv", _cell_first(pd.concat(inflight, ignore_index=True)))
    merge_into_results(run_dir, summary)
    if plots:
        from .plots import plot_run

        plot_run(run_dir)
    return summary


def _cell_first(df: pd.DataFrame) -> pd.DataFrame:
    lead = [c for c in ("cell_id", "rank") if c in df.columns]
    return df[lead + [c for c in df.columns if c not in lead]]


def merge_into_results(run_dir: Path, summary: pd.DataFrame) -> bool:
    """Add the summary columns to ``results.csv`` (cell_id x rank); earlier values of
    the same columns are replaced. Returns False (and does nothing) when the run has no
    results.csv."""
    path = Path(run_dir) / "results.csv"
    if not path.exists():
        return False
    results = pd.read_csv(path)
    new_cols = [c for c in summary.columns if c not in ("cell_id", "rank")]
    results = results.drop(columns=[c for c in new_cols if c in results.columns])
    merged = results.merge(summary, on=["cell_id", "rank"], how="left")
    write_csv_atomic(path, merged)
    return True


def _cmd_analyze(args) -> int:
    try:
        summary = analyze_run(args.run, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"zerobench analyze: {e}")
        return 2
    cols = [c for c in ("cell_id", "rank", "overlap_ratio", "exposed_comm_s", "compute_s", "idle_s",
                        "max_inflight_all_gathers_trace") if c in summary.columns]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summary[cols].round(4).to_string(index=False))
    run = Path(args.run)
    merged = "merged into results.csv" if (run / "results.csv").exists() else "no results.csv to merge into"
    print(f"wrote {run / 'analysis'}/ ({merged}); plots in {run / 'plots'}/")
    return 0


def register_cli(subparsers) -> None:
    """Add ``analyze RUN`` to the ``zerobench`` command line."""
    p = subparsers.add_parser(
        "analyze",
        help="overlap, exposed communication, in-flight all-gathers and bandwidth from a run's traces",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("run", type=Path, help="run folder (results/<run-id>) recorded with --profile")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.set_defaults(func=_cmd_analyze)
