"""Every trace of a run in, per cell x rank columns out (``zerobench analyze RUN``).

For each ``traces/<cell_id>/rank<r>.json.gz`` of the run folder this computes the
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

from pathlib import Path

import pandas as pd

from zerobench.runs.files import write_csv_atomic
from zerobench.runs.folder import RunFolder

from .collective_table import bandwidth_summary, collectives
from .inflight import all_gathers_in_flight, max_all_gathers_in_flight
from .overlap import overlap_summary, step_breakdown, step_windows
from .trace import Trace, load_trace


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
    return RunFolder(run_dir).find_traces()


def analyze_run(run_dir, plots: bool = True) -> pd.DataFrame:
    """Analyse every trace of a run folder, write the outputs listed in the module
    docstring, and return the summary (one row per cell x rank)."""
    folder = RunFolder(run_dir)
    run_dir = folder.root
    traces = folder.find_traces()
    if not traces:
        raise FileNotFoundError(f"{run_dir}: no traces under traces/ (run with `zerobench run --profile`)")
    summaries, steps, colls, inflight = [], [], [], []
    for cell_id, rank, path in traces:
        trace = load_trace(path, rank=rank)
        trace.rank = rank  # the file name is authoritative: it is what results.csv is keyed on
        emulation = folder.emulation(cell_id)
        summaries.append({"cell_id": cell_id, **analyze_trace(trace, emulation)})
        steps.append(step_breakdown(trace, emulation).assign(cell_id=cell_id))
        colls.append(collectives(trace).assign(cell_id=cell_id))
        inflight.append(all_gathers_in_flight(trace).assign(cell_id=cell_id))

    summary = _cell_first(pd.DataFrame(summaries))
    order = folder.matrix_order()
    summary = summary.sort_values(["cell_id", "rank"], key=lambda c: c.map(lambda cid: order.get(cid, len(order))) if c.name == "cell_id" else c,
                                  kind="stable").reset_index(drop=True)
    write_csv_atomic(folder.analysis_path("summary"), summary)
    write_csv_atomic(folder.analysis_path("steps"), _cell_first(pd.concat(steps, ignore_index=True)))
    write_csv_atomic(folder.analysis_path("collectives"), _cell_first(pd.concat(colls, ignore_index=True)))
    write_csv_atomic(folder.analysis_path("inflight"), _cell_first(pd.concat(inflight, ignore_index=True)))
    folder.merge_into_results(summary)
    if plots:
        from .plots import plot_run

        plot_run(run_dir)
    return summary


def summary_table(summary: pd.DataFrame):
    """The per cell x rank summary as the table ``zerobench analyze`` prints
    (zerobench/analysis/render.py): times in ms, overlap as a fraction."""
    from zerobench.analysis.render import Column, Table, format_column

    table = Table([Column("cell", "left", "parts", role="key"), Column("rank"), Column("overlap"),
                   Column("exposed comm ms"), Column("compute ms"), Column("idle ms"),
                   Column("all-gathers in flight")], title="per cell and rank, from its trace (means over the traced steps):")

    def column(name, scale=1.0, decimals=None):
        return format_column(summary[name] if name in summary else [None] * len(summary), scale, decimals)

    figures = list(zip(column("overlap_ratio", 1, 2), column("exposed_comm_s", 1e3), column("compute_s", 1e3),
                       column("idle_s", 1e3), column("max_inflight_all_gathers_trace", 1, 0)))
    for k, (_, r) in enumerate(summary.iterrows()):
        table.add_row(r["cell_id"], int(r["rank"]), *figures[k])
    return table


def _cell_first(df: pd.DataFrame) -> pd.DataFrame:
    lead = [c for c in ("cell_id", "rank") if c in df.columns]
    return df[lead + [c for c in df.columns if c not in lead]]
