"""Plots of a run (PNG, matplotlib), each with the reference engine (DDP) beside the others
and a title saying what was measured where ([Note: plot titles] in figures.py).

* ``pareto.png``: peak memory against median step time, one point per configuration,
  DDP as the reference, the Pareto front marked (zerobench/analysis/pareto.py): the plot
  to read first;
* ``step_time.png``: median step time per cell, each rank's median as a dot with its
  p10-p90 range, one panel per (world size, dtype), the reference as a dashed line;
* ``peak_memory.png``: the peak's composition (parameters, gradients, optimizer state,
  unsharded parameters, activations, other -- split by when it was allocated, and explained
  under the plot: [Note: what other holds]) on the rank with the highest peak, every rank's
  peak as a tick, the reference as a dashed line;
* ``losses.png``: the single-process reference loss per step, and each cell's distance
  from it (the curves themselves lie on top of each other);
* ``memory_timeline.png``: live tensor bytes on rank 0 over the measured step of the
  memory pass, one panel per engine and (world size, dtype), DDP in grey behind, the
  forward, backward and optimizer phases shaded, time as a fraction of the step;
* ``knobs.png`` (when the run varies them): step time, peak memory and all-gathers in
  flight against backward/forward prefetch and the rate limiter.

Every plot draws a configuration with one look ([Note: one look per configuration] in
figures.py) and a legend of every colour, marker and fill it used.

Every function reads the results table through :func:`~zerobench.analysis.figures.numeric`
and :func:`~zerobench.analysis.figures.flag`, so a missing value (a failed cell, an
axis another engine lacks) is a gap in a plot on every pandas the project allows, never
a ``TypeError`` from ``pd.NA``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from zerobench.analysis.figures import (
    REFERENCE_ENGINE,
    EngineStyles,
    Setting,
    figure_title,
    flag,
    numeric,
    plt,
    save_figure,
    short_label,
)
from zerobench.analysis.render import memory_unit
from zerobench.engines.options import axes_with_role
from zerobench.runs.folder import DamagedFile, RunFolder
from zerobench.runs.tables import cell_records, default_cells, is_reference, load_results, reference_cells
from zerobench.schema.columns import CONTEXT_COLUMNS, ID_COLUMNS, METRIC_BY_NAME, PEAK_ROLE_COLUMNS

STEP_TIME = "step_time_s"
CATEGORY_COLORS = {
    "params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868",
    "unsharded": "#8172b3", "activations": "#c44e52", "other": "#937860",
}


# -- what was measured where ------------------------------------------------------------


def run_setting(run_dir: Path, results: pd.DataFrame) -> Setting:
    """The title line of a run's plots: workload, CPU or GPU and backend, the emulated
    link (or none), world sizes ([Note: plot titles])."""
    try:
        meta = RunFolder(run_dir).meta()
    except DamagedFile:
        meta = {}
    workload = str(meta.get("workload") or (results["workload"].iloc[0] if "workload" in results and len(results)
                                             else Path(run_dir).name))
    backend = meta.get("backend") or "gloo"
    if meta.get("gpu_model"):
        device = f"{meta['gpu_model']} ({backend})"
    else:
        cpu = str(meta.get("cpu_model") or "CPU")
        device = f"CPU ({cpu}, {backend})" if not cpu.upper().startswith("CPU") else f"{cpu} ({backend})"
    sizes = tuple(sorted({int(w) for w in numeric(results["world_size"]).dropna()})) \
        if len(results) and "world_size" in results else ()
    return Setting(workload, device, link_description(results), sizes)


def link_description(results: pd.DataFrame) -> str:
    """"no emulated link", "emulated link ib-400g", "emulated 0.05 GB/s + 100 µs", or
    "emulated links: ..." when the cells differ."""
    links = set()
    for _, row in results.drop_duplicates("cell_id").iterrows() if len(results) and "cell_id" in results else ():
        preset = row.get("emulate_link")
        gbps, lat = numeric([row.get("emulate_gbps")]).iloc[0], numeric([row.get("emulate_latency_us")]).iloc[0]
        if isinstance(preset, str) and preset:
            links.add(preset)
        elif gbps == gbps and gbps > 0:
            links.add(f"{gbps:g} GB/s + {0 if lat != lat else lat:g} µs")
        else:
            links.add("")
    named = sorted(x for x in links if x)
    if not named:
        return "no emulated link"
    if len(links) == 1:
        return f"emulated {named[0]}"
    return f"emulated links: {', '.join(named)}" + (" and none" if "" in links else "")


def _groups(ok: pd.DataFrame):
    """(title, frame) per world size x dtype, cells in matrix order."""
    for (ws, dtype), frame in ok.groupby(["world_size", "dtype"], sort=True):
        yield f"world size {ws}, {dtype}", frame


def _reference_value(frame: pd.DataFrame, column: str, how: str) -> float | None:
    ref = numeric(frame.loc[reference_cells(frame["cell_id"]), column]).dropna()
    if ref.empty:
        return None
    return float(getattr(ref, how)())


def _memory_unit(results: pd.DataFrame, column: str = "peak_mem_bytes") -> tuple[str, int]:
    """The unit the run's table shows ``column`` in, for every plot of the run too
    ([Note: one unit a folder] in zerobench/analysis/render.py)."""
    ok = _ok(results, column)
    ref = ok[reference_cells(ok["cell_id"]).fillna(False).astype(bool).to_numpy()] if len(ok) else ok
    return memory_unit(numeric(ok[column]) if len(ok) else [], numeric(ref[column]) if len(ref) else [])


def _ok(results: pd.DataFrame, column: str) -> pd.DataFrame:
    if column not in results.columns:
        return results.iloc[0:0]
    return results[(results["status"] == "ok") & numeric(results[column]).notna().to_numpy()]


def _panels(ok: pd.DataFrame, legend_rows: int = 4, footnote_in: float = 0.0):
    """One horizontal-bar panel per (world size, dtype): (figure, [(ax, title, frame, cells)]).
    The figure is tall enough for its bars, for each panel's legend (``legend_rows``
    entries beside it) and for a footnote of ``footnote_in`` inches under it."""
    groups = list(_groups(ok))
    n_cells = max(f["cell_id"].nunique() for _, f in groups)
    bars = 0.45 * n_cells * len(groups)
    legends = (0.16 * legend_rows + 0.3) * len(groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 1.8 + max(bars, legends) + footnote_in), squeeze=False)
    return fig, [(ax, title, frame, list(dict.fromkeys(frame["cell_id"])))
                 for ax, (title, frame) in zip(axes[:, 0], groups)]


def _finish_panel(ax, title: str, cells: list[str], xlabel: str, styles: EngineStyles | None = None,
                  extra: tuple[list, list] = ([], [])) -> None:
    """Ticks, labels and the legend of one panel: what it drew with a label, and with
    ``styles`` a swatch of every engine colour it used ([Note: one look per configuration])."""
    ax.set_yticks(range(len(cells)), [short_label(c) for c in cells], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles + list(extra[0]), labels + list(extra[1])
    if styles is not None:
        swatches, names = styles.legend_handles(markers=False)
        handles, labels = handles + swatches, labels + names
    if handles:  # a run without the reference engine may have none
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def _save(fig, path: Path, what: str, setting: Setting | None, dpi: int = 110) -> Path:
    fig.tight_layout(rect=(0, 0, 1, figure_title(fig, what, setting)))
    return save_figure(fig, path, dpi=dpi, tight=False)


# -- the plots -----------------------------------------------------------------------------


def plot_pareto_run(results: pd.DataFrame, path: Path, setting: Setting | None = None) -> Path | None:
    """Peak memory (max over ranks) against median step time (median over ranks), one
    point per ok cell with its step-time spread (p10-p90, median over ranks), one panel
    per (world size, dtype); the front counts only time differences outside the spread."""
    from zerobench.analysis.pareto import plot_pareto

    ok = _ok(_ok(results, STEP_TIME), "peak_mem_bytes")
    if ok.empty:
        return None
    from zerobench.analysis.pareto import STYLE_OPTIONS

    unit, size = _memory_unit(results)
    rows = []
    for (ws, dtype), frame in ok.groupby(["world_size", "dtype"], sort=True):
        for cell, ranks in frame.groupby("cell_id", sort=False):
            rows.append({"group": f"world size {ws}, {dtype}", "label": short_label(cell), "engine": ranks["engine"].iloc[0],
                         "reference": is_reference(cell),
                         "step_ms": numeric(ranks[STEP_TIME]).median() * 1e3,
                         **{f"step_{q}_ms": numeric(ranks[column]).median() * 1e3 if column in ranks else float("nan")
                            for q, column in (("p10", "step_time_p10_s"), ("p90", "step_time_p90_s"))},
                         "peak": numeric(ranks["peak_mem_bytes"]).max() / size,
                         **{k: ranks[k].iloc[0] for k in STYLE_OPTIONS if k in ranks}})
    return plot_pareto(pd.DataFrame(rows), path, x="step_ms", y="peak", setting=setting,
                       x_spread=("step_p10_ms", "step_p90_ms"),
                       x_label="median step time (ms, median over ranks; bar: p10-p90)",
                       y_label=f"peak live tensor memory ({unit}, highest rank)")


def plot_step_time(results: pd.DataFrame, path: Path, setting: Setting | None = None) -> Path | None:
    ok = _ok(results, STEP_TIME)
    if ok.empty:
        return None
    fig, panels = _panels(ok)
    for ax, title, frame, cells in panels:
        styles = EngineStyles()
        for y, cell in enumerate(cells):
            ranks = frame[frame["cell_id"] == cell]
            ms = numeric(ranks[STEP_TIME]) * 1e3
            color = styles.color(ranks["engine"].iloc[0])
            ax.barh(y, ms.median(), color=color, alpha=0.35, height=0.7)
            offsets = (numeric(ranks["rank"]) - (len(ranks) - 1) / 2) * 0.15
            low = (ms - numeric(ranks.get("step_time_p10_s", ranks[STEP_TIME])) * 1e3).clip(lower=0)
            high = (numeric(ranks.get("step_time_p90_s", ranks[STEP_TIME])) * 1e3 - ms).clip(lower=0)
            ax.errorbar(ms, y + offsets.to_numpy(), xerr=[low.fillna(0), high.fillna(0)], fmt="o", color=color, ms=4,
                        capsize=2, lw=1)
        ref = _reference_value(frame, STEP_TIME, "median")
        if ref is not None:
            ax.axvline(ref * 1e3, ls="--", color="black", lw=1, label=f"{REFERENCE_ENGINE} (reference)")
        from matplotlib.lines import Line2D

        _finish_panel(ax, title, cells,
                      "step time (ms): bar = median over ranks, dots = each rank's median, whiskers = p10-p90", styles,
                      ([Line2D([], [], color="0.35", marker="o", linestyle="none", markersize=4),
                        Line2D([], [], color="0.35", marker="|", linestyle="-", lw=1, markersize=6)],
                       ["each rank's median step time", "its p10-p90 (whisker and caps)"]))
    return _save(fig, path, "median step time per cell", setting)


#: The parts of "other" by when they were allocated, each its hatch over other's colour
#: ([Note: what other holds] in zerobench/instruments/memory.py).
OTHER_PARTS = {
    "kept": ("peak_mem_other_kept_bytes", "", "other, kept from earlier steps (buckets, copies)"),
    "backward": ("peak_mem_other_backward_bytes", "//", "other, allocated in backward"),
    "optimizer": ("peak_mem_other_optimizer_bytes", "..", "other, allocated in the optimizer step"),
}
OTHER_EXPLAINED = ("other: live storages that are no parameters, gradients, optimizer state, unsharded parameters or "
                   "activations: gradient buckets and copies kept across steps, reduce-scatter inputs and gradient "
                   "temporaries of backward, the optimizer step's temporaries. On a small model it is often the largest "
                   "part besides the model states: those buffers are sized like the parameters, activations like the "
                   "batch ([Note: what other holds] in zerobench/instruments/memory.py).")


def plot_peak_memory(results: pd.DataFrame, path: Path, setting: Setting | None = None) -> Path | None:
    """The peak's composition per cell, on its highest rank; "other" split by when it was
    allocated where the run recorded it, and explained under the plot either way."""
    ok = _ok(results, "peak_mem_bytes")
    if ok.empty:
        return None
    import textwrap

    split = all(column in ok for column, _, _ in OTHER_PARTS.values())
    note = textwrap.fill(OTHER_EXPLAINED, 11 * 15)
    footnote_in = 0.16 * (note.count("\n") + 1) + 0.1
    unit, size = _memory_unit(results)
    fig, panels = _panels(ok, legend_rows=len(PEAK_ROLE_COLUMNS) + (len(OTHER_PARTS) if split else 1) + 2,
                          footnote_in=footnote_in)
    for ax, title, frame, cells in panels:
        for y, cell in enumerate(cells):
            ranks = frame[frame["cell_id"] == cell]
            peaks = numeric(ranks["peak_mem_bytes"])
            top = ranks.loc[peaks.idxmax()]
            left = 0.0
            parts = {k: numeric([top.get(c)]).fillna(0).iloc[0] for k, c in PEAK_ROLE_COLUMNS.items()}
            other = max(float(peaks.max()) - sum(parts.values()), 0.0)
            segments = [(cat, nbytes, CATEGORY_COLORS[cat], "", cat) for cat, nbytes in parts.items()]
            if split:
                segments += [(f"other_{part}", numeric([top.get(column)]).fillna(0).iloc[0], CATEGORY_COLORS["other"],
                              hatch, label) for part, (column, hatch, label) in OTHER_PARTS.items()]
            else:
                segments.append(("other", other, CATEGORY_COLORS["other"], "", "other (see below)"))
            for _, nbytes, color, hatch, label in segments:
                width = nbytes / size
                ax.barh(y, width, left=left, color=color, height=0.7, hatch=hatch, edgecolor="white" if hatch else None,
                        linewidth=0, label=label if y == 0 else None)
                left += width
            ax.plot(peaks / size, [y] * len(ranks), "k|", ms=14, mew=1.5,
                    label="each rank's peak" if y == 0 else None)
        ref = _reference_value(frame, "peak_mem_bytes", "max")
        if ref is not None:
            ax.axvline(ref / size, ls="--", color="black", lw=1, label=f"{REFERENCE_ENGINE} (reference)")
        _finish_panel(ax, title, cells, f"peak live tensor memory ({unit}), composition on the rank with the highest peak")
    fig.text(0.01, 0.005, note, fontsize=7.5, va="bottom", ha="left", color="0.25")
    bottom = footnote_in / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, figure_title(fig, "peak memory per cell and what it is made of", setting)))
    return save_figure(fig, path, dpi=110, tight=False)


def plot_losses(run_dir: Path, results: pd.DataFrame, path: Path, setting: Setting | None = None) -> Path | None:
    """Per (world size, dtype): the single-process reference loss per step (top; without
    one, the reference engine's), and each cell's largest distance from it over the
    steps, |mean loss over ranks - reference| (bottom, one bar per cell, log scale),
    beside the dtype's rounding of the loss. The cells' own loss curves would lie on
    top of the reference and of each other."""
    folder = RunFolder(run_dir)
    steps = folder.steps()
    if steps is None or steps.empty or results.empty:
        return None
    config = results.drop_duplicates("cell_id").set_index("cell_id")
    steps = steps[steps["cell_id"].isin(config.index)]
    if steps.empty:
        return None
    reference = {str(k): v for k, v in folder.references().items()}
    warmup = _warmup_steps(folder)
    steps = steps.assign(loss=numeric(steps["loss"]).to_numpy(), step=numeric(steps["step"]).to_numpy())
    mean = steps.groupby(["cell_id", "step"], sort=False)["loss"].mean().reset_index()
    mean["step"] = (mean["step"] + warmup).astype(int)
    groups = sorted({(int(config.loc[c, "world_size"]), str(config.loc[c, "dtype"])) for c in mean["cell_id"].unique()})
    cells_of = {g: [c for c in dict.fromkeys(mean["cell_id"])
                    if (int(config.loc[c, "world_size"]), str(config.loc[c, "dtype"])) == g] for g in groups}
    n = max(len(c) for c in cells_of.values())
    fig, axes = plt.subplots(2, len(groups), figsize=(6.8 * len(groups), 3.2 + 0.3 * n), squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 0.3 * n + 0.8]})
    for col, group in enumerate(groups):
        ws, dtype = group
        styles = EngineStyles()
        top, bottom = axes[0, col], axes[1, col]
        cells = cells_of[group]
        ref = reference.get(str(ws))
        if ref:
            ref_series, ref_name = pd.Series(ref, dtype="float64"), "single-process reference (fp32)"
        else:
            base = [c for c in cells if is_reference(c)] or cells[:1]
            frame = mean[mean["cell_id"] == base[0]]
            ref_series = pd.Series(frame["loss"].to_numpy(), index=frame["step"].to_numpy())
            ref_name = f"{short_label(base[0])} (no single-process reference)"
        top.plot(ref_series.index, ref_series.to_numpy(), "k-", lw=1.5, label=ref_name)
        top.axvspan(-0.5, warmup - 0.5, color="gray", alpha=0.12, label="warm-up (not compared)")
        top.set_title(f"world size {ws}, {dtype}", fontsize=10)
        top.set_xlabel("step", fontsize=8)
        top.set_ylabel("loss")
        top.grid(alpha=0.3)
        top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curve, not on it
        worst = []
        for cell in cells:
            frame = mean[mean["cell_id"] == cell]
            dev = (frame["loss"].to_numpy() - ref_series.reindex(frame["step"].to_numpy()).to_numpy())
            worst.append(float(pd.Series(abs(dev)).max()))
        floor = 1e-12
        y = range(len(cells))
        bottom.barh(list(y), [max(w, floor) if w == w else floor for w in worst], height=0.7,
                    color=[styles.color(str(config.loc[c, "engine"])) for c in cells])
        for yi, w in zip(y, worst):
            bottom.annotate("no reference" if w != w else ("0 (equal)" if w == 0 else f"{w:.1e}"),
                            (max(w, floor) if w == w else floor, yi), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=7)
        rounding = {"bf16": 2.0**-8, "fp32": 2.0**-23}.get(dtype)
        if rounding:
            level = rounding * float(abs(ref_series).mean())
            bottom.axvline(level, color="black", ls="--", lw=1)
            bottom.text(level, 1.01, f" {dtype} rounding of the loss", transform=bottom.get_xaxis_transform(),
                        fontsize=7, va="bottom")
        bottom.set_xscale("log")
        # two decades past the largest bar: room for its value label inside the panel
        bottom.set_xlim(floor / 2, max([w for w in worst if w == w] + [rounding or 0, 1e-6]) * 300)
        bottom.set_yticks(list(y), [short_label(c) for c in cells], fontsize=7)
        bottom.invert_yaxis()
        bottom.set_xlabel("largest |mean loss over ranks - reference| over the measured steps", fontsize=8)
        bottom.grid(axis="x", alpha=0.3)
        bottom.legend(*styles.legend_handles(markers=False), fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      title="engine", title_fontsize=6)  # beside the bars: never over their values
    return _save(fig, path, "losses: the reference (top) and how far each cell strays from it (bottom)", setting)


def _warmup_steps(folder: RunFolder) -> int:
    """The run's warm-up steps (0 when its workload.json cannot be read)."""
    try:
        return folder.workload().data.warmup_steps
    except (OSError, ValueError):  # DamagedFile and WorkloadError are ValueErrors
        return 0


#: The phases of a step as memory_timeline.png shades them (the tracker's phase names).
PHASES = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#dcefd8"}


def plot_memory_timelines(run_dir: Path, path: Path, setting: Setting | None = None) -> Path | None:
    """Live tensor bytes (rank 0, memory pass) over the measured step: one panel per engine
    (rows) and (world size, dtype) (columns), each configuration a line in the engine's
    colour and its sharding's line style ([Note: one look per configuration]), DDP as a thin
    grey line in every panel; the phases of the step (forward, backward, optimizer) shaded as
    the panel's first configuration ran them, the others' phase starts as ticks on their
    lines. Time is a fraction of the step, since the tracker's overhead makes absolute times
    differ between engines."""
    records = [r for r in cell_records(run_dir) if r["status"] == "ok" and r.get("ranks")
               and r["ranks"][0].get("timeline")]
    if not records:
        return None
    try:
        unit, size = _memory_unit(load_results(run_dir))
    except (OSError, ValueError, DamagedFile):  # no table to read the unit from: the timelines' own scale
        unit, size = "MiB", 2**20
    groups = sorted({(r["config"].get("world_size"), r["config"].get("dtype")) for r in records}, key=str)
    order = {e: i for i, e in enumerate(EngineStyles.ENGINE_ORDER)}
    engines = sorted({r["config"].get("engine", "") for r in records}, key=lambda e: (order.get(e, len(order)), e))
    styles = EngineStyles()
    fig, axes = plt.subplots(len(engines), len(groups), figsize=(7 * len(groups) + 4, 1.9 * len(engines) + 1.6),
                             squeeze=False, sharex=True)
    any_phases = False
    for col, group in enumerate(groups):
        in_group = [r for r in records if (r["config"].get("world_size"), r["config"].get("dtype")) == group]
        reference = next((r for r in in_group if r["config"].get("engine") == REFERENCE_ENGINE
                          and is_reference(r["cell_id"])), None)
        for row, engine in enumerate(engines):
            ax = axes[row, col]
            mine = [r for r in in_group if r["config"].get("engine") == engine]
            if reference is not None and engine != REFERENCE_ENGINE:
                t, live = _timeline(reference, size)
                ax.step(t, live, where="post", color="0.6", lw=0.8, label=f"{REFERENCE_ENGINE} (reference)")
            for i, rec in enumerate(mine):
                t, live = _timeline(rec, size)
                style = styles.line(engine, rec["config"])
                (line,) = ax.step(t, live, where="post", lw=1.3, color=style["color"], linestyle=style["linestyle"],
                                  label=short_label(rec["cell_id"]), gid=rec["cell_id"])
                marks = _phase_marks(rec)
                any_phases |= bool(marks)
                if i == 0:
                    _shade_phases(ax, marks)
                else:
                    for name, x in marks:
                        if name in PHASES:
                            ax.axvline(x, color=style["color"], linestyle=style["linestyle"], lw=0.7, alpha=0.7)
            if not mine:
                ax.text(0.5, 0.5, f"no {engine} cell at world size {group[0]}, {group[1]}", transform=ax.transAxes,
                        ha="center", va="center", fontsize=8, color="gray")
            if row == 0:
                ax.set_title(f"world size {group[0]}, {group[1]}", fontsize=10)
            if col == 0:
                ax.set_ylabel(f"{engine}\n{unit}, rank 0", fontsize=8)
            ax.grid(alpha=0.3)
            ax.set_xlim(0, 1)
            if mine:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6.5)
    for ax in axes[-1]:
        ax.set_xlabel("fraction of the measured step (memory pass)", fontsize=8)
    from matplotlib.patches import Patch

    handles, names = styles.legend_handles(markers=False, lines=True)
    if any_phases:
        handles += [Patch(color=color) for color in PHASES.values()]
        names += [f"{phase} phase" for phase in PHASES]
        handles.append(Patch(color="white"))
        names.append("shaded: the phases of a panel's first line; thin vertical lines: where the others' start")
    else:
        names.append("phases not recorded (a run made before the memory pass kept them)")
        handles.append(Patch(color="white"))
    ncol = 2
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=7.5, frameon=False)
    bottom = (0.2 * -(-len(handles) // ncol) + 0.25) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, figure_title(
        fig, "live tensor memory over one step, per engine (peak_memory.png: what it is made of at the peak)", setting)))
    return save_figure(fig, path, dpi=100, tight=False)


def _timeline(record: dict, size: int = 2**20) -> tuple[pd.Series, pd.Series]:
    """(time as a fraction of the step, live bytes in units of ``size``) of a cell's rank 0."""
    tl = pd.DataFrame(record["ranks"][0]["timeline"])
    cats = [c for c in CATEGORY_COLORS if c in tl.columns]
    t = numeric(tl["t_s"])
    span = _span(record, t)
    return (t - t.min()) / span, sum(numeric(tl[c]).fillna(0) for c in cats) / size


def _span(record: dict, t: pd.Series) -> float:
    ends = [x for x, name in (record["ranks"][0].get("phases") or []) if name == "after"]
    return (max([t.max(), *ends]) - t.min()) or 1.0


def _phase_marks(record: dict) -> list[tuple[str, float]]:
    """(phase, its start as a fraction of the step) of a cell's rank 0 ([] when not recorded)."""
    phases = record["ranks"][0].get("phases") or []
    if not phases:
        return []
    t = numeric(pd.DataFrame(record["ranks"][0]["timeline"])["t_s"])
    span, start = _span(record, t), t.min()
    return [(name, (x - start) / span) for x, name in phases]


def _shade_phases(ax, marks: list[tuple[str, float]]) -> None:
    """Shade each phase from its start to the next mark, named at the panel's top."""
    for (name, x0), (_, x1) in zip(marks, [*marks[1:], ("end", 1.0)]):
        if name in PHASES and x1 > x0:
            ax.axvspan(x0, x1, color=PHASES[name], zorder=0, gid=f"phase:{name}")
            ax.text((x0 + x1) / 2, 0.98, name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=6.5, color="0.3")


KNOB_AXES = axes_with_role("schedule")  # prefetch and the limiter (zerobench/engines/options.py)


def _knob_label(row) -> str:
    return f"bwd {row.get('backward_prefetch')}\nfwd {'on' if flag(row.get('forward_prefetch')) else 'off'}"


def _limiter_label(row) -> str:
    if not flag(row.get("limit_all_gathers")):
        return "limiter off"
    depth = numeric([row.get("limiter_depth")]).iloc[0]
    return "limiter on" + (f" (depth {int(depth)})" if depth == depth else "")


def _setting_columns(frame: pd.DataFrame) -> list[str]:
    """Configuration columns (not metrics, ids or knobs) that vary between the cells of
    ``frame``: another setting of the same study (the link, a sharding strategy)."""
    skip = set(ID_COLUMNS) | set(CONTEXT_COLUMNS) | set(KNOB_AXES) | {"cell_id"}
    out = []
    for col in frame.columns:
        if col in skip or col in METRIC_BY_NAME or (not col.startswith("emulate_")
                                                     and col.endswith(("_s", "_bytes", "_pct", "_gbps", "_trace"))):
            continue
        per_cell = frame.groupby("cell_id", sort=False)[col].first()
        if per_cell.astype(str).nunique() > 1:
            out.append(col)
    return out


def _setting_label(column: str, value) -> str:
    """``sharding_strategy`` by its value alone, a link by its numbers, others as name=value."""
    if column == "sharding_strategy":
        return str(value)
    if column == "emulate_gbps":
        return f"{value:g} GB/s" if isinstance(value, float) else f"{value} GB/s"
    if column == "emulate_latency_us":
        return f"{value:g} µs" if isinstance(value, float) else f"{value} µs"
    return f"{column}={value}"


def plot_knobs(results: pd.DataFrame, path: Path, setting: Setting | None = None) -> Path | None:
    """Step time, peak memory and all-gathers in flight against backward/forward
    prefetch (x) and the rate limiter (one line per setting, and per value of any other
    setting the engine's cells vary), per FSDP engine whose knobs the run varies; DDP
    and fully_shard's default cell as dashed references."""
    ok = _ok(results, STEP_TIME)
    knob_cols = [c for c in KNOB_AXES if c in ok.columns]
    if not knob_cols or ok.empty:
        return None
    engines = [e for e, f in ok.groupby("engine") if len(f.drop_duplicates(knob_cols)) > 1
               and f["backward_prefetch"].notna().all()]
    if not engines:
        return None
    unit, size = _memory_unit(results)
    metrics = [(m, scale, label) for m, scale, label in (
        (STEP_TIME, 1e3, "median step time (ms)"),
        ("peak_mem_bytes", 1 / size, f"peak memory ({unit})"),
        ("max_inflight_all_gathers", 1, "max all-gathers in flight"),
    ) if m in ok.columns and numeric(ok[m]).notna().any()]
    fig, axes = plt.subplots(len(metrics), len(engines), figsize=(6.5 * len(engines) + 1.5, 2.8 * len(metrics) + 0.8),
                             squeeze=False, sharex="col")
    refs = {name: ok[default_cells(ok["cell_id"], name)]
            for name in (REFERENCE_ENGINE, "torch-fsdp2")}
    for col, engine in enumerate(engines):
        frame = ok[ok["engine"] == engine]
        others = _setting_columns(frame)
        cells = []
        for cell, ranks in frame.groupby("cell_id", sort=False):
            first = ranks.iloc[0]
            row = {m: (numeric(ranks[m]).median() if m == STEP_TIME else numeric(ranks[m]).max()) for m, _, _ in metrics}
            row.update(x=_knob_label(first), series=", ".join([_limiter_label(first)]
                                                               + [_setting_label(c, first[c]) for c in others]),
                       order=({"none": 0, "pre": 1, "post": 2}.get(str(first.get("backward_prefetch")), 3)
                              + 10 * flag(first.get("forward_prefetch"))))
            cells.append(row)
        per_cell = pd.DataFrame(cells)
        if per_cell["x"].nunique() == 1:  # prefetch fixed: the limiter (and other settings) along x instead
            fixed = per_cell["x"].iloc[0].replace("\n", ", ")
            per_cell = per_cell.assign(x=per_cell["series"].str.replace(", ", "\n"), series=fixed,
                                       order=range(len(per_cell))).sort_values("x")
        xs = list(dict.fromkeys(per_cell.sort_values("order")["x"]))
        for r, (metric, scale, label) in enumerate(metrics):
            ax = axes[r, col]
            for series, sf in per_cell.groupby("series", sort=True):
                sf = sf.groupby("x", sort=False)[metric].median().reindex(xs)
                ax.plot(range(len(xs)), sf.to_numpy() * scale, "o-", label=series, ms=5)
            if per_cell[metric].isna().all():
                ax.text(0.5, 0.5, f"not recorded for {engine}", transform=ax.transAxes, ha="center", va="center",
                        fontsize=9, color="gray")
            for name, ref in refs.items():
                values = numeric(ref[metric]).dropna() if metric in ref else pd.Series(dtype="float64")
                if name != engine and not values.empty:
                    value = values.median() if metric == STEP_TIME else values.max()
                    ax.axhline(value * scale, ls="--", lw=1, color="black" if name == REFERENCE_ENGINE else "gray",
                               label=f"{name} (reference)")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            if r == 0:
                ax.set_title(engine, fontsize=10)
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            ax.set_xticks(range(len(xs)), xs, fontsize=7)
    return _save(fig, path, "prefetch and the all-gather rate limiter", setting)


def plot_run(run_dir: Path, progress=None) -> list[Path]:
    """Draw every plot of the run into ``<run>/plots/``; returns the files written.
    ``progress``: told each plot as it is drawn (zerobench.commands.progress.Progress)."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    setting = run_setting(run_dir, results)
    folder = RunFolder(run_dir)
    plots = [
        ("pareto.png", lambda path: plot_pareto_run(results, path, setting)),
        ("step_time.png", lambda path: plot_step_time(results, path, setting)),
        ("peak_memory.png", lambda path: plot_peak_memory(results, path, setting)),
        ("losses.png", lambda path: plot_losses(run_dir, results, path, setting)),
        ("memory_timeline.png", lambda path: plot_memory_timelines(run_dir, path, setting)),
        ("knobs.png", lambda path: plot_knobs(results, path, setting)),
    ]
    if progress is not None:
        progress.set_total(len(plots))
    drawn = []
    for name, draw in plots:
        drawn.append(draw(folder.plot_path(name)))
        if progress is not None:
            progress.advance(name)
    return [p for p in drawn if p is not None]
