"""Every trace of a profiled run in, per cell x rank columns out: overlap, exposed
communication, all-gathers in flight and bandwidth (docs/profiling.md)."""

from __future__ import annotations

from zerobench.commands.args import resolve_folder

HELP = "overlap, exposed communication, in-flight all-gathers and bandwidth from a run's traces"


def arguments(p) -> None:
    p.add_argument("run", help="run folder (results/<run-id>) recorded with --profile, or `latest`")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")


def main(args) -> int:
    run = resolve_folder(args.run, "RUN")

    import pandas as pd

    from zerobench.analysis.profiling.analyze import analyze_run
    from zerobench.runs.folder import RunFolder

    try:
        summary = analyze_run(run, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"zerobench analyze: {e}")
        return 2
    cols = [c for c in ("cell_id", "rank", "overlap_ratio", "exposed_comm_s", "compute_s", "idle_s",
                        "max_inflight_all_gathers_trace") if c in summary.columns]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summary[cols].round(4).to_string(index=False))
    folder = RunFolder(run)
    merged = "merged into results.csv" if folder.results_path.exists() else "no results.csv to merge into"
    print(f"wrote {folder.analysis_dir}/ ({merged}); plots in {folder.plots_dir}/")
    return 0
