"""Plots of a run (PNG, matplotlib), each with the reference engine beside the others.

* ``step_time.png``: median step time per cell, each rank's median as a dot with its
  p10-p90 range, one panel per (world size, dtype), the reference as a dashed line;
* ``peak_memory.png``: the peak's composition (parameters, gradients, optimizer state,
  unsharded parameters, activations, other) on the rank with the highest peak, every
  rank's peak as a dot, the reference as a dashed line;
* ``losses.png``: the mean loss over ranks per step, beside the single-process reference;
* ``memory_timeline.png``: live tensor bytes over the measured step, by category (rank 0);
* ``knobs.png`` (when the run varies them): step time, peak memory and all-gathers in
  flight against backward/forward prefetch and the rate limiter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from zerobench.analysis.figures import plt, save_figure
from zerobench.runs.tables import REFERENCE_ENGINE, cell_records, load_results, reference_cells
from zerobench.runs.folder import RunFolder
CATEGORY_COLORS = {
    "params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868",
    "unsharded": "#8172b3", "activations": "#c44e52", "other": "#937860",
}
CATEGORY_COLUMNS = {
    "params": "peak_mem_params_bytes", "grads": "peak_mem_grads_bytes", "optim": "peak_mem_optim_bytes",
    "unsharded": "peak_mem_unsharded_bytes", "activations": "peak_mem_activations_bytes",
}


def _engine_colors(engines) -> dict[str, str]:
    palette = plt.get_cmap("tab10").colors
    return {e: palette[i % len(palette)] for i, e in enumerate(sorted(set(engines)))}


def _groups(ok: pd.DataFrame):
    """(title, frame) per world size x dtype, cells in matrix order."""
    for (ws, dtype), frame in ok.groupby(["world_size", "dtype"], sort=True):
        yield f"world size {ws}, {dtype}", frame


def _reference_value(frame: pd.DataFrame, column: str, how: str) -> float | None:
    ref = frame[reference_cells(frame["cell_id"])]
    if ref.empty:
        return None
    return float(getattr(ref[column], how)())


def _ok(results: pd.DataFrame, column: str) -> pd.DataFrame:
    if column not in results.columns:
        return results.iloc[0:0]
    return results[(results["status"] == "ok") & results[column].notna()]


def _panels(ok: pd.DataFrame):
    """One horizontal-bar panel per (world size, dtype): (figure, [(ax, title, frame, cells)])."""
    groups = list(_groups(ok))
    n_cells = max(f["cell_id"].nunique() for _, f in groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 1.3 + 0.45 * n_cells * len(groups)), squeeze=False)
    return fig, [(ax, title, frame, list(dict.fromkeys(frame["cell_id"])))
                 for ax, (title, frame) in zip(axes[:, 0], groups)]


def _finish_panel(ax, title: str, cells: list[str], xlabel: str) -> None:
    ax.set_yticks(range(len(cells)), cells, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run without the reference engine may have none
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def plot_step_time(results: pd.DataFrame, path: Path) -> Path | None:
    ok = _ok(results, "step_time_s")
    if ok.empty:
        return None
    colors = _engine_colors(ok["engine"])
    fig, panels = _panels(ok)
    for ax, title, frame, cells in panels:
        for y, cell in enumerate(cells):
            ranks = frame[frame["cell_id"] == cell]
            ms = ranks["step_time_s"] * 1e3
            engine = ranks["engine"].iloc[0]
            ax.barh(y, ms.median(), color=colors[engine], alpha=0.35, height=0.7)
            offsets = (ranks["rank"] - (len(ranks) - 1) / 2) * 0.15
            ax.errorbar(ms, y + offsets, xerr=[ms - ranks["step_time_p10_s"] * 1e3, ranks["step_time_p90_s"] * 1e3 - ms],
                        fmt="o", color=colors[engine], ms=4, capsize=2, lw=1)
        ref = _reference_value(frame, "step_time_s", "median")
        if ref is not None:
            ax.axvline(ref * 1e3, ls="--", color="black", lw=1, label=f"{REFERENCE_ENGINE} (reference)")
        _finish_panel(ax, title, cells,
                      "step time (ms): bar = median over ranks, dots = each rank's median, whiskers = p10-p90")
    return save_figure(fig, path)


def plot_peak_memory(results: pd.DataFrame, path: Path) -> Path | None:
    ok = _ok(results, "peak_mem_bytes")
    if ok.empty:
        return None
    fig, panels = _panels(ok)
    for ax, title, frame, cells in panels:
        for y, cell in enumerate(cells):
            ranks = frame[frame["cell_id"] == cell]
            top = ranks.loc[ranks["peak_mem_bytes"].idxmax()]
            left = 0.0
            parts = {k: float(top.get(c, 0) or 0) for k, c in CATEGORY_COLUMNS.items()}
            parts["other"] = float(top["peak_mem_bytes"]) - sum(parts.values())
            for cat, nbytes in parts.items():
                mib = nbytes / 2**20
                ax.barh(y, mib, left=left, color=CATEGORY_COLORS[cat], height=0.7,
                        label=cat if y == 0 else None)
                left += mib
            ax.plot(ranks["peak_mem_bytes"] / 2**20, [y] * len(ranks), "k|", ms=14, mew=1.5,
                    label="each rank's peak" if y == 0 else None)
        ref = _reference_value(frame, "peak_mem_bytes", "max")
        if ref is not None:
            ax.axvline(ref / 2**20, ls="--", color="black", lw=1, label=f"{REFERENCE_ENGINE} (reference)")
        _finish_panel(ax, title, cells, "peak live tensor memory (MiB), composition on the rank with the highest peak")
    return save_figure(fig, path)


def plot_losses(run_dir: Path, results: pd.DataFrame, path: Path) -> Path | None:
    folder = RunFolder(run_dir)
    steps = folder.steps()
    if steps is None or steps.empty:
        return None
    config = results.drop_duplicates("cell_id").set_index("cell_id")
    reference = {str(k): v for k, v in folder.references().items()}
    warmup = json.loads((run_dir / "workload.json").read_text())["data"]["warmup_steps"]
    mean = steps.groupby(["cell_id", "step"], sort=False)["loss"].mean().reset_index()
    groups = sorted({(int(config.loc[c, "world_size"]), config.loc[c, "dtype"]) for c in mean["cell_id"].unique()})
    colors = _engine_colors(config["engine"])
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, (ws, dtype) in zip(axes[0], groups):
        for cell, frame in mean.groupby("cell_id", sort=False):
            if (int(config.loc[cell, "world_size"]), config.loc[cell, "dtype"]) != (ws, dtype):
                continue
            ax.plot(frame["step"] + warmup, frame["loss"], color=colors[config.loc[cell, "engine"]], lw=1, alpha=0.8,
                    label=cell)
        ref = reference.get(str(ws))
        if ref:
            ax.plot(range(len(ref)), ref, "k--", lw=1.5, label="single-process reference (fp32)")
        ax.set_title(f"world size {ws}, {dtype}", fontsize=10)
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel("loss (mean over ranks)")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)


def plot_memory_timelines(run_dir: Path, path: Path) -> Path | None:
    records = [r for r in cell_records(run_dir) if r["status"] == "ok" and r["ranks"] and r["ranks"][0].get("timeline")]
    if not records:
        return None
    ncols = 3
    nrows = (len(records) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3 * nrows), squeeze=False, sharey=True)
    for ax, rec in zip(axes.flat, records):
        tl = pd.DataFrame(rec["ranks"][0]["timeline"])
        cats = [c for c in CATEGORY_COLORS if c in tl.columns]
        ax.stackplot(tl["t_s"] * 1e3, *[tl[c] / 2**20 for c in cats], labels=cats,
                     colors=[CATEGORY_COLORS[c] for c in cats], step="post")
        ax.set_title(rec["cell_id"], fontsize=8)
        ax.set_xlabel("ms into the step (memory pass, tracker overhead included)", fontsize=7)
        ax.set_ylabel("MiB (rank 0)", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    return save_figure(fig, path, dpi=100)


KNOB_AXES = ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "limiter_depth")


def _knob_label(row) -> str:
    fwd = "fwd on" if str(row.get("forward_prefetch")) == "True" else "fwd off"
    return f"bwd {row.get('backward_prefetch')}\n{fwd}"


def _limiter_label(row) -> str:
    if str(row.get("limit_all_gathers")) != "True":
        return "limiter off"
    depth = row.get("limiter_depth")
    return "limiter on" + (f" (depth {int(depth)})" if pd.notna(depth) else "")


def plot_knobs(results: pd.DataFrame, path: Path) -> Path | None:
    """Step time, peak memory and all-gathers in flight against backward/forward
    prefetch (x) and the rate limiter (one line per setting), per FSDP engine whose
    knobs the run varies; DDP and fully_shard's default cell as dashed references."""
    ok = _ok(results, "step_time_s")
    knob_cols = [c for c in KNOB_AXES if c in ok.columns]
    engines = [e for e, f in ok.groupby("engine") if knob_cols and len(f.drop_duplicates(knob_cols)) > 1
               and f["backward_prefetch"].notna().all()]
    if not engines:
        return None
    metrics = [(m, scale, label) for m, scale, label in (
        ("step_time_s", 1e3, "median step time (ms)"),
        ("peak_mem_bytes", 2**-20, "peak memory (MiB)"),
        ("max_inflight_all_gathers", 1, "max all-gathers in flight"),
    ) if m in ok.columns]
    fig, axes = plt.subplots(len(metrics), len(engines), figsize=(6.5 * len(engines), 2.8 * len(metrics)),
                             squeeze=False, sharex="col")
    refs = {name: ok[ok["cell_id"].str.fullmatch(rf"{name}-ws\d+-\w+")] for name in (REFERENCE_ENGINE, "torch-fsdp2")}
    for col, engine in enumerate(engines):
        frame = ok[ok["engine"] == engine]
        per_cell = frame.groupby("cell_id", sort=False).agg(
            {**{m: ("max" if m != "step_time_s" else "median") for m, _, _ in metrics if m in frame},
             **{k: "first" for k in knob_cols}}).reset_index()
        per_cell["x"] = per_cell.apply(_knob_label, axis=1)
        per_cell["series"] = per_cell.apply(_limiter_label, axis=1)
        prefetch_order = {"none": 0, "pre": 1, "post": 2}
        per_cell["_order"] = per_cell["backward_prefetch"].map(prefetch_order).fillna(3) \
            + 10 * (per_cell["forward_prefetch"].astype(str) == "True")
        xs = list(dict.fromkeys(per_cell.sort_values("_order")["x"]))
        for row, (metric, scale, label) in enumerate(metrics):
            ax = axes[row, col]
            for series, sf in per_cell.groupby("series", sort=True):
                sf = sf.set_index("x").reindex(xs)
                ax.plot(range(len(xs)), sf[metric] * scale, "o-", label=series, ms=5)
            for name, ref in refs.items():
                if metric in ref and not ref.empty and name != engine:
                    value = ref[metric].median() if metric == "step_time_s" else ref[metric].max()
                    ax.axhline(value * scale, ls="--", lw=1, color="black" if name == "ddp" else "gray",
                               label=f"{name} (reference)")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(engine, fontsize=10)
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            ax.set_xticks(range(len(xs)), xs, fontsize=7)
    return save_figure(fig, path, dpi=110)


def plot_run(run_dir: Path) -> list[Path]:
    """Draw every plot of the run into ``<run>/plots/``; returns the files written."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    drawn = [
        plot_step_time(results, out / "step_time.png"),
        plot_peak_memory(results, out / "peak_memory.png"),
        plot_losses(run_dir, results, out / "losses.png"),
        plot_memory_timelines(run_dir, out / "memory_timeline.png"),
        plot_knobs(results, out / "knobs.png"),
    ]
    return [p for p in drawn if p is not None]
