"""Print what a results folder holds, as tables that fit the terminal: a run's summary
(each cell's step time, peak memory and communication, and their ratios to DDP at the
same world size and dtype), an estimate's per-rank peaks and model states, or a
prediction's step time, overlap and memory. An interrupted run shows the cells that
finished and the command that runs the others.

FOLDER is a run, estimate or predict folder, or `latest` (the newest of any kind under
results/), `latest:run`, `latest:estimate`, `latest:predict`; DIR/latest looks under DIR.
"""

from __future__ import annotations

from zerobench.commands.args import ALL_KINDS, ArgumentError, resolve_folder

HELP = "print a run's, an estimate's or a prediction's tables (FOLDER, `latest` or `latest:KIND`)"


def arguments(p) -> None:
    p.add_argument("folder", metavar="FOLDER", help="run, estimate or predict folder, `latest` or `latest:KIND`")


def main(args) -> int:
    from pathlib import Path

    from zerobench.runs.kinds import folder_kind

    folder = resolve_folder(args.folder, "FOLDER", kinds=ALL_KINDS)
    kind = folder_kind(folder)
    if kind is None:
        raise ArgumentError(f"FOLDER: {args.folder} is not a results folder: no meta.json, cells/, results.csv, "
                            f"estimate.csv or predict.csv (allowed: a run, estimate or predict folder, or latest)")

    from zerobench.analysis.render import make_console

    console = make_console()
    if kind == "estimate":
        from zerobench.whatif.estimate.report import show_estimate

        show_estimate(folder, console)
    elif kind == "predict":
        from zerobench.whatif.predict.report import show_predict

        show_predict(folder, console)
    else:
        from zerobench.analysis.summary import print_summary
        from zerobench.harness import active

        here = Path(folder).absolute()
        running = next((r for r in active.others() if Path(str(r.get("run_dir", ""))) == here), None)
        print_summary(folder, console, running=running)
    return 0
