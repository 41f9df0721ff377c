"""estimate_peak.png: per-rank peak memory against world size, DDP as the reference.

Per dtype, two panels: the per-rank peak of each configuration (log-log; its analytic
model states, the lower bound, as a short bar at each point) and the same peak as a
ratio to DDP's at that world size. Colour names the engine, marker and line style its
sharding, fill its activation checkpointing ([Note: one look per configuration] in
zerobench/analysis/figures.py), DDP is black, and at
each world size the configuration with the lowest peak is ringed: the memory end of
the Pareto front (no step time here; ``zerobench predict`` has both).
"""

from __future__ import annotations

from pathlib import Path


def estimate_setting(frame, workload: str):
    """Title line of an estimate's plots ([Note: plot titles] in zerobench/analysis/figures.py)."""
    from zerobench.analysis.figures import Setting, flag

    backend = ", ".join(sorted({str(b) for b in frame["backend"].dropna()})) if "backend" in frame else "nccl"
    fake = "fake tensors" if "fake_tensors" in frame and frame["fake_tensors"].map(flag).any() else "real tensors"
    device = f"any device: tensor bytes of one rank ({fake}, {backend} buffers)"
    sizes = tuple(sorted({int(w) for w in frame["world_size"]}))
    return Setting(workload, device, "no link (memory only, fake process group)", sizes)


def plot_estimate(frame, path: Path, setting=None) -> Path | None:
    # matplotlib on first plot: `estimate` is often run without one
    from zerobench.analysis.figures import (
        REFERENCE_ENGINE,
        EngineStyles,
        figure_title,
        numeric,
        plt,
        save_figure,
        short_label,
    )
    from zerobench.analysis.pareto import STYLE_OPTIONS

    ok = frame[frame["status"] == "ok"].copy()
    if ok.empty:
        return None
    from zerobench.whatif.estimate.report import folder_unit

    unit, size = folder_unit(frame)  # the tables' unit
    ok["peak_mib"] = numeric(ok["peak_mem_bytes"]).to_numpy() / size
    ok["bound_mib"] = numeric(ok.get("analytic_model_states_bytes", ok["peak_mem_bytes"] * float("nan"))).to_numpy() / size
    dtypes = list(dict.fromkeys(ok["dtype"]))
    styles = EngineStyles()
    n_configs = ok["config"].nunique()
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(14, 4.6 * len(dtypes) + 0.16 * n_configs), squeeze=False)
    handles = {}
    for row, dtype in enumerate(dtypes):
        frame_d = ok[ok["dtype"] == dtype]
        ddp_configs = list(dict.fromkeys(frame_d.loc[frame_d["engine"] == REFERENCE_ENGINE, "config"]))
        reference = f"{REFERENCE_ENGINE}-{dtype}" if f"{REFERENCE_ENGINE}-{dtype}" in ddp_configs else \
            (ddp_configs[0] if ddp_configs else None)  # its default configuration, else its first
        ddp = frame_d[frame_d["config"] == reference].groupby("world_size")["peak_mib"].min()
        peak_ax, ratio_ax = axes[row]
        drawn: dict[tuple, str] = {}  # a line's points -> the configuration drawn with them first
        for config, group in frame_d.groupby("config", sort=False):
            group = group.sort_values("world_size")
            engine = group["engine"].iloc[0]
            style = styles.line(engine, {k: group[k].iloc[0] for k in STYLE_OPTIONS if k in group})
            ref = config == reference
            points = tuple(zip(group["world_size"], group["peak_mib"].round(6)))
            same = drawn.setdefault(points, short_label(config))
            if same != short_label(config):  # on top of an earlier line: dashed, and said in the legend
                style = {**style, "linestyle": "--", "dashes": (4, 3)}
            (h,) = peak_ax.plot(group["world_size"], group["peak_mib"], lw=2.4 if ref else 1.2, ms=5, **style)
            handles.setdefault(short_label(config) + (" (reference)" if ref else "")
                               + (f" (the same as {same})" if same != short_label(config) else "")
                               + (f" [{dtype}]" if len(dtypes) > 1 else ""), h)
            peak_ax.plot(group["world_size"], group["bound_mib"], ls="none", marker="_", ms=14, color=style["color"],
                         alpha=0.7)
            if not ddp.empty:
                ratio = group["peak_mib"].to_numpy() / group["world_size"].map(ddp).to_numpy()
                ratio_ax.plot(group["world_size"], ratio, lw=2.4 if ref else 1.2, ms=5, **style)
        lowest = frame_d.loc[frame_d.groupby("world_size")["peak_mib"].idxmin()]
        peak_ax.plot(lowest["world_size"], lowest["peak_mib"], marker="o", markersize=15, fillstyle="none",
                     color="black", linestyle="none", markeredgewidth=1.5, zorder=5)
        for ax in (peak_ax, ratio_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(frame_d["world_size"].unique()), [str(w) for w in sorted(frame_d["world_size"].unique())])
            ax.set_xlabel("world size")
            ax.grid(alpha=0.3, which="both")
        peak_ax.set_yscale("log")
        peak_ax.set_ylabel(f"per-rank peak ({unit})")
        peak_ax.set_title(f"{dtype}: per-rank peak; bars: analytic model states (the lower bound); "
                          "ringed: lowest at each world size", fontsize=9)
        ratio_ax.set_ylabel(f"peak / {short_label(reference or REFERENCE_ENGINE)}'s peak")
        ratio_ax.axhline(1.0, color="black", ls="--", lw=1)
        ratio_ax.set_title(f"{dtype}: per-rank peak as a ratio to {REFERENCE_ENGINE} (1 = no saving)", fontsize=9)
        if ddp.empty:
            ratio_ax.text(0.5, 0.5, f"no {REFERENCE_ENGINE} configuration to compare with", transform=ratio_ax.transAxes,
                          ha="center", va="center", color="gray")
    from matplotlib.lines import Line2D

    handles["analytic model states, all fp32 as the engines keep them: the lower bound (bar at each point)"] = Line2D(
        [], [], color="0.35", marker="_", linestyle="none", markersize=14)
    handles["lowest peak at its world size (ringed)"] = Line2D(
        [], [], color="black", marker="o", fillstyle="none", linestyle="none", markersize=12)
    handles[f"peak equal to {REFERENCE_ENGINE}'s (ratio 1)"] = Line2D([], [], color="black", linestyle="--", lw=1)
    ncol = 3 if len(handles) > 8 else 2
    legend_height = 0.18 * ((len(handles) + ncol - 1) // ncol) + 0.3
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    top = figure_title(fig, "estimated per-rank peak memory against world size, DDP the reference", setting)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, top))
    return save_figure(fig, path, dpi=110, tight=False)


def plot_estimate_folder(folder: Path) -> list[Path]:
    """Redraw an estimate folder's plots from its estimate.csv."""
    from zerobench.runs.kinds import workload_name
    from zerobench.runs.whatif import EstimateFolder

    folder = EstimateFolder(folder)
    frame = folder.table()
    workload = workload_name(folder.root)
    path = plot_estimate(frame, folder.plots_dir / "estimate_peak.png", estimate_setting(frame, workload))
    return [path] if path is not None else []
