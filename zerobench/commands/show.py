"""Print a run's summary table: each cell's step time and peak memory, and their ratios
to DDP at the same world size and dtype (results/<run-id>/results.csv).

RUN is a run folder, or `latest` (the newest under results/; DIR/latest: under DIR).
"""

from __future__ import annotations

from zerobench.commands.args import resolve_folder

HELP = "print a run's summary table (RUN or `latest`)"


def arguments(p) -> None:
    p.add_argument("run", help="run folder, or `latest`")


def main(args) -> int:
    run = resolve_folder(args.run, "RUN")

    from zerobench.analysis.summary import print_summary

    print_summary(run)
    return 0
