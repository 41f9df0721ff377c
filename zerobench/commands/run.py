"""Run a workload's matrix: every cell as a real torch.distributed world (gloo on CPU,
NCCL on GPUs), then a summary table, plots and results/<run-id>/.

WORKLOAD is a TOML file or the name of a shipped one (quickstart, gpt-small, ...: the
files of workloads/). Exit codes: 0 every cell ok or skipped, 1 a cell failed (0 with
--allow-failures), 2 bad input (nothing written), 130 interrupted (resume the folder).
"""

from __future__ import annotations

from zerobench.commands.args import (
    DEFAULT_RESULTS,
    ArgumentError,
    add_overrides,
    check_results_folder,
    resolve_folder,
    results_root,
)

HELP = "run a workload's matrix (default: the shipped quickstart)"
DEFAULT_WORKLOAD = "quickstart"


def arguments(p) -> None:
    p.add_argument("workload", nargs="?", default=None,
                   help=f"workload TOML file or shipped workload name (default: {DEFAULT_WORKLOAD})")
    add_overrides(p)
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS,
                   help="folder of run folders (default: results)")
    p.add_argument("--resume", metavar="RUN",
                   help="finish an interrupted run: skip its ok/skipped cells (RUN may be `latest:run`)")
    p.add_argument("--cell", "--cells", action="append", dest="cell", metavar="ID",
                   help="run only this cell (repeatable; see `zerobench cells`)")
    p.add_argument("--profile", action="store_true", help="also record a torch.profiler trace per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA+NCCL when there is a GPU per rank, else CPU+gloo")
    p.add_argument("--no-plots", action="store_true", help="skip drawing plots")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when cells failed (default: exit 1 when any cell failed)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the run folder and print the torchrun command of each cell, run nothing")


def main(args) -> int:
    resume = None
    if args.resume is not None:
        if args.workload is not None:
            raise ArgumentError(f"--resume {args.resume}: the run's workload is its workload.json; "
                                f"leave out WORKLOAD ({args.workload}) (allowed: `zerobench run --resume RUN`)")
        if args.overrides:
            raise ArgumentError(f"--resume {args.resume}: the run's workload is its workload.json; leave out "
                                f"--set {args.overrides[0]} (allowed: `zerobench run --resume RUN`)")
        resume = resolve_folder(args.resume, "--resume", results=args.results)
    else:
        check_results_folder(args.results)

    from rich.text import Text

    from zerobench.analysis.plots import plot_run
    from zerobench.analysis.render import make_console
    from zerobench.analysis.summary import print_summary
    from zerobench.harness.runner import CannotWrite, Interrupted, cell_counts, run_matrix

    console = make_console()
    try:
        run_dir = run_matrix(args.workload or DEFAULT_WORKLOAD, results_root=args.results, resume=resume,
                             only=args.cell, profile=args.profile, device=args.device,
                             prepare_only=args.prepare_only, console=console, overrides=args.overrides)
    except Interrupted as stop:
        counts = cell_counts(stop.run_dir)
        console.print(Text(f"interrupted: {counts_line(counts)} so far; the ranks of the cell in flight were "
                           f"stopped. Resume with:\n  zerobench run --resume {stop.run_dir}"))
        return 130
    except CannotWrite as full:
        console.print(Text(f"zerobench: error: {full}"), style="bold red")
        return 2
    if args.prepare_only:
        return 0
    print_summary(run_dir, console)
    if not args.no_plots:
        for path in plot_run(run_dir):
            console.print(Text(f"plot: {path}"))
    if args.profile:
        from zerobench.analysis.profiling.analyze import analyze_run

        analyze_run(run_dir, plots=not args.no_plots)
        console.print(Text(f"traces: {run_dir / 'traces'} (analysis: {run_dir / 'analysis'}, see docs/profiling.md)"))
    console.print(Text(f"results: {run_dir / 'results.csv'}"))
    counts = cell_counts(run_dir)
    failed = counts.get("failed", 0)
    console.print(Text(f"cells: {counts_line(counts)}"
                       + (" (--allow-failures: exit 0)" if failed and args.allow_failures else "")),
                  style="bold red" if failed else "bold")
    return 1 if failed and not args.allow_failures else 0


def counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in ("ok", "failed", "skipped"))
