"""A prediction's plots, each titled with the workload, the GPU and host presets, the
links and the world sizes ([Note: plot titles] in zerobench/analysis/figures.py):

* ``pareto.png``: predicted peak reserved memory against predicted step time, one
  point per configuration, one panel per world size, DDP as the reference and the
  Pareto front marked (zerobench/analysis/pareto.py);
* ``predict.png``: step time (with its exposed communication) and peak active /
  reserved memory per configuration and world size.
"""

from __future__ import annotations

from pathlib import Path


def predict_setting(frame, workload: str):
    """The title line of a prediction's plots."""
    from zerobench.analysis.figures import Setting

    def one(column, default=""):
        values = [str(v) for v in dict.fromkeys(frame[column].dropna())] if column in frame else []
        return ", ".join(v for v in values if v) or default

    device = f"virtual {one('gpu', 'GPU')}, {one('host', 'fast')} host"
    link = one("link", "no link")
    inter = one("inter_link")
    sizes = tuple(sorted({int(w) for w in frame["world_size"]}))
    return Setting(workload, device, link + (f" (inter-node {inter})" if inter else ""), sizes)


def plot_predict(frame, path: Path, setting=None) -> Path | None:
    from zerobench.analysis.figures import figure_title, numeric, plt, save_figure
    from zerobench.whatif.predict.report import folder_unit

    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return None
    unit, size = folder_unit(frame)  # the table's unit
    sizes = sorted(ok["world_size"].unique())
    configs = list(dict.fromkeys(ok["config"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * len(configs) * len(sizes) + 2.8))
    labels, steps, exposed, active, reserved = [], [], [], [], []
    for config in configs:
        for ws in sizes:
            row = ok[(ok["config"] == config) & (ok["world_size"] == ws)]
            if row.empty:
                continue
            r = row.iloc[0]
            labels.append(f"{config} ws{ws}")
            steps.append(numeric([r["step_time_s"]]).iloc[0] * 1e3)
            exposed.append(numeric([r["exposed_comm_s"]]).iloc[0] * 1e3)
            active.append(numeric([r["peak_active_bytes"]]).iloc[0] / size)
            reserved.append(numeric([r["peak_reserved_bytes"]]).iloc[0] / size)
    y = range(len(labels))
    axes[0].barh(y, steps, color="tab:blue", label="step")
    axes[0].barh(y, exposed, color="tab:red", label="exposed communication")
    axes[0].set_xlabel("ms per step")
    axes[0].set_yticks(list(y), labels, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    axes[1].barh(y, reserved, color="tab:gray", label="peak reserved")
    axes[1].barh(y, active, color="tab:green", label="peak active")
    axes[1].set_xlabel(f"{unit} per rank")
    axes[1].set_yticks(list(y), [])
    axes[1].invert_yaxis()
    axes[1].legend(loc="lower right", fontsize=8)
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    top = figure_title(fig, "predicted on the virtual GPU: step time and allocator peaks per rank", setting)
    fig.tight_layout(rect=(0, 0, 1, top))
    return save_figure(fig, path, tight=False)


def plot_predict_pareto(frame, path: Path, setting=None) -> Path | None:
    """Predicted peak reserved memory against predicted step time, per world size (and
    dtype, where the prediction has several)."""
    import pandas as pd

    from zerobench.analysis.figures import REFERENCE_ENGINE, short_label
    from zerobench.analysis.pareto import STYLE_OPTIONS, plot_pareto

    ok = frame[frame["status"] == "ok"]
    if ok.empty:
        return None
    from zerobench.whatif.predict.report import folder_unit

    unit, size = folder_unit(frame)  # the table's unit
    mixed = ok["dtype"].nunique() > 1  # a panel per world size and dtype: fp32 and bf16 are not one choice
    points = pd.DataFrame({
        "group": [f"world size {ws}" + (f", {d}" if mixed else "") for ws, d in zip(ok["world_size"], ok["dtype"])],
        "label": [short_label(c) for c in ok["config"]],
        "engine": ok["engine"].to_numpy(),
        "reference": [c.startswith(f"{REFERENCE_ENGINE}-") and c.count("=") == 0 for c in ok["config"]],
        "step_ms": pd.to_numeric(ok["step_time_s"], errors="coerce").to_numpy() * 1e3,
        "reserved": pd.to_numeric(ok["peak_reserved_bytes"], errors="coerce").to_numpy() / size,
        **{k: ok[k].to_numpy() for k in STYLE_OPTIONS if k in ok},  # the look of each point
    })
    points = points.sort_values("group", key=lambda g: g.str.extract(r"(\d+)")[0].astype(int), kind="stable")
    return plot_pareto(points, path, x="step_ms", y="reserved", setting=setting,
                       x_label="predicted step time (ms)", y_label=f"predicted peak reserved memory ({unit} per rank)",
                       what="predicted peak memory against step time, one point per configuration")


def plot_predict_all(frame, folder: Path, workload: str) -> list[Path]:
    """Every plot of a prediction into ``folder/plots/``; returns the files written."""
    setting = predict_setting(frame, workload)
    drawn = [plot_predict_pareto(frame, Path(folder) / "plots" / "pareto.png", setting),
             plot_predict(frame, Path(folder) / "plots" / "predict.png", setting)]
    return [p for p in drawn if p is not None]


def plot_predict_folder(folder: Path) -> list[Path]:
    """Redraw a predict folder's plots from its predict.csv."""
    from zerobench.runs.kinds import workload_name
    from zerobench.runs.whatif import PredictFolder

    frame = PredictFolder(folder).table()
    return plot_predict_all(frame, Path(folder), workload_name(Path(folder)))
