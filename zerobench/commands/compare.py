"""Compare a run with a baseline, cell by cell, and decide whether it regressed: the CI
gate (docs/ci.md). Cells are matched by configuration; each metric gets the baseline,
the new value, the change and a verdict. Two predict folders, or two estimate folders,
compare the same way, every figure exactly ([Note: comparing what-if folders]).

Exit codes: 0 within bounds, 1 a gated regression, 2 unusable input (a folder that
cannot be read, cells in one run only, a bad rule, an output that cannot be written).
"""

from __future__ import annotations

from zerobench.commands.args import ArgumentError, check_writable, output_file, resolve_folder
from zerobench.runs.kinds import FOLDER_KINDS, folder_kind

HELP = "compare a run with a baseline; exit 0 ok, 1 regression, 2 unusable input"


def arguments(p) -> None:
    from zerobench.analysis.compare.rules import GATES

    p.add_argument("baseline", help="baseline folder: a run (e.g. results/baselines/cpu-quickstart), a predict or "
                                    "an estimate folder")
    p.add_argument("run", help="new folder of the same kind, or `latest` / `latest:KIND` (KIND: run, predict, estimate)")
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
    p.add_argument("--cells", "--cell", action="append", default=[], dest="cells", metavar="ID",
                   help="compare only these cells (an id or a glob, comma-separated or repeated), in both folders: "
                        "the baseline's other cells are not missing")
    p.add_argument("--per-rank", action="store_true", help="compare rank by rank instead of per cell")
    p.add_argument("--all", action="store_true", dest="show_all",
                   help="show every compared row (default: on a pass, at most one line per cell)")
    p.add_argument("--markdown", type=output_file, metavar="PATH", help="write a Markdown report (for a CI summary)")
    p.add_argument("--json", type=output_file, metavar="PATH", help="write the outcome and every compared row as JSON")
    p.add_argument("--junit-xml", type=output_file, metavar="PATH",
                   help="write JUnit XML, one test case per cell and metric (GitLab and GitHub test reports)")
    p.add_argument("--plot", type=output_file, metavar="PATH", help="write a PNG of the changes")
    p.add_argument("--csv", type=output_file, metavar="PATH", help="write the comparison table as CSV")


def main(args) -> int:
    """Exit code: 0 within bounds, 1 on a gated regression, 2 on unusable input."""
    outputs = {"--markdown": args.markdown, "--json": args.json, "--junit-xml": args.junit_xml, "--plot": args.plot,
               "--csv": args.csv}
    for option, path in outputs.items():
        if path is not None:
            check_writable(path, option)
    try:
        baseline_dir = resolve_folder(args.baseline, "BASELINE", kinds=tuple(FOLDER_KINDS))
        run_dir = resolve_folder(args.run, "RUN", kinds=(folder_kind(baseline_dir) or "run",))
    except ArgumentError as e:
        _reports_of_unusable_input(args, str(e))  # a CI's test report says why the job failed
        raise

    from zerobench.analysis.compare import ci_report, report
    from zerobench.analysis.compare.gate import (
        RunLoadError,
        compare_runs,
        config_mismatches,
        exit_code,
        hardware_differences,
        load_run,
        parse_rules,
        same_tool,
        select_cells,
    )
    from zerobench.analysis.compare.rules import resolve_metric
    from zerobench.analysis.render import make_console
    from zerobench.commands.progress import Progress
    from zerobench.runs.files import write_csv_atomic
    from zerobench.schema.columns import METRICS

    console = make_console()
    with Progress(2 + sum(p is not None for p in outputs.values()), "compare") as progress:
        try:
            baseline = load_run(baseline_dir)
            progress.advance(f"read {run_dir}")
            new = load_run(run_dir)
            tool = same_tool(baseline, new)
            if args.cells:
                baseline, new = select_cells(baseline, args.cells), select_cells(new, args.cells)
            names = list(dict.fromkeys([*baseline.metric_columns, *new.metric_columns,
                                        *(m.name for m in METRICS)]))
            rules = parse_rules(args.fail_on, names, tool)
            report_only = [m for text in args.report_only for m in resolve_metric(text, names, rule=text)]
        except (RunLoadError, ValueError) as e:
            progress.stop()
            console.print(f"compare: {e}", style="bold red", markup=False)  # paths and errors may hold [brackets]
            _reports_of_unusable_input(args, str(e))
            return 2
        comparison = compare_runs(baseline, new, rules, gate=args.gate, per_rank=args.per_rank,
                                  report_only=report_only)
        progress.advance("compared")
        mismatches = config_mismatches(baseline, new)
        code = exit_code(comparison, mismatches)
        info = report.ReportInfo(baseline=str(baseline_dir), new=str(run_dir), gate=args.gate,
                                 rules=[r.text for r in rules] + [f"report-only {t}" for t in args.report_only]
                                 + ([f"cells {', '.join(args.cells)}"] if args.cells else []),
                                 exit_code=code,
                                 hardware=hardware_differences(baseline.meta, new.meta) if tool == "run" else [])
        progress.stop()
        report.print_report(console, comparison, mismatches, info, show_all=args.show_all)
        if args.json:
            ci_report.write_json(args.json, comparison, mismatches, info)
            progress.advance(f"wrote {args.json}")
        if args.junit_xml:
            ci_report.write_junit(args.junit_xml, comparison, mismatches, info)
            progress.advance(f"wrote {args.junit_xml}")
        if args.markdown:
            report.write_markdown(args.markdown, comparison, mismatches, info)
            progress.advance(f"wrote {args.markdown}")
        if args.plot:
            from zerobench.analysis.plots import run_setting

            report.plot_changes(comparison, args.plot, title=f"{run_dir.name} vs {baseline_dir.name} -- "
                                + report.summary_line(comparison, info) + "\n" + run_setting(run_dir, new.results).line())
            progress.advance(f"wrote {args.plot}")
        if args.csv:
            write_csv_atomic(args.csv, comparison)
    return code


def _reports_of_unusable_input(args, error: str) -> None:
    """The --json and --junit-xml reports of a comparison that could not start: one
    errored test case naming the problem (zerobench/analysis/compare/ci_report.py)."""
    if not (args.json or args.junit_xml):
        return
    import pandas as pd

    from zerobench.analysis.compare import ci_report
    from zerobench.analysis.compare.report import ReportInfo

    info = ReportInfo(baseline=str(args.baseline), new=str(args.run), gate=args.gate, exit_code=2)
    if args.json:
        ci_report.write_json(args.json, pd.DataFrame(), pd.DataFrame(), info, error=error)
    if args.junit_xml:
        ci_report.write_junit(args.junit_xml, pd.DataFrame(), pd.DataFrame(), info, error=error)
