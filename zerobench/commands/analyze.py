"""Every trace of a profiled run in, per cell x rank columns out: overlap, exposed
communication, all-gathers in flight and bandwidth (docs/profiling.md)."""

from __future__ import annotations

from zerobench.commands.args import resolve_folder

HELP = "overlap, exposed communication, in-flight all-gathers and bandwidth from a run's traces"


def arguments(p) -> None:
    p.add_argument("run", help="run folder (results/<run-id>) recorded with --profile, or `latest:run`")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")


def main(args) -> int:
    run = resolve_folder(args.run, "RUN")

    from zerobench.analysis.profiling.analyze import analyze_run, summary_table
    from zerobench.analysis.render import print_table
    from zerobench.runs.folder import RunFolder

    try:
        summary = analyze_run(run, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"zerobench analyze: {e}")
        return 2
    print_table(summary_table(summary))
    folder = RunFolder(run)
    merged = "merged into results.csv" if folder.results_path.exists() else "no results.csv to merge into"
    print(f"wrote {folder.analysis_dir}/ ({merged}); plots in {folder.plots_dir}/")
    return 0
