"""Plots of a run's traces (opt-in: matplotlib is imported here only).

* :func:`plot_timeline` -- per-rank Gantt of one traced step: compute, communication
  and waits (impl labels) as lanes, ranks aligned on the machine clock;
* :func:`plot_overlap` -- by cell: the step broken down into compute, exposed
  communication and idle, and the overlap ratio.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from zerobench.analysis.figures import figure_title, plt, save_figure
from zerobench.runs.folder import RunFolder

from . import intervals as iv
from .overlap import WAIT_PREFIX, comm_intervals, compute_intervals, step_windows
from .trace import Trace, load_trace

COLORS = {"compute": "#4C72B0", "comm hidden": "#DD8452", "comm exposed": "#C44E52", "wait": "#8C8C8C",
          "idle": "#DDDDDD"}


def plot_timeline(traces: dict[int, Trace], path, step: int = -1, title: str = "", emulation=None,
                  setting=None) -> Path:
    """Gantt of traced step ``step`` (default: the last) on every rank; ``setting``
    (zerobench.analysis.figures.Setting) adds the title's second line."""
    path = Path(path)
    ranks = sorted(traces)
    windows = {r: step_windows(traces[r]).iloc[step] for r in ranks}
    t0 = min(traces[r].base_ts + windows[r].ts for r in ranks)
    # The wait lane only where the engine labels its waits (impl engines).
    show_wait = any(len(traces[r].named(WAIT_PREFIX, main_only=True)) for r in ranks)
    n_lanes = 3 if show_wait else 2
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.4 * n_lanes * len(ranks)))
    yticks, ylabels = [], []
    for i, r in enumerate(ranks):
        t, w = traces[r], windows[r]
        comp, comm = compute_intervals(t), comm_intervals(t, emulation)
        lanes = [
            ("compute", [("compute", comp)]),
            ("comm", [("comm hidden", iv.intersect(comm, comp)), ("comm exposed", iv.subtract(comm, comp))]),
            ("wait", [("wait", iv.merge(t.named(WAIT_PREFIX, main_only=True)[["ts", "end"]].to_numpy()))]),
        ][:n_lanes]
        base = -i * (n_lanes + 1.0)
        shift = t.base_ts - t0
        ax.broken_barh([((w.ts + shift) / 1e3, (w.end - w.ts) / 1e3)], (base - 0.1, n_lanes),
                       facecolors="none", edgecolors="#BBBBBB", linestyles="--")
        for j, (lane, parts) in enumerate(lanes):
            y = base + n_lanes - 1 - j
            for kind, spans in parts:
                spans = iv.clip(spans, w.ts, w.end)
                bars = [((s + shift) / 1e3, (e - s) / 1e3) for s, e in spans]
                ax.broken_barh(bars, (y, 0.8), facecolors=COLORS[kind], label=kind if i == 0 else None)
            yticks.append(y + 0.4)
            ylabels.append(f"rank {r}  {lane}")
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time (ms), ranks aligned on the machine clock; dashed box: the step")
    heading = title or "one traced step per rank"
    ax.set_title(heading + (f"\n{setting.line()}" if setting is not None else ""), loc="left", fontsize="medium",
                 pad=22)
    # legend in its own row between the title and the axes, so long cell ids never hide it
    ax.legend(loc="lower left", ncols=4, fontsize="small", frameon=False, bbox_to_anchor=(0.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path, dpi=120)


def plot_overlap(summary: pd.DataFrame, path, setting=None) -> Path:
    """By cell (means over ranks): step = compute + exposed comm + idle, and overlap ratio."""
    path = Path(path)
    by_cell = summary.groupby("cell_id", sort=False)[
        ["compute_s", "exposed_comm_s", "idle_s", "overlap_ratio", "comm_s"]].mean()
    cells = list(by_cell.index)
    y = np.arange(len(cells))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 1.8 + 0.5 * len(cells)), sharey=True,
                                   gridspec_kw={"width_ratios": [2, 1]})
    left = np.zeros(len(cells))
    for col, label, color in (("compute_s", "compute", COLORS["compute"]),
                              ("exposed_comm_s", "exposed comm", COLORS["comm exposed"]),
                              ("idle_s", "idle / overhead", COLORS["idle"])):
        ms = by_cell[col].fillna(0).to_numpy() * 1e3
        ax1.barh(y, ms, left=left, color=color, label=label)
        left += ms
    ax1.set_xlabel("time per traced step (ms), mean over ranks")
    ax1.legend(loc="lower left", ncols=3, fontsize="small", frameon=False, bbox_to_anchor=(0.0, 1.0))
    ax1.invert_yaxis()
    ax1.set_yticks(y, cells)
    ratio = by_cell["overlap_ratio"].to_numpy()
    ax2.barh(y, np.nan_to_num(ratio), color=COLORS["comm hidden"], label="mean over ranks")
    # Ranks can differ a lot (the rank that arrives first at a collective waits in it).
    pos = {c: k for k, c in enumerate(cells)}
    per_rank = summary.dropna(subset=["overlap_ratio"])
    ax2.plot(per_rank["overlap_ratio"], per_rank["cell_id"].map(pos), "k|", markersize=12, label="one rank")
    ax2.legend(loc="lower left", ncols=2, fontsize="small", frameon=False, bbox_to_anchor=(0.0, 1.0))
    for yi, r in zip(y, ratio):
        ax2.text(1.02, yi, "n/a" if np.isnan(r) else f"{r:.0%}", va="center", fontsize="small")
    ax2.set_xlim(0, 1.2)
    ax2.set_xlabel("overlap ratio: comm hidden / comm")
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, figure_title(fig, "compute / communication overlap by cell (HTA definition)",
                                                 setting)))
    return save_figure(fig, path, dpi=120, tight=False)


def plot_run(run_dir) -> list[Path]:
    """Every plot of a run analysed by ``zerobench analyze``: one timeline per cell,
    and the overlap chart. Returns the files written."""
    folder = RunFolder(run_dir)
    run_dir = folder.root
    written = []
    by_cell: dict[str, dict[int, Path]] = {}
    for cell_id, rank, p in folder.find_traces():
        by_cell.setdefault(cell_id, {})[rank] = p
    try:
        results = folder.results()
    except (FileNotFoundError, ValueError):  # traces without tables: titles without a setting line
        results = None
    for cell_id, paths in by_cell.items():
        traces = {r: load_trace(p, rank=r) for r, p in paths.items()}
        emulation = folder.emulation(cell_id)
        cell = results[results["cell_id"] == cell_id] if results is not None else None
        written.append(plot_timeline(traces, folder.plot_path(f"timeline_{cell_id}.png"),
                                     title=f"{cell_id}: last traced step", emulation=emulation,
                                     setting=_setting(run_dir, cell)))
    summary_path = folder.analysis_path("summary")
    if summary_path.exists():
        setting = _setting(run_dir, results)
        written.append(plot_overlap(pd.read_csv(summary_path), folder.plot_path("overlap.png"), setting))
        from .best_plot import plot_exposed_vs_best

        best = plot_exposed_vs_best(pd.read_csv(summary_path), folder.plot_path("exposed_vs_best.png"), setting)
        written += [best] if best is not None else []
    return written


def _setting(run_dir, results):
    """The title line of a run's plots ([Note: plot titles]); None without its table."""
    if results is None or results.empty:
        return None
    from zerobench.analysis.plots import run_setting

    return run_setting(run_dir, results)
