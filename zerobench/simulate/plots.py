"""Plots of simulated steps (matplotlib imported here only), drawn like the measured
ones in :mod:`zerobench.profiling.plots` so the two can be laid side by side: the same
lanes (compute; comm hidden / comm exposed; wait), colours, axis units and legend row."""

from __future__ import annotations

from pathlib import Path

from zerobench.figures import plt, save_figure
from zerobench.profiling import intervals as iv
from zerobench.profiling.plots import COLORS

from .model import SimResult


def plot_gantt(result: SimResult, path, title: str = "") -> Path:
    """Gantt of one simulated step: compute, each link's communication split into
    hidden / exposed (as in plot_timeline), waits, and unsharded units alive."""
    path = Path(path)
    comp = iv.merge([(s.start, s.end) for s in result.spans if s.lane == "compute"])
    links = [name for name in result.link_utilisation]
    lanes = [("compute", [("compute", comp)])]
    for name in links:
        comm = iv.merge([(s.start, s.end) for s in result.spans if s.lane == name])
        label = "comm" if len(links) == 1 else f"comm ({name})"
        lanes.append((label, [("comm hidden", iv.intersect(comm, comp)), ("comm exposed", iv.subtract(comm, comp))]))
    lanes.append(("wait", [("wait", iv.merge([(s.start, s.end) for s in result.spans if s.lane == "wait"]))]))
    n = len(lanes)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 1.6 + 0.4 * n + 1.2), sharex=True,
                                  gridspec_kw={"height_ratios": [n, 1.6]})
    ax.broken_barh([(0.0, result.step_s * 1e3)], (-0.1, n), facecolors="none", edgecolors="#BBBBBB",
                   linestyles="--")
    yticks, ylabels, seen = [], [], set()
    for j, (lane, parts) in enumerate(lanes):
        y = n - 1 - j
        for kind, spans in parts:
            bars = [(s * 1e3, (e - s) * 1e3) for s, e in spans]
            ax.broken_barh(bars, (y, 0.8), facecolors=COLORS[kind], label=None if kind in seen else kind)
            seen.add(kind)
        yticks.append(y + 0.4)
        ylabels.append(f"model  {lane}")
    ax.set_yticks(yticks, ylabels)
    ax.set_title(title or "one simulated step", loc="left", fontsize="medium", pad=22)
    ax.legend(loc="lower left", ncols=4, fontsize="small", frameon=False, bbox_to_anchor=(0.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    t = [a[0] * 1e3 for a in result.alive] + [result.step_s * 1e3]
    units = [a[1] for a in result.alive]
    ax2.step(t[:-1], units, where="post", color=COLORS["compute"])
    ax2.set_ylabel("unsharded\nunits", fontsize="small")
    ax2.set_xlabel("time (ms) in the simulated step; dashed box: the step")
    ax2.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120)


def plot_heatmap(table, path, value: str = "step_s", title: str = "") -> Path:
    """Knob setting (rows) x link bandwidth (columns) -> predicted ``value`` in ms."""
    path = Path(path)
    pivot = table.pivot_table(index="setting", columns="gbps", values=value, aggfunc="mean", sort=False) * 1e3
    fig, ax = plt.subplots(figsize=(2.5 + 1.1 * pivot.shape[1], 1.2 + 0.4 * pivot.shape[0]))
    im = ax.imshow(pivot.to_numpy(), aspect="auto", cmap="viridis_r")
    ax.set_xticks(range(pivot.shape[1]), [f"{c:g}" for c in pivot.columns])
    ax.set_yticks(range(pivot.shape[0]), list(pivot.index))
    for i in range(pivot.shape[0]):
        for j in range(pivot.shape[1]):
            ax.text(j, i, f"{pivot.iat[i, j]:.3g}", ha="center", va="center", fontsize="x-small", color="w")
    ax.set_xlabel("link bandwidth (GB/s)")
    fig.colorbar(im, ax=ax, label=f"predicted {value} (ms)")
    ax.set_title(title or f"predicted {value}", loc="left", fontsize="medium")
    return save_figure(fig, path, dpi=120)
