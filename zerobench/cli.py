"""The ``zerobench`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_WORKLOAD = "workloads/quickstart.toml"


def cmd_run(args) -> int:
    """Exit 0 when every cell ended ok or skipped, 1 when any failed (0 with
    --allow-failures), 130 on Ctrl-C (the run folder resumes), 2 on bad input."""
    from rich.text import Text

    from zerobench.analysis.plots import plot_run
    from zerobench.analysis.summary import print_summary, wide_console
    from zerobench.harness.runner import Interrupted, cell_counts, run_matrix

    console = wide_console()
    try:
        run_dir = run_matrix(args.workload, results_root=args.results, resume=args.resume, only=args.cell,
                             profile=args.profile, device=args.device, prepare_only=args.prepare_only,
                             console=console)
    except Interrupted as stop:
        counts = cell_counts(stop.run_dir)
        console.print(Text(f"interrupted: {_counts_line(counts)} so far; the ranks of the cell in flight were "
                           f"stopped. Resume with:\n  zerobench run --resume {stop.run_dir}"))
        return 130
    if args.prepare_only:
        return 0
    print_summary(run_dir, console)
    if not args.no_plots:
        for path in plot_run(run_dir):
            console.print(f"plot: {path}")
    if args.profile:
        from zerobench.analysis.profiling.analyze import analyze_run

        analyze_run(run_dir, plots=not args.no_plots)
        console.print(f"traces: {run_dir / 'traces'} (analysis: {run_dir / 'analysis'}, see docs/profiling.md)")
    console.print(Text(f"results: {run_dir / 'results.csv'}"))
    counts = cell_counts(run_dir)
    failed = counts.get("failed", 0)
    console.print(Text(f"cells: {_counts_line(counts)}"
                       + (" (--allow-failures: exit 0)" if failed and args.allow_failures else "")),
                  style="bold red" if failed else "bold")
    return 1 if failed and not args.allow_failures else 0


def _counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in ("ok", "failed", "skipped"))


def cmd_plot(args) -> int:
    from zerobench.analysis.plots import plot_run

    for path in plot_run(args.run):
        print(f"plot: {path}")
    return 0


def cmd_list(args) -> int:
    from zerobench.analysis.summary import list_runs

    list_runs(args.results)
    return 0


def cmd_show(args) -> int:
    from zerobench.analysis.summary import print_summary

    print_summary(args.run)
    return 0


def cmd_reference(args) -> int:
    """The explicit repair of a run folder whose cells ran under torchrun."""
    from zerobench.harness.reference import complete_run
    from zerobench.runs.folder import RunFolder

    folder = RunFolder(args.run)
    if not folder.workload_path.exists():
        raise FileNotFoundError(f"{args.run}: not a zerobench run folder (no workload.json)")
    updated = complete_run(args.run)
    print(f"reference: {len(updated)} cell(s) checked against the single-process reference; "
          f"tables written to {folder.results_path}")
    return 0


def cmd_engines(args) -> int:
    from zerobench.engines import ENGINES
    from zerobench.spec.matrix import engine_axes

    for name in ENGINES:
        print(name)
        for axis, spec in engine_axes(name).items():
            allowed = spec.allowed()
            doc = f"  ({spec.doc})" if spec.doc else ""
            print(f"    {axis} = {spec.default!r}   allowed: {allowed}{doc}")
    return 0


def cmd_cells(args) -> int:
    from zerobench.spec.matrix import expand
    from zerobench.spec.workload import load_workload

    for cell in expand(load_workload(args.workload)):
        note = f"   # skipped: {cell.skip_reason}" if cell.skip_reason else ""
        print(f"{cell.id}{note}")
    return 0


def register_run(sub) -> None:
    p = sub.add_parser("run", help="run a workload's matrix (default: workloads/quickstart.toml)")
    p.add_argument("workload", nargs="?", default=DEFAULT_WORKLOAD, help="workload TOML file")
    p.add_argument("--results", type=Path, default=Path("results"), help="folder of run folders (default: results)")
    p.add_argument("--resume", type=Path, metavar="RUN", help="finish an interrupted run: skip its ok/skipped cells")
    p.add_argument("--cell", action="append", metavar="ID", help="run only this cell (repeatable; see `zerobench cells`)")
    p.add_argument("--profile", action="store_true", help="also record a torch.profiler trace per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA+NCCL when there is a GPU per rank, else CPU+gloo")
    p.add_argument("--no-plots", action="store_true", help="skip drawing plots")
    p.add_argument("--allow-failures", action="store_true",
                   help="exit 0 even when cells failed (default: exit 1 when any cell failed)")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the run folder and print the torchrun command of each cell, run nothing")
    p.set_defaults(func=cmd_run)


def register_plot(sub) -> None:
    p = sub.add_parser("plot", help="redraw a run's plots (reads the folder; writes only plots/)")
    p.add_argument("run", type=Path)
    p.set_defaults(func=cmd_plot)


def register_show(sub) -> None:
    p = sub.add_parser("show", help="print a run's summary table (reads the folder, writes nothing)")
    p.add_argument("run", type=Path)
    p.set_defaults(func=cmd_show)


def register_reference(sub) -> None:
    p = sub.add_parser("reference", help="compute the loss reference of cells run under torchrun and write the tables "
                                         "(trains the run's model: only for folders you trust)")
    p.add_argument("run", type=Path)
    p.set_defaults(func=cmd_reference)


def register_list(sub) -> None:
    p = sub.add_parser("list", help="list the runs under results/")
    p.add_argument("--results", type=Path, default=Path("results"))
    p.set_defaults(func=cmd_list)


def register_engines(sub) -> None:
    p = sub.add_parser("engines", help="list the engines and their matrix axes")
    p.set_defaults(func=cmd_engines)


def register_cells(sub) -> None:
    p = sub.add_parser("cells", help="list a workload's cell ids (for running one under torchrun)")
    p.add_argument("workload", nargs="?", default=DEFAULT_WORKLOAD)
    p.set_defaults(func=cmd_cells)


# -- compare ------------------------------------------------------------------------------


def register_compare(sub) -> None:
    from zerobench.analysis.compare.gate import GATES, __doc__ as compare_doc

    p = sub.add_parser(
        "compare", help="compare a run with a baseline; exit 0 ok, 1 regression, 2 unusable input",
        description=compare_doc.split("\n\n")[0] + " Exit codes: 0 within bounds, 1 regression, 2 unusable input.",
    )
    p.add_argument("baseline", type=Path, help="baseline run folder (e.g. results/baselines/cpu-quick)")
    p.add_argument("run", type=Path, help="new run folder")
    p.add_argument("--fail-on", action="append", default=[], metavar="RULE",
                   help="gate METRIC with a tolerance: NAME:+TOL[%%][,k=K], e.g. peak_mem:+2%%, "
                        "comm_total_bytes:+0, step_time:+15%%,k=3 (repeatable; always gates)")
    p.add_argument("--gate", choices=GATES, default="deterministic",
                   help="which default rules gate: deterministic metrics only (default; time is reported), "
                        "all (time too: +10%%, k=3), none (only --fail-on rules)")
    p.add_argument("--report-only", action="append", default=[], metavar="METRIC",
                   help="judge and show METRIC but do not gate on it by default (name, prefix or glob; "
                        "repeatable; a --fail-on rule still gates it), e.g. --report-only 'peak_mem_*' "
                        "--fail-on peak_mem:+5%% gates peak_mem_bytes alone")
    p.add_argument("--per-rank", action="store_true", help="compare rank by rank instead of per cell")
    p.add_argument("--all", action="store_true", dest="show_all", help="show every compared row, not only changes")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="write a Markdown report (for a CI summary)")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG of the changes")
    p.add_argument("--csv", type=Path, metavar="PATH", help="write the comparison table as CSV")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    """Exit code: 0 within bounds, 1 on a gated regression, 2 on unusable input."""
    from zerobench.analysis.compare import report
    from zerobench.analysis.compare.gate import (METRICS, RunLoadError, compare_runs, config_mismatches, exit_code,
                                   hardware_differences, load_run, parse_rules, resolve_metric)

    console = report.make_console()
    try:
        baseline, new = load_run(args.baseline), load_run(args.run)
        names = list(dict.fromkeys([*baseline.metric_columns, *new.metric_columns,
                                    *(m.name for m in METRICS)]))
        rules = parse_rules(args.fail_on, names)
        report_only = [m for text in args.report_only for m in resolve_metric(text, names, rule=text)]
    except (RunLoadError, ValueError) as e:
        console.print(f"compare: {e}", style="bold red", markup=False)  # paths and errors may hold [brackets]
        return 2
    comparison = compare_runs(baseline, new, rules, gate=args.gate, per_rank=args.per_rank, report_only=report_only)
    mismatches = config_mismatches(baseline, new)
    code = exit_code(comparison, mismatches)
    info = report.ReportInfo(baseline=str(args.baseline), new=str(args.run), gate=args.gate,
                             rules=[r.text for r in rules] + [f"report-only {t}" for t in args.report_only],
                             exit_code=code, hardware=hardware_differences(baseline.meta, new.meta))
    report.print_report(console, comparison, mismatches, info, show_all=args.show_all)
    if args.markdown:
        report.write_markdown(args.markdown, comparison, mismatches, info)
    if args.plot:
        report.plot_changes(comparison, args.plot, title=f"{args.run.name} vs {args.baseline.name} -- "
                                                        + report.summary_line(comparison, info))
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        comparison.to_csv(args.csv, index=False)
    return code


# -- analyze ------------------------------------------------------------------------------


def register_analyze(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="overlap, exposed communication, in-flight all-gathers and bandwidth from a run's traces",
        description="Every trace of a run in, per cell x rank columns out (docs/profiling.md).",
    )
    p.add_argument("run", type=Path, help="run folder (results/<run-id>) recorded with --profile")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(args) -> int:
    import pandas as pd

    from zerobench.analysis.profiling.analyze import analyze_run

    try:
        summary = analyze_run(args.run, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"zerobench analyze: {e}")
        return 2
    cols = [c for c in ("cell_id", "rank", "overlap_ratio", "exposed_comm_s", "compute_s", "idle_s",
                        "max_inflight_all_gathers_trace") if c in summary.columns]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summary[cols].round(4).to_string(index=False))
    run = Path(args.run)
    merged = "merged into results.csv" if (run / "results.csv").exists() else "no results.csv to merge into"
    print(f"wrote {run / 'analysis'}/ ({merged}); plots in {run / 'plots'}/")
    return 0


def register_simulate(sub) -> None:
    from zerobench.whatif.simulate.cli import register_cli  # pure Python, no torch: see docs/simulate.md

    register_cli(sub)


def register_estimate(sub) -> None:
    from zerobench.whatif.estimate import register_cli

    register_cli(sub)


def register_predict(sub) -> None:
    from zerobench.whatif.predict import register_cli

    register_cli(sub)


#: One register function per subcommand, in the order `zerobench --help` lists them.
#: A new command adds its ``register_<name>(subparsers)`` here.
COMMANDS = [register_run, register_plot, register_show, register_reference, register_list, register_engines, register_cells,
            register_compare, register_analyze, register_estimate, register_simulate, register_predict]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerobench", description="Profiling-first benchmarks of ZeRO / FSDP engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from zerobench.spec.workload import WorkloadError

    try:
        return args.func(args)
    except (WorkloadError, FileNotFoundError, ValueError) as err:
        print(f"zerobench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
