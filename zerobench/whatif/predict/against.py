"""``zerobench predict WORKLOAD --against RUN``: a measured run beside its prediction, kernel
class by kernel class, so a user sees where the real run lost time.

RUN is a ``zerobench run --profile`` folder (traces/<cell>/rank<r>.json.gz, from
``torch.profiler``; docs/profiling.md); the prediction is the virtual GPU's trace of the
same cell (predict's traces/<cell>.trace.json.gz). Both are read by the same analysis
(zerobench/analysis/profiling/kernels.py, [Note: kernel classes in a trace]): per step,
the busy time of each kernel class (gemm, attention, optimizer, elementwise, copy,
collective, other), the communication nothing hides (``exposed_comm_s``), the time the
device did nothing (``host_idle_s``: on a GPU, waiting for its host) and the traced
step; then the timed step of each (the run's timing pass, unslowed by the profiler,
and predict's ``step_time_s``). Out come ``against.csv`` (one row per cell and
quantity: measured, predicted, error), ``against.md`` and ``plots/against.png``.

    python -m zerobench.whatif.predict.against RUN PREDICT_DIR [OUT_DIR]

[Note: the profiler's own cost]
A traced step runs longer than a timed one: the profiler records every operator and
every launch on the host (CUPTI's callbacks, the recorded shapes), which the kernels do
not feel. On the H200 the shared run's DDP step was 206.5 ms traced and 202.8 ms timed;
a held-out impl-zero2 step 283 against 188. The device's busy time is the same in both,
so the difference lands in the device's idle time, and the idle a trace shows is partly
the profiler's. ``--against`` shows both steps, their difference (``profiler_s``: the
profiler's own cost, at least: a cost paid while the device was busy anyway is hidden)
and the idle less it (``host_idle_timed_s``: what the host leaves idle in a timed step,
on the assumption that kernels are not slower under the profiler). The virtual GPU runs
no profiler: its difference is zero but for the end of the trace.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from zerobench.instruments.vgpu.kernel_classes import KERNEL_CLASSES

#: (quantity in the breakdown, its label), in the order of the table and the plot.
QUANTITIES: tuple[tuple[str, str], ...] = (
    *((f"{c}_s", c) for c in KERNEL_CLASSES),
    ("exposed_comm_s", "exposed communication"),
    ("host_idle_s", "device idle (waiting on the host)"),
    ("profiler_s", "the profiler's own cost (traced - timed step)"),
    ("host_idle_timed_s", "device idle, the host's (less the profiler's cost)"),
    ("step_s", "step (traced)"),
    ("step_time_s", "step (timed)"),
)


#: The host's rows, after the device's: what the host did in the step, measured (a trace's
#: main thread less its synchronize calls) and predicted (predict.csv), then the predicted
#: host's time by share (what a trace cannot tell apart).
HOST_QUANTITIES: tuple[tuple[str, str], ...] = (
    ("host_busy_s", "host busy (not in a synchronize)"),
    ("device_busy_s", "device busy"),
    ("host_operators_s", "host: operators"),
    ("host_python_s", "host: Python"),
    ("host_streams_s", "host: stream and event calls"),
    ("host_collectives_s", "host: collective calls"),
    ("host_cpu_s", "host: computing on host memory"),
)


class AgainstError(ValueError):
    """A folder ``--against`` cannot use (bad input: the CLI exits 2)."""


def run_cells(run_dir: Path, rank: int = 0) -> dict[str, Path]:
    """cell_id -> the trace of ``rank`` of every traced cell of a run folder; an error
    naming the folder when it has none (run it with ``--profile``)."""
    from zerobench.runs.folder import RunFolder

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AgainstError(f"--against: {run_dir} is not a folder (a `zerobench run --profile` folder)")
    traces = {cell: path for cell, r, path in RunFolder(run_dir).find_traces() if r == rank}
    if not traces:
        raise AgainstError(f"--against: {run_dir} has no traces of rank {rank} "
                           "(make it with `zerobench run WORKLOAD --profile`)")
    return traces


def configurations(run_dir: Path) -> tuple[list[str], list[int]]:
    """The configurations (predict's ids: a cell id without its ``-ws<n>``) and world
    sizes of a run's traced cells."""
    from zerobench.spec.cell import CellId

    configs, sizes = [], []
    for cell in run_cells(run_dir):
        cid = CellId.try_parse(cell)
        if cid is None or cid.world_size is None:
            continue
        configs.append(cid.config)
        sizes.append(cid.world_size)
    return list(dict.fromkeys(configs)), sorted(set(sizes))


def compare(run_dir: Path, predict_dir: Path, rank: int = 0) -> pd.DataFrame:
    """One row per cell (traced in the run and predicted) and quantity (:data:`QUANTITIES`):
    ``measured_s``, ``predicted_s``, ``error`` (predicted / measured - 1)."""
    from zerobench.analysis.profiling.kernels import mean_breakdown
    from zerobench.analysis.profiling.trace import load_trace
    from zerobench.runs.folder import RunFolder
    from zerobench.runs.whatif import PredictFolder
    from zerobench.spec.cell import CellId

    folder = PredictFolder(predict_dir)
    if not folder.exists():
        raise AgainstError(f"{predict_dir}: no predict.csv (a `zerobench predict` folder)")
    predicted = folder.table()
    timed = RunFolder(run_dir).results()
    if "rank" in timed.columns:
        timed = timed[timed["rank"] == rank]
    rows = []
    for cell, path in run_cells(run_dir, rank).items():
        virtual = folder.trace_path(cell)
        if not virtual.exists():
            continue  # not predicted (another configuration or world size)
        measured, modelled = mean_breakdown(load_trace(path)), mean_breakdown(load_trace(virtual))
        measured["step_time_s"] = _one(timed[timed["cell_id"] == cell], "step_time_s")
        cid = CellId.parse(cell)
        row = predicted[(predicted["config"] == cid.config) & (predicted["world_size"] == cid.world_size)]
        modelled["step_time_s"] = _one(row, "step_time_s")
        for breakdown in (measured, modelled):
            breakdown.update(profiler_split(breakdown))
        measured["host_busy_s"] = host_busy(load_trace(path))
        measured["device_busy_s"] = measured.get("busy_s")
        for quantity, _ in HOST_QUANTITIES:
            if quantity.startswith("host_") or quantity == "device_busy_s":  # predict.csv's
                modelled[quantity] = _one(row, quantity)
        for quantity, label in QUANTITIES + HOST_QUANTITIES:
            m, p = measured.get(quantity), modelled.get(quantity)
            rows.append({"cell": cell, "quantity": label, "measured_s": m, "predicted_s": p,
                         "error": p / m - 1 if m and p is not None and m == m and p == p else None})
    if not rows:
        raise AgainstError(f"--against: no cell traced in {run_dir} was predicted in {predict_dir}")
    return pd.DataFrame(rows)


def profiler_split(breakdown: dict) -> dict:
    """``profiler_s`` and ``host_idle_timed_s`` of one cell's breakdown: [Note: the profiler's
    own cost]. Empty without both steps."""
    traced, timed, idle = breakdown.get("step_s"), breakdown.get("step_time_s"), breakdown.get("host_idle_s")
    if traced is None or timed is None or idle is None or traced != traced or timed != timed:
        return {}
    profiler = max(traced - timed, 0.0)
    return {"profiler_s": profiler, "host_idle_timed_s": max(idle - profiler, 0.0)}


def host_busy(trace) -> float | None:
    """The host's busy time per step of a GPU trace, on average: each step of the main
    thread less the time it spent in CUDA's synchronize calls (waiting for the device). The
    profiler's own cost is in it, and so is a launch that blocked on a full queue."""
    from zerobench.analysis.profiling.overlap import step_windows

    main = trace.main
    waits = main[(main["cat"] == "cuda_runtime") & main["name"].str.contains("Synchronize")]
    if "cuda_runtime" not in set(main["cat"]):
        return None  # not a GPU's trace
    spans = waits[["ts", "end"]].to_numpy(dtype=float)
    busy = []
    for start, end in step_windows(trace)[["ts", "end"]].to_numpy(dtype=float):
        waited = sum(max(min(b, end) - max(a, start), 0.0) for a, b in spans)
        busy.append((end - start - waited) * 1e-6)
    return sum(busy) / len(busy) if busy else None


def _one(frame: pd.DataFrame, column: str):
    return float(frame[column].iloc[0]) if len(frame) and column in frame and pd.notna(frame[column].iloc[0]) else None


def measured_on(run_dir: Path) -> str:
    """Where a run was measured, in words: its GPU and backend, or its CPU over gloo."""
    from zerobench.runs.folder import DamagedFile, RunFolder

    try:
        meta = RunFolder(run_dir).meta()
    except (DamagedFile, OSError):
        meta = {}
    backend = meta.get("backend") or "an unknown backend"
    if meta.get("gpu_model"):
        return f"{meta['gpu_model']} ({backend})"
    return f"CPU ({meta.get('cpu_model') or 'unknown model'}, {backend})"


def device_warning(run_dir: Path, gpu: str) -> str | None:
    """Why the measured run and the prediction are not like for like, or None: a run
    measured on a CPU (every class's error is then CPU against GPU), or on a GPU whose
    closest preset is not the one predicted ([Note: against what was measured])."""
    from zerobench.instruments.vgpu.presets import preset_for_device
    from zerobench.runs.folder import DamagedFile, RunFolder

    try:
        meta = RunFolder(run_dir).meta()
    except (DamagedFile, OSError):
        return None
    where = measured_on(run_dir)
    if not meta.get("gpu_model"):
        return (f"{run_dir} was measured on {where}, the prediction is of a virtual {gpu}: every error below is a "
                f"CPU's step against a GPU's, not the model's error (predict --against judges GPU runs)")
    closest = preset_for_device(str(meta["gpu_model"]))
    if Path(gpu).suffix != ".json" and closest != gpu:
        return (f"{run_dir} was measured on {where}, whose preset is {closest}; the prediction is of a virtual "
                f"{gpu}: the errors below compare two GPUs (--gpu {closest} predicts the measured one)")
    return None


# [Note: against what was measured]
# `predict --against RUN` puts a measurement beside a prediction class by class; that is
# the model's error only when both are of the same GPU. A run measured on a CPU over gloo
# (where zerobench's quick start runs) or on another GPU than the preset's is still
# compared, since a reader may want the figures, but a warning says so before the table,
# and the title of the table and of against.png names both devices.


def against_table(frame: pd.DataFrame, title: str = ""):
    """The table, through the one renderer ([Note: tables at any width] in
    zerobench/analysis/render.py): one block per cell, milliseconds per step measured and
    predicted, and the error."""
    from zerobench.analysis.render import Column, Table, format_column

    table = Table([Column("cell", "left", "parts", role="group"), Column("ms per step", "left", "words"),
                   Column("measured"), Column("predicted"), Column("error")],
                  title=title or "measured beside predicted, per step:")
    measured = format_column([None if v is None or v != v else v * 1e3 for v in frame["measured_s"]], decimals=3)
    predicted = format_column([None if v is None or v != v else v * 1e3 for v in frame["predicted_s"]], decimals=3)
    errors = [("" if v is None or v != v else f"{v:+.0%}") for v in frame["error"]]
    for k, r in enumerate(frame.itertuples()):
        table.add_row(r.cell, r.quantity, measured[k], predicted[k], errors[k])
    return table


def plot_against(frame: pd.DataFrame, path: Path, title: str = "") -> Path | None:
    """One panel per cell: each quantity measured and predicted, ms per step."""
    from zerobench.analysis.figures import figure_title, plt, save_figure

    cells = list(dict.fromkeys(frame["cell"]))
    if not cells:
        return None
    labels = [label for _, label in QUANTITIES + HOST_QUANTITIES]
    columns = min(len(cells), 2)
    rows_ = (len(cells) + columns - 1) // columns
    fig, axes = plt.subplots(rows_, columns, figsize=(7 * columns, 0.32 * len(labels) * rows_ + 1.2 * rows_ + 0.6),
                             squeeze=False)
    y = list(range(len(labels)))
    for ax, cell in zip(axes.flat, cells):
        part = frame[frame["cell"] == cell].set_index("quantity").reindex(labels)
        ax.barh([v - 0.2 for v in y], part["measured_s"].astype(float).fillna(0) * 1e3, height=0.4,
                color="tab:gray", label="measured")
        ax.barh([v + 0.2 for v in y], part["predicted_s"].astype(float).fillna(0) * 1e3, height=0.4,
                color="tab:blue", label="predicted")
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(cell, fontsize=9)
        ax.set_xlabel("ms per step")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    top = figure_title(fig, title or "measured beside predicted, by kernel class", None)  # wrapped to fit
    fig.tight_layout(rect=(0, 0, 1, top))
    return save_figure(fig, path, tight=False)


def write(frame: pd.DataFrame, out_dir: Path, title: str = "") -> list[Path]:
    """against.csv, against.md and plots/against.png in ``out_dir``, each written atomically."""
    from zerobench.runs.files import write_atomic, write_csv_atomic

    out_dir = Path(out_dir)
    write_csv_atomic(out_dir / "against.csv", frame)
    from zerobench.analysis.render import markdown

    text = markdown(against_table(frame, title))
    write_atomic(out_dir / "against.md", lambda f: f.write(text))
    written = [out_dir / "against.csv", out_dir / "against.md"]
    plot = plot_against(frame, out_dir / "plots" / "against.png", title)
    return written + ([plot] if plot else [])


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m zerobench.whatif.predict.against RUN PREDICT_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    run_dir, predict_dir = Path(argv[0]), Path(argv[1])
    try:
        frame = compare(run_dir, predict_dir)
    except (ValueError, OSError) as err:  # AgainstError, a folder that is not a run's
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in write(frame, Path(argv[2]) if len(argv) == 3 else predict_dir, f"{run_dir.name} against {predict_dir.name}"):
        print(f"wrote {path}")
    from zerobench.analysis.render import print_table

    print_table(against_table(frame))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
