"""The ``zerobench`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

DEFAULT_WORKLOAD = "workloads/quickstart.toml"


def cmd_run(args) -> int:
    from zerobench.plots import plot_run
    from zerobench.report import print_summary, wide_console
    from zerobench.runner import run_matrix

    console = wide_console()
    run_dir = run_matrix(args.workload, results_root=args.results, resume=args.resume, only=args.cell,
                         profile=args.profile, device=args.device, prepare_only=args.prepare_only, console=console)
    if args.prepare_only:
        return 0
    print_summary(run_dir, console)
    if not args.no_plots:
        for path in plot_run(run_dir):
            console.print(f"plot: {path}")
    if args.profile:
        from zerobench.profiling.analyze import analyze_run

        analyze_run(run_dir, plots=not args.no_plots)
        console.print(f"traces: {run_dir / 'traces'} (analysis: {run_dir / 'analysis'}, see docs/profiling.md)")
    console.print(f"results: {run_dir / 'results.csv'}")
    return 0


def cmd_plot(args) -> int:
    from zerobench.plots import plot_run

    for path in plot_run(args.run):
        print(f"plot: {path}")
    return 0


def cmd_list(args) -> int:
    from zerobench.report import list_runs

    list_runs(args.results)
    return 0


def cmd_show(args) -> int:
    from zerobench.report import print_summary

    print_summary(args.run)
    return 0


def cmd_engines(args) -> int:
    from zerobench.engines import ENGINES
    from zerobench.matrix import engine_axes

    for name in ENGINES:
        print(name)
        for axis, spec in engine_axes(name).items():
            allowed = ", ".join(map(repr, spec.choices)) if spec.choices else f"{spec.type.__name__} >= {spec.minimum}"
            doc = f"  ({spec.doc})" if spec.doc else ""
            print(f"    {axis} = {spec.default!r}   allowed: {allowed}{doc}")
    return 0


def cmd_cells(args) -> int:
    from zerobench.matrix import expand
    from zerobench.workload import load_workload

    for cell in expand(load_workload(args.workload)):
        note = f"   # skipped: {cell.skip_reason}" if cell.skip_reason else ""
        print(f"{cell.id}{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerobench", description="Profiling-first benchmarks of ZeRO / FSDP engines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a workload's matrix (default: workloads/quickstart.toml)")
    p.add_argument("workload", nargs="?", default=DEFAULT_WORKLOAD, help="workload TOML file")
    p.add_argument("--results", type=Path, default=Path("results"), help="folder of run folders (default: results)")
    p.add_argument("--resume", type=Path, metavar="RUN", help="finish an interrupted run: skip its ok/skipped cells")
    p.add_argument("--cell", action="append", metavar="ID", help="run only this cell (repeatable; see `zerobench cells`)")
    p.add_argument("--profile", action="store_true", help="also record a torch.profiler trace per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA+NCCL when there is a GPU per rank, else CPU+gloo")
    p.add_argument("--no-plots", action="store_true", help="skip drawing plots")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the run folder and print the torchrun command of each cell, run nothing")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plot", help="redraw a run's plots")
    p.add_argument("run", type=Path)
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("show", help="print a run's summary table")
    p.add_argument("run", type=Path)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("list", help="list the runs under results/")
    p.add_argument("--results", type=Path, default=Path("results"))
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("engines", help="list the engines and their matrix axes")
    p.set_defaults(func=cmd_engines)

    p = sub.add_parser("cells", help="list a workload's cell ids (for running one under torchrun)")
    p.add_argument("workload", nargs="?", default=DEFAULT_WORKLOAD)
    p.set_defaults(func=cmd_cells)

    # Subcommands that live with their own modules.
    for module in ("zerobench.compare", "zerobench.profiling.analyze", "zerobench.estimate"):
        try:
            importlib.import_module(module).register_cli(sub)
        except (ImportError, AttributeError):
            pass
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from zerobench.workload import WorkloadError

    try:
        return args.func(args)
    except (WorkloadError, FileNotFoundError, ValueError) as err:
        print(f"zerobench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
