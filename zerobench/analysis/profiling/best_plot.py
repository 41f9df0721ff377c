"""Plot: exposed all-gather time measured vs best achievable, per cell (emulated cells).

See [Note: best achievable exposed comm] in best.py for the definition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from zerobench.analysis.figures import figure_title, plt, save_figure

COLUMNS = ("exposed_all_gather_s", "best_exposed_all_gather_s")


def best_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per cell (mean over ranks): step_trace_s, overlap_ratio, exposed_comm_s,
    exposed_all_gather_s, best_exposed_all_gather_s, exposed_vs_best. Only cells that
    ran emulated (a best-achievable value)."""
    if not set(COLUMNS) <= set(summary.columns):
        return summary.iloc[0:0]
    cols = ["step_trace_s", "overlap_ratio", "exposed_comm_s", *COLUMNS]
    t = summary.dropna(subset=["best_exposed_all_gather_s"]).groupby("cell_id", sort=False)[cols].mean()
    t["exposed_vs_best"] = t["exposed_all_gather_s"] / t["best_exposed_all_gather_s"]
    return t.reset_index()


def plot_exposed_vs_best(summary: pd.DataFrame, path, setting=None) -> Path | None:
    """Horizontal bars, one pair per cell: measured exposed all-gather time per step and
    the best achievable for that cell's compute. None when no cell ran emulated."""
    t = best_table(summary)
    if len(t) == 0:
        return None
    path = Path(path)
    y = np.arange(len(t))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(t) + 1.5))
    ax.barh(y - 0.2, t["exposed_all_gather_s"] * 1e3, height=0.4, label="measured: waiting on all-gathers")
    ax.barh(y + 0.2, t["best_exposed_all_gather_s"] * 1e3, height=0.4, label="best achievable (one-ahead prefetch)")
    ax.set_yticks(y, t["cell_id"], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("exposed all-gather time per step (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    top = figure_title(fig, "exposed all-gather time: measured vs best achievable, by cell", setting)
    fig.tight_layout(rect=(0, 0, 1, top))
    return save_figure(fig, path, dpi=120, tight=False)
