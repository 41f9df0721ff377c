"""List the folders under results/: runs (with their cells ok, failed and skipped),
baselines and curated runs, estimates and predictions, newest last."""

from __future__ import annotations

from zerobench.commands.args import DEFAULT_RESULTS, ArgumentError, results_root

HELP = "list the runs, estimates, predictions and baselines under results/"


def arguments(p) -> None:
    p.add_argument("--results", type=results_root, default=DEFAULT_RESULTS, help="folder to list (default: results)")


def main(args) -> int:
    if args.results.exists() and not args.results.is_dir():
        raise ArgumentError(f"--results: {args.results} is not a folder (allowed: the folder of results, "
                            f"default results)")

    from zerobench.analysis.summary import list_runs

    list_runs(args.results)
    return 0
