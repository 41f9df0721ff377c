"""Redraw the plots of a results folder into its plots/: a run's (step time, peak
memory, the memory/time Pareto front, losses, memory timeline, knobs), an estimate's
(peak per rank against world size) or a prediction's.

FOLDER is a run, estimate or predict folder, or `latest` (the newest of any kind under
results/) or `latest:KIND`.
"""

from __future__ import annotations

from pathlib import Path

from zerobench.commands.args import FOLDER_KINDS, resolve_folder

HELP = "redraw the plots of a run, estimate or predict folder (or `latest`)"


def arguments(p) -> None:
    p.add_argument("run", metavar="FOLDER", help="run, estimate or predict folder, `latest` or `latest:KIND`")


def main(args) -> int:
    folder = resolve_folder(args.run, "FOLDER", kinds=tuple(FOLDER_KINDS))

    from zerobench.commands.progress import Progress

    with Progress(None, "plot") as progress:
        drawn = plot_folder(folder, progress)
    for path in drawn:
        print(f"plot: {path}")
    return 0


def plot_folder(folder: Path, progress=None) -> list[Path]:
    """Draw the plots of any results folder from the table it holds: a run's
    (zerobench.analysis.plots.plot_run), an estimate's or a prediction's. Returns the
    files written."""
    from zerobench.runs.kinds import folder_kind

    folder = Path(folder)
    kind = folder_kind(folder)
    if kind == "estimate":
        from zerobench.whatif.estimate.plots import plot_estimate_folder

        return plot_estimate_folder(folder)
    if kind == "predict":
        from zerobench.whatif.predict.plots import plot_predict_folder

        return plot_predict_folder(folder)
    from zerobench.analysis.plots import plot_run

    return plot_run(folder, progress)
