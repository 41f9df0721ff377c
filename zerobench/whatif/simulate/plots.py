"""Plots of simulated steps (matplotlib imported here only), drawn like the measured
ones in :mod:`zerobench.analysis.profiling.plots` so the two can be laid side by side: the same
lanes (compute; comm hidden / comm exposed; wait), colours, axis units and legend row."""

from __future__ import annotations

from pathlib import Path

from zerobench.analysis.figures import plt, save_figure
from zerobench.analysis.profiling import intervals as iv
from zerobench.analysis.profiling.plots import COLORS

from .against import EXPOSED_BAR, MIN_MARGIN, STEP_BAR
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
    ax.broken_barh([(0.0, result.step_time_s * 1e3)], (-0.1, n), facecolors="none", edgecolors="#BBBBBB",
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
    t = [a[0] * 1e3 for a in result.alive] + [result.step_time_s * 1e3]
    units = [a[1] for a in result.alive]
    ax2.step(t[:-1], units, where="post", color=COLORS["compute"])
    ax2.set_ylabel("unsharded\nunits", fontsize="small")
    ax2.set_xlabel("time (ms) in the simulated step; dashed box: the step")
    ax2.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120)


def plot_heatmap(table, path, value: str = "step_time_s", title: str = "") -> Path:
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


def plot_validation(pred, path, min_margin: float = MIN_MARGIN, heading: str = "") -> Path:
    """Predicted against measured, one point per cell: step time (left) and exposed
    communication (right), log-log, the diagonal and the validation bars (``STEP_BAR``,
    ``EXPOSED_BAR``) shaded; one marker per engine, one colour per emulated link. Hollow markers: cells
    whose emulated link is less than ``min_margin`` times the real transport, where the
    link model is not what set the time (:func:`~.validate.emulation_margin`)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    path = Path(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    markers = dict(zip(sorted(pred["engine"].unique()), "osD^vP"))
    links = sorted(pred["link"].unique(), key=lambda s: float(s.split()[0]))
    colours = dict(zip(links, plt.get_cmap("viridis")(
        [i / max(len(links) - 1, 1) for i in range(len(links))])))
    for ax, (p, m, bar, what) in zip(axes, (("step_time_s", "measured_step_s", STEP_BAR, "step time"),
                                            ("exposed_comm_s", "measured_exposed_comm_s", EXPOSED_BAR,
                                             "exposed communication"))):
        ok = pred[(pred[p] > 0) & (pred[m] > 0)]
        if not len(ok):
            continue
        lo, hi = min(ok[p].min(), ok[m].min()) * 0.8e3, max(ok[p].max(), ok[m].max()) * 1.25e3  # ms
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax.fill_between(xs, [x * (1 - bar) for x in xs], [x * (1 + bar) for x in xs], color="0.9",
                        label=f"within {bar:.0%}")
        ax.plot(xs, xs, color="0.5", lw=0.8)
        for (engine, link), g in ok.groupby(["engine", "link"], sort=False):
            margin = g["emulation_margin"] if "emulation_margin" in g else None
            inside = (margin >= min_margin) if margin is not None else g[p] == g[p]
            for sel, face in ((inside, colours[link]), (~inside, "none")):
                if sel.any():
                    ax.scatter(g[m][sel] * 1e3, g[p][sel] * 1e3, marker=markers[engine], s=36,
                               facecolors=face, edgecolors=colours[link], linewidths=1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"measured {what} (ms)")
        ax.set_ylabel(f"predicted {what} (ms)")
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[0]
    handles = [plt.Line2D([], [], ls="", marker=mk, color="0.3", label=e) for e, mk in markers.items()]
    handles += [plt.Line2D([], [], ls="", marker="o", color=c, label=lk) for lk, c in colours.items()]
    handles += [plt.Line2D([], [], ls="", marker="o", mfc="none", color="0.3",
                           label=f"link < {min_margin:g}x the transport")]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    fig.suptitle("simulated against measured, each cell on the link it ran on (shaded: the validation bar)"
                 + (f"\n{heading}" if heading else ""))
    return save_figure(fig, path)
